"""Incremental detokenization and server-side stop strings for one request.

Text comes from ``tokenizers.decoders.DecodeStream`` (the incremental decoder of the Rust tokenizer, as vLLM's
detokenizer uses it): each step decodes only the tokens since the last emitted text plus the chunk before them, so
the cost per token stays constant, and it yields nothing while the text ends in an incomplete UTF-8 sequence (a
CJK character or an emoji split over byte tokens).

A tokenizer without a Rust backend (a "slow" Python tokenizer), or one whose ``decode`` also cleans up
tokenization spaces (text ``DecodeStream`` does not produce), is decoded by the same windowed scheme with the
tokenizer's own ``decode`` (the prefix/read offsets of the usual incremental scheme). Either way the deltas of a
request concatenate to ``tokenizer.decode(all ids, skip_special_tokens=...)`` less the replacement characters an
incomplete UTF-8 sequence at its very end decodes to (tests/service/test_detok.py checks it on random token
sequences): a request cut by ``max_tokens`` mid-character ends before that character, never in "\ufffd" (vLLM
drops the incomplete bytes the same way).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def rust_tokenizer(tokenizer) -> Tokenizer | None:
    """The ``tokenizers.Tokenizer`` whose decode is ``tokenizer.decode`` exactly; None when there is none."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class Detokenizer:
    """Turns a growing list of token ids into text deltas, and finds stop strings in the text.

    Holds text back while it ends in an incomplete UTF-8 sequence, and holds back the tail that could still be the
    start of a stop string.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        # Tokens whose text is out: ids[:_read_offset]; ids[_prefix_offset:_read_offset] are the last chunk's, the
        # context the next tokens are decoded with (kept in both modes: ``flush`` decodes what remains with it).
        self._prefix_offset = 0
        self._read_offset = 0
        self._rust = rust_tokenizer(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._rust is not None else None
        self.text = ""  # text decoded so far (before the stop-string hold-back)
        self.emitted = 0  # characters of ``text`` already handed out
        self.stopped_by: str | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that can be emitted now ("" while held back)."""
        if self.stopped_by is not None:
            return ""
        token_ids = list(token_ids)
        if not token_ids:
            return self._emit(final=False)
        self.ids.extend(token_ids)
        chunk = None
        if self._stream is not None:
            try:
                chunk = self._stream.step(self._rust, token_ids)
            except Exception:  # noqa: BLE001 - a decoder whose window text does not extend its prefix: go on windowed
                self._stream = None
        if self._stream is None:
            prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
            full = self._decode(self.ids[self._prefix_offset :])
            chunk = full[len(prefix) :] if len(full) > len(prefix) and not full.endswith("\ufffd") else None
        if chunk is not None:
            self.text += chunk
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
        return self._emit(final=False)

    def _emit(self, final: bool) -> str:
        if self.stop:
            search_from = max(0, self.emitted - max(map(len, self.stop)) + 1)
            hits = [(self.text.find(s, search_from), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, stop = min(hits)
                self.stopped_by = stop
                self.text = self.text[:index]
                final = True
        limit = len(self.text)
        if not final and self.stop:
            # keep back a tail that may be the beginning of a stop string
            hold = 0
            for s in self.stop:
                for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            limit -= hold
        limit = max(limit, self.emitted)
        out = self.text[self.emitted : limit]
        self.emitted = limit
        return out

    def flush(self) -> str:
        """The remaining text at the end of the request, without an incomplete UTF-8 tail: the held-back tokens' text
        less the replacement characters it ends in (the bytes of a character the request was cut inside)."""
        if self.stopped_by is None and self._read_offset < len(self.ids):
            full = self._decode(self.ids[self._prefix_offset :])
            prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
            self.text += full[len(prefix) :].rstrip("\ufffd")
            self._read_offset = len(self.ids)
        return self._emit(final=True)
