"""Incremental detokenization and server-side stop strings."""

import copy
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from common.tiny_model import SPECIAL_TOKEN_IDS, VOCAB_SIZE
from scheduler_svc.engine.detok import Detokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def stream_all(tok, ids, stop=(), step=1):
    ts = Detokenizer(tok, stop)
    out = []
    for i in range(0, len(ids), step):
        out.append(ts.add(ids[i : i + step]))
        if ts.stopped_by:
            break
    out.append(ts.flush())
    return ts, "".join(out)


@pytest.mark.parametrize("step", [1, 3])
def test_deltas_concatenate_to_the_full_decode(tokenizer, step):
    text = "A red circle sits above a quiet blue lake, and the green hills fade into grey mist."
    ids = tokenizer.encode(text)
    ts, streamed = stream_all(tokenizer, ids, step=step)
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True)
    assert ts.stopped_by is None


def test_multibyte_characters_are_never_split(tokenizer):
    text = "naïve café — über 日本"
    ids = tokenizer.encode(text)
    ts = Detokenizer(tokenizer)
    pieces = [ts.add([i]) for i in ids] + [ts.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_truncates_and_is_not_emitted(tokenizer):
    text = "the sky is blue. STOP here and more text"
    ids = tokenizer.encode(text)
    ts, streamed = stream_all(tokenizer, ids, stop=["STOP"])
    assert ts.stopped_by == "STOP"
    assert streamed == "the sky is blue. "


@pytest.mark.parametrize("stop", [(), ("STOP",)])
@pytest.mark.parametrize("step", [1, 2])
def test_a_cut_inside_a_character_drops_its_incomplete_bytes(tokenizer, stop, step):
    """Generation cut (max_tokens) inside a multi-byte character: the text ends before it, never in "\ufffd" —
    streamed token by token or in batches, with a stop string pending or not."""
    ids = tokenizer.encode("ok 😀")
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")  # the emoji's bytes span several tokens
    ts, streamed = stream_all(tokenizer, ids[:-1], stop=stop, step=step)
    assert streamed == "ok "
    assert ts.stopped_by is None


def test_partial_stop_prefix_is_held_back_then_released(tokenizer):
    ids = tokenizer.encode("a red ST and a blue square")
    ts, streamed = stream_all(tokenizer, ids, stop=["STOP"])
    assert ts.stopped_by is None
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True)


# --- DecodeStream against the tokenizer's full decode (hypothesis) ------------------------------------------------

# Characters the tiny byte-level BPE splits over several byte tokens: 2-byte Latin, 3-byte CJK, 4-byte emoji, a
# combining mark, ZWJ sequences, and plain ASCII around them.
PIECES = [*"ab ,.\n", *"éüñ—日本語漢字かな한글", "😀", "🎉", "👍🏽", "e\u0301", "🧑\u200d💻"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)


@pytest.fixture(scope="module", params=["decode-stream", "windowed"])
def any_tokenizer(request, tokenizer):
    """The tiny tokenizer as served (DecodeStream), and a copy whose decode would clean up spaces, which Detokenizer
    decodes with the windowed fallback (the tokenizer's own decode)."""
    if request.param == "decode-stream":
        assert Detokenizer(tokenizer)._stream is not None
        return tokenizer
    windowed = copy.deepcopy(tokenizer)
    windowed.clean_up_tokenization_spaces = True
    assert Detokenizer(windowed)._stream is None
    return windowed


def stream_in_batches(tok, ids, cuts, skip_special_tokens=True):
    """Feeds ``ids`` in batches split at ``cuts``; returns the deltas (flush last)."""
    ts = Detokenizer(tok, skip_special_tokens=skip_special_tokens)
    bounds = [0, *sorted({c % (len(ids) + 1) for c in cuts}), len(ids)]
    deltas = [ts.add(ids[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return deltas + [ts.flush()]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=48),
    cuts=st.lists(st.integers(0, 64), max_size=8),
    skip=st.booleans(),
)
def test_random_token_sequences_stream_to_the_full_decode(any_tokenizer, ids, cuts, skip):
    """Any ids (byte tokens that split characters anywhere, special tokens, invalid UTF-8), in any batches: the
    deltas concatenate to the full decode less the replacement characters of an incomplete UTF-8 tail, and what is
    out at each step is a prefix of it."""
    full = any_tokenizer.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")
    deltas = stream_in_batches(any_tokenizer, ids, cuts, skip)
    assert "".join(deltas) == full
    assert all(full.startswith("".join(deltas[: k + 1])) for k in range(len(deltas)))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=TEXT,
    specials=st.lists(st.tuples(st.integers(0, 64), st.sampled_from(sorted(SPECIAL_TOKEN_IDS.values()))), max_size=4),
)
def test_multibyte_text_streams_whole_characters_with_special_tokens_skipped(any_tokenizer, text, specials):
    """Text of multi-byte characters fed one token at a time, special tokens inserted anywhere: no delta holds a
    replacement character (a character is never split), special tokens are skipped, the text comes back whole."""
    ids = any_tokenizer.encode(text)
    for position, special in specials:
        ids.insert(position % (len(ids) + 1), special)
    ts = Detokenizer(any_tokenizer)
    deltas = [ts.add([i]) for i in ids] + [ts.flush()]
    # the tokenizer normalizes to NFC on the way in (e + U+0301 comes back as one é)
    assert "".join(deltas) == unicodedata.normalize("NFC", text) == any_tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)
    kept = "".join(stream_in_batches(any_tokenizer, ids, [], skip_special_tokens=False))
    assert kept == any_tokenizer.decode(ids, skip_special_tokens=False).rstrip("\ufffd")  # a split character's tail
