"""Incremental detokenization and server-side stop strings for one request."""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """Turns a growing list of token ids into text deltas, and finds stop strings in the text.

    Decodes only a short window of recent tokens per step (the prefix/read offsets of the usual incremental
    scheme), so the cost per token stays constant; holds text back while it ends in an incomplete UTF-8
    sequence, and holds back the tail that could still be the start of a stop string.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # text decoded so far (before the stop-string hold-back)
        self.emitted = 0  # characters of ``text`` already handed out
        self.stopped_by: str | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that can be emitted now ("" while held back)."""
        if self.stopped_by is not None:
            return ""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
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
        """The remaining text at the end of the request."""
        if self.stopped_by is None and self._read_offset < len(self.ids):
            full = self._decode(self.ids[self._prefix_offset :])
            prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
            self.text += full[len(prefix) :]
            self._read_offset = len(self.ids)
        return self._emit(final=True)
