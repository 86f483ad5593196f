"""A generation request as the scheduler core holds it: its tokens, its items, its sampling parameters and the
state the step builder keeps for it (computed tokens, blocks, what the ranks have been told, item cursors).

The scheduler's own request always keeps the full features (with payload); wire copies are made per admission.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence

from common import penalties
from common.errors import InvalidArgument
from common.ids import BlockHash, RequestId
from common.multimodal import MultiModalFeatureSpec
from scheduler_svc.core.accounting_events import RequestUsage
from scheduler_svc.core.admission import check_max_tokens_fits


class FinishReason(enum.Enum):
    """Why a request ended (mirrors ``mmcast.v1.FinishReason``)."""

    STOP = "stop"  # end-of-sequence token, stop token, or (service side) stop string
    LENGTH = "length"  # max_tokens reached, or the context is full
    CANCELLED = "cancelled"  # the client or the server aborted it
    ERROR = "error"  # failed (e.g. the worker group did not return in time)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; the ranks hold nothing of it
    RUNNING = "running"  # the ranks hold its state (admitted and not finished/preempted)
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class RequestSampling:
    """A request's sampling settings as the core keeps them: its own (max_tokens, stop tokens, ignore_eos) and
    what it forwards to the ranks (the sampler's part: ``RowSampling`` there); stop strings are the engine's."""

    max_tokens: int = 16  # tokens to generate at most, >= 1
    temperature: float = 0.0  # [0, 2]; below 1e-5 (the ranks' greedy epsilon) = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # [0, vocabulary]; 0 = no top-k cut (the vocabulary bound is checked by request_parsing)
    seed: int = 0  # draws for token i come from a generator seeded by (seed, i)
    stop_token_ids: tuple[int, ...] = ()  # tokens that end generation (besides EOS)
    ignore_eos: bool = False  # True: only max_tokens / the context end generation
    logprobs: int = 0  # top alternatives per token, [0, max_logprobs]
    return_logprobs: bool = False  # return the sampled token's log-probability (and the top alternatives)
    penalties: penalties.Penalties = penalties.NONE  # checked by request_parsing; ending tokens filled at admission


def validate_sampling(
    sampling: RequestSampling,
    num_prompt_tokens: int,
    max_model_len: int,
    *,
    max_tokens_limit: int = 0,
    max_logprobs: int = 20,
) -> None:
    """Raises ``InvalidArgument`` naming the field, value, limit and flag for any out-of-range parameter."""
    if sampling.max_tokens < 1:
        raise InvalidArgument(f"sampling.max_tokens={sampling.max_tokens} must be >= 1", field="sampling.max_tokens")
    if max_tokens_limit and sampling.max_tokens > max_tokens_limit:
        raise InvalidArgument(
            f"sampling.max_tokens={sampling.max_tokens} exceeds the limit {max_tokens_limit} (--max-tokens-limit)",
            field="sampling.max_tokens",
        )
    check_max_tokens_fits(num_prompt_tokens, sampling.max_tokens, max_model_len)
    if not 0.0 <= sampling.temperature <= 2.0:
        raise InvalidArgument(
            f"sampling.temperature={sampling.temperature} must be in [0, 2]", field="sampling.temperature"
        )
    if not 0.0 < sampling.top_p <= 1.0:
        raise InvalidArgument(f"sampling.top_p={sampling.top_p} must be in (0, 1]", field="sampling.top_p")
    # The scheduler does not know the vocabulary (the frontend's parse_sampling and the ranks check that bound); it
    # keeps a top_k inside what the worker proto's uint32 carries, as it does for the seed's uint64.
    if not 0 <= sampling.top_k < 2**32:
        raise InvalidArgument(
            f"sampling.top_k={sampling.top_k} must be in [0, 2^32) (0 = no top-k cut)", field="sampling.top_k"
        )
    if not 0 <= sampling.logprobs <= max_logprobs:
        raise InvalidArgument(
            f"sampling.logprobs={sampling.logprobs} must be in [0, {max_logprobs}] (--max-logprobs)",
            field="sampling.logprobs",
        )
    if sampling.seed < 0 or sampling.seed >= 2**64:
        raise InvalidArgument(f"sampling.seed={sampling.seed} must be in [0, 2^64)", field="sampling.seed")


class Request:
    """One request inside the scheduler. Fields below the first block are the step builder's bookkeeping."""

    def __init__(
        self,
        request_id: RequestId | str,
        prompt_token_ids: Sequence[int],
        mm_features: Sequence[MultiModalFeatureSpec] = (),
        sampling: RequestSampling | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        image_fields: Sequence[str] = (),
    ) -> None:
        """``image_fields``: where each image of ``mm_features`` came from in the client's request (in order), so an
        image that fails at its rank is named as the client sent it."""
        self.request_id = RequestId(request_id)
        self.image_fields = list(image_fields)
        self.prompt_token_ids = list(prompt_token_ids)
        # Sorted by position; the scheduler's copy keeps every payload in every transfer mode.
        self.mm_features: list[MultiModalFeatureSpec] = sorted(mm_features, key=lambda f: f.mm_position.offset)
        self.sampling = sampling or RequestSampling()
        self.cache_salt = cache_salt or None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time

        self.output_token_ids: list[int] = []  # generated so far (confirmed by rank 0)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)  # prompt + outputs
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.usage = RequestUsage()
        self.block_hashes: list[BlockHash] = []  # hashes of the full blocks of all_token_ids, extended lazily
        self.hash_item_cursor = 0  # first item that may overlap the next block to hash
        self.admitted_once = False  # whether usage.cached_tokens has been recorded
        self.live = None  # a live session's turn: its live_sessions.LiveTurn (never hashed, cached or recomputed)
        # Structured output: its structured_output.RequestGrammar, which has consumed output_token_ids (kept across
        # preemption and recovery, so a recomputed request's mask goes on from its generated tokens).
        self.grammar = None
        # The stall bound (step_costs.py), in steps the core has applied: when the request was queued, and when its
        # first token came (a request queued before a decode began is ahead of it and is not cut for it).
        self.queued_at_step = 0
        self.first_token_at_step = 0
        self.reset_progress()

    def reset_progress(self) -> None:
        """State that a preemption or recovery throws away (the request goes back to waiting as new)."""
        self.num_computed_tokens = 0  # tokens whose KV the ranks hold in this request's blocks
        self.num_tokens_told = 0  # tokens of all_token_ids the ranks have been told
        self.num_blocks_told = 0  # blocks of the request's table the ranks have been told
        self.item_cursor = 0  # first item whose span ends after num_computed_tokens
        self.pin_end = 0  # items [item_cursor, pin_end) hold encoder (and full/strip payload) pins

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"items={len(self.mm_features)}, {self.status.value})"
        )
