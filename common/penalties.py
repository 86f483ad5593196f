"""Penalties and biases on a request's logits: one type from the door to the sampler, and its one range check.

``Penalties`` travels inside the sampling parameters of every form (request_parsing.SamplingSpec, the scheduler's
request.RequestSampling, the rank's sampling.RowSampling) and over both protos; ``parse`` is the only place its
ranges are checked (both doors call it through request_parsing.parse_sampling), and the rank's ``from_worker``
only refuses what a correct scheduler never sends. worker_svc/penalize.py applies it to a step's logits.

The definitions are vLLM's (and OpenAI's for presence/frequency): for a token seen ``c`` times in the output so far,
``logit -= frequency_penalty * c + presence_penalty * (c > 0)``; for a token seen in the prompt or the output,
``logit / repetition_penalty`` when the logit is positive, ``logit * repetition_penalty`` otherwise;
``logit_bias[token]`` is added to the logit; ``min_tokens`` masks the ending tokens to -inf until that many output
tokens are out; ``bad_words`` (vLLM's rule) masks the last token of a word's token sequence whenever the output so far
ends with the sequence's other tokens (a one-token word is always masked); each word counts as tokenized alone and,
where that makes another sequence of the same length, with a leading space.
"""

from __future__ import annotations

import dataclasses
import math

from common.errors import InvalidArgument

PENALTY_LIMIT = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_REPETITION_PENALTY = 1000.0  # dividing by more flattens every seen logit to ~0: nothing left to gain
BIAS_LIMIT = 100.0  # logit_bias values lie in [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request
MAX_BAD_WORDS = 64  # bad_words per request
MAX_BAD_WORD_CHARS = 256


@dataclasses.dataclass(frozen=True)
class Penalties:
    """What a request asks to change in its logits before sampling; the defaults change nothing."""

    presence_penalty: float = 0.0  # [-2, 2]; once per distinct output token
    frequency_penalty: float = 0.0  # [-2, 2]; once per occurrence in the output
    repetition_penalty: float = 1.0  # (0, 1000]; 1 = none; over prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), ids distinct and < vocab
    min_tokens: int = 0  # output tokens before an ending token may be drawn
    masked_until_min: tuple[int, ...] = ()  # the ending tokens (EOS unless ignore_eos, stop ids); the scheduler's
    bad_words: tuple[str, ...] = ()  # as the client sent them (1-256 characters, at most 64)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()  # their token sequences (``with_bad_word_ids``); what ranks use

    @property
    def active(self) -> bool:
        return self.counts_output or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.bad_word_ids)

    @property
    def counts_output(self) -> bool:
        """Whether the output tokens so far change the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def with_ending_tokens(self, ids) -> Penalties:
        """These penalties with the tokens min_tokens masks (none are needed without a minimum)."""
        return dataclasses.replace(self, masked_until_min=tuple(sorted(set(ids))) if self.min_tokens else ())

    def with_bad_word_ids(self, encode) -> Penalties:
        """These penalties with ``bad_words`` tokenized by ``encode`` (text -> ids, no special tokens)."""
        return dataclasses.replace(self, bad_word_ids=bad_word_sequences(self.bad_words, encode))


NONE = Penalties()


def bad_word_sequences(words, encode) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad words: each word stripped of leading spaces, alone, and with one leading space
    when that gives as many tokens but another first token (the word in the middle of a text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(encode(word.lstrip()))
        spaced = tuple(encode(" " + word.lstrip()))
        if alone:
            out.append(alone)
        if spaced and (not alone or (len(spaced) == len(alone) and spaced[0] != alone[0])):
            out.append(spaced)
    return tuple(out)


def _in(value: float, lo: float, hi: float, *, open_lo: bool = False) -> bool:
    return math.isfinite(value) and (lo < value if open_lo else lo <= value) and value <= hi


def parse(p, *, vocab_size: int, max_tokens: int | None, where: str = "sampling") -> Penalties:
    """The penalties of a ``generation_pb2.SamplingParams``, every range checked; errors name ``where.<field>``.
    ``max_tokens`` None: not known yet (the context decides it later); min_tokens is then checked only there."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not _in(value, -PENALTY_LIMIT, PENALTY_LIMIT):
            raise InvalidArgument(f"{where}.{name}={value} must be in [-2, 2]", field=f"{where}.{name}")
    repetition = p.repetition_penalty if p.HasField("repetition_penalty") else 1.0
    if not _in(repetition, 0.0, MAX_REPETITION_PENALTY, open_lo=True):
        raise InvalidArgument(
            f"{where}.repetition_penalty={repetition} must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = no penalty)",
            field=f"{where}.repetition_penalty",
        )
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument(
            f"{where}.logit_bias has {len(p.logit_bias)} entries; the limit is {MAX_LOGIT_BIAS}",
            field=f"{where}.logit_bias",
        )
    bias = []
    for token, value in sorted(p.logit_bias.items()):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(
                f"{where}.logit_bias[{token}]: token id {token} is outside the vocabulary [0, {vocab_size})",
                field=f"{where}.logit_bias[{token}]",
            )
        if not _in(value, -BIAS_LIMIT, BIAS_LIMIT):
            raise InvalidArgument(
                f"{where}.logit_bias[{token}]={value} must be in [-100, 100]", field=f"{where}.logit_bias[{token}]"
            )
        if value != 0.0:
            bias.append((int(token), float(value)))
    check_min_tokens(p.min_tokens, max_tokens, where)
    _check_bad_words(p.bad_words, where)
    return Penalties(
        presence_penalty=float(p.presence_penalty),
        frequency_penalty=float(p.frequency_penalty),
        repetition_penalty=float(repetition),
        logit_bias=tuple(bias),
        min_tokens=int(p.min_tokens),
        bad_words=tuple(p.bad_words),
    )


