"""Incremental detokenization and server-side stop strings."""

import pytest
from transformers import AutoTokenizer

from scheduler_svc.detok import TextStream


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def stream_all(tok, ids, stop=(), step=1):
    ts = TextStream(tok, stop)
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
    ts = TextStream(tokenizer)
    pieces = [ts.add([i]) for i in ids] + [ts.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_truncates_and_is_not_emitted(tokenizer):
    text = "the sky is blue. STOP here and more text"
    ids = tokenizer.encode(text)
    ts, streamed = stream_all(tokenizer, ids, stop=["STOP"])
    assert ts.stopped_by == "STOP"
    assert streamed == "the sky is blue. "


def test_partial_stop_prefix_is_held_back_then_released(tokenizer):
    ids = tokenizer.encode("a red ST and a blue square")
    ts, streamed = stream_all(tokenizer, ids, stop=["STOP"])
    assert ts.stopped_by is None
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True)
