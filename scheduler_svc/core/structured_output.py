"""Structured output: a request's grammar, compiled once per grammar text, advanced by the scheduler with every token
rank 0 returns; each step's token mask rides in the step's control to rank 0 (docs/ARCHITECTURE.md §2.12).

The matcher lives here, in the scheduler, beside the request's generated tokens, not on a rank: a preempted or
recovered request is recomputed with its generated tokens appended, and its matcher, which already consumed
them, needs nothing replayed. The engine is llguidance (``LLMatcher``): its compile is bounded by its parser limits
and the grammar's text by ``--max-grammar-bytes``; a compiled grammar is kept in a bounded LRU keyed by its kind
and text, and each request gets a copy of the pristine matcher.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from collections.abc import Iterable, Sequence

from common.errors import FailedPrecondition, InvalidArgument, Status
from common.ids import RequestId
from scheduler_svc.core.request import FinishReason

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
# Compact JSON: no whitespace between tokens, so a sampler cannot spend max_tokens on blanks between values.
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """A grammar as a door parsed it: its kind, its canonical text and the request field it came from."""

    kind: str  # one of KINDS
    text: str  # json_schema: the schema as JSON; regex: the pattern; choice: a JSON list of strings; lark: the
    # grammar (llguidance's Lark, with %json); json_object: ""
    field: str  # the client's field path, for errors ("response_format.json_schema.schema")

    @classmethod
    def json_schema(cls, schema: object, field: str) -> GrammarSpec:
        if not isinstance(schema, dict):
            raise InvalidArgument(f"{field} must be a JSON Schema object, got {type(schema).__name__}", field=field)
        # Keys keep the client's order: the grammar writes properties in schema order.
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), field)

    @classmethod
    def choice(cls, choices: Sequence[str], field: str) -> GrammarSpec:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidArgument(f"{field} must be a non-empty list of non-empty strings", field=field)
        return cls("choice", json.dumps(list(choices)), field)


class RequestGrammar:
    """One request's matcher: the mask of the next token, and the tokens it consumed."""

    def __init__(self, matcher, words: int) -> None:
        self._matcher = matcher
        self._nbytes = words * 4  # the wire's mask size: ceil(vocab / 32) words of 32 bits

    def mask(self) -> bytes:
        """The tokens allowed next (TokenMask.allowed): bit i % 8 of byte i // 8 = token i."""
        return self._matcher.compute_bitmask()[: self._nbytes]

    def advance(self, token: int) -> bool:
        """Consumes a sampled token; False when the grammar rejects it (the mask was not applied)."""
        return bool(self._matcher.consume_token(int(token)))

    @property
    def complete(self) -> bool:
        """True when the grammar takes no further token (only end-of-sequence): generation ends here."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GrammarCompiler:
    """Compiles ``GrammarSpec``s against the model's tokenizer (thread-safe: the frontend's threads call it)."""

    def __init__(
        self,
        tokenizer,
        *,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        max_grammar_bytes: int,
        cache_entries: int = 128,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self._eos = sorted(eos_token_ids)
        self._vocab_size = vocab_size
        self._tokenizer = None  # llguidance's view of the vocabulary: built at the first grammar (~1 s at 152k tokens)
        self.words = (vocab_size + 31) // 32
        self.max_grammar_bytes = max_grammar_bytes
        self.cache_entries = cache_entries
        self._cache: collections.OrderedDict[tuple[str, str], object] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses), for tests and metrics

    def compile(self, spec: GrammarSpec) -> RequestGrammar:
        """A fresh matcher for ``spec``. Raises ``InvalidArgument`` naming ``spec.field`` for a grammar too long
        or one the engine refuses (its message names the rule or the parser limit that failed)."""
        size = len(spec.text.encode())
        if size > self.max_grammar_bytes:
            raise InvalidArgument(
                f"{spec.field} is {size} bytes, over the limit of {self.max_grammar_bytes} (--max-grammar-bytes)",
                field=spec.field,
            )
        key = (spec.kind, spec.text)
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
        if pristine is None:
            pristine = self._build(spec)
            with self._lock:
                self._cache[key] = pristine
                while len(self._cache) > self.cache_entries:
                    self._cache.popitem(last=False)
        return RequestGrammar(pristine.deep_copy(), self.words)

    def _engine_tokenizer(self):
        import llguidance.hf

        with self._lock:
            if self._tokenizer is None:
                eos = self._eos or None
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=eos
                    )
                except ValueError as exc:  # a slow (Python) tokenizer: the engine reads only fast ones
                    raise FailedPrecondition(
                        f"structured output is not available for this model's tokenizer: {exc}"
                    ) from None
            return self._tokenizer

    def _build(self, spec: GrammarSpec):
        import llguidance as ll

        if spec.kind == "json_schema":
            grammar = ll.LLMatcher.grammar_from_json_schema(spec.text, defaults=_JSON_OPTIONS)
        elif spec.kind == "json_object":
            grammar = ll.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=_JSON_OPTIONS)
        elif spec.kind == "regex":
            grammar = ll.LLMatcher.grammar_from_regex(spec.text)
        elif spec.kind == "choice":
            grammar = ll.grammar_from("choice", spec.text)
        elif spec.kind == "lark":  # forced tool calls (common/families/tool_calls.py)
            grammar = ll.LLMatcher.grammar_from_lark(spec.text)
        else:
            raise InvalidArgument(
                f"{spec.field}: unknown grammar kind {spec.kind!r} (one of {KINDS})", field=spec.field
            )
        matcher = ll.LLMatcher(self._engine_tokenizer(), grammar, log_level=0)
        self.compiles += 1
        if matcher.is_error():
            raise InvalidArgument(f"{spec.field} could not be compiled: {matcher.get_error()}", field=spec.field)
        return matcher


def grammar_verdict(grammar: RequestGrammar, token: int, update) -> FinishReason | None:
    """Feeds a sampled token to the request's grammar: STOP when the grammar is complete after it, ERROR (with
    ``update.error`` set) when the grammar rejects it, None while it goes on."""
    if not grammar.advance(token):
        update.error_status = Status.INTERNAL
        update.error = f"the sampled token {token} breaks the request's grammar ({grammar.error})"
        return FinishReason.ERROR
    return FinishReason.STOP if grammar.complete else None


def step_masks(requests: Iterable) -> dict[RequestId, bytes]:
    """The token mask of every request with a grammar among ``requests`` (those the step samples)."""
    return {r.request_id: r.grammar.mask() for r in requests if r.grammar is not None}