def _check_bad_words(words, where: str) -> None:
    if len(words) > MAX_BAD_WORDS:
        raise InvalidArgument(
            f"{where}.bad_words has {len(words)} words; the limit is {MAX_BAD_WORDS}", field=f"{where}.bad_words"
        )
    for i, word in enumerate(words):
        if not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            raise InvalidArgument(
                f"{where}.bad_words[{i}] has {len(word)} characters ({len(word.strip())} besides spaces); each word "
                f"needs 1 to {MAX_BAD_WORD_CHARS}",
                field=f"{where}.bad_words[{i}]",
            )


def check_min_tokens(min_tokens: int, max_tokens: int | None, where: str = "sampling") -> None:
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidArgument(
            f"{where}.min_tokens={min_tokens} exceeds {where}.max_tokens={max_tokens}: min_tokens must be <= max_tokens",
            field=(f"{where}.min_tokens", f"{where}.max_tokens"),  # either may be the one to change
        )


def to_worker(penalties: Penalties, msg) -> None:
    """Writes ``penalties`` into a ``worker_pb2.WorkerSampling``."""
    msg.presence_penalty = penalties.presence_penalty
    msg.frequency_penalty = penalties.frequency_penalty
    msg.repetition_penalty = penalties.repetition_penalty
    msg.logit_bias_token_ids.extend(t for t, _ in penalties.logit_bias)
    msg.logit_bias_values.extend(v for _, v in penalties.logit_bias)
    msg.min_tokens = penalties.min_tokens
    msg.min_tokens_masked_ids.extend(penalties.masked_until_min)
    for ids in penalties.bad_word_ids:
        msg.bad_words.add().token_ids.extend(ids)


def from_worker(msg, *, vocab_size: int) -> Penalties:
    """The penalties of a ``worker_pb2.WorkerSampling``; raises ``ValueError`` naming the field for what a correct
    scheduler never sends (it checked every range with ``parse``)."""
    repetition = msg.repetition_penalty or 1.0  # unset: none
    checks = (
        ("presence_penalty", _in(msg.presence_penalty, -PENALTY_LIMIT, PENALTY_LIMIT)),
        ("frequency_penalty", _in(msg.frequency_penalty, -PENALTY_LIMIT, PENALTY_LIMIT)),
        ("repetition_penalty", _in(repetition, 0.0, MAX_REPETITION_PENALTY, open_lo=True)),
        ("logit_bias_values", len(msg.logit_bias_values) == len(msg.logit_bias_token_ids) <= MAX_LOGIT_BIAS),
        ("logit_bias_values", all(_in(v, -BIAS_LIMIT, BIAS_LIMIT) for v in msg.logit_bias_values)),
        ("logit_bias_token_ids", all(0 <= t < vocab_size for t in msg.logit_bias_token_ids)),
        ("logit_bias_token_ids", len(set(msg.logit_bias_token_ids)) == len(msg.logit_bias_token_ids)),
        ("min_tokens_masked_ids", all(0 <= t < vocab_size for t in msg.min_tokens_masked_ids)),
        ("bad_words", len(msg.bad_words) <= 2 * MAX_BAD_WORDS),  # two sequences per word at most
        ("bad_words", all(w.token_ids and all(0 <= t < vocab_size for t in w.token_ids) for w in msg.bad_words)),
    )
    for name, ok in checks:
        if not ok:
            raise ValueError(f"{name} is out of range (vocabulary {vocab_size})")
    return Penalties(
        presence_penalty=float(msg.presence_penalty),
        frequency_penalty=float(msg.frequency_penalty),
        repetition_penalty=float(repetition),
        logit_bias=tuple(zip(msg.logit_bias_token_ids, msg.logit_bias_values, strict=True)),
        min_tokens=int(msg.min_tokens),
        masked_until_min=tuple(msg.min_tokens_masked_ids),
        bad_word_ids=tuple(tuple(w.token_ids) for w in msg.bad_words),
    )
