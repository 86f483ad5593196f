"""Per-request state a rank keeps across steps, and its admission from a ``NewRequest``.

The scheduler sends deltas (``RunningRequest``); everything else lives here: the token ids so far, the items'
metadata (grids, placeholder ranges; payloads live in the payload cache), the M-RoPE positions of the whole
prompt computed once, and the block table (the KV itself lives in the rank's block pool).
"""

from __future__ import annotations

import dataclasses

import torch

from common import item_proto, penalties
from common.ids import RequestId
from common.mrope import mrope_positions, mrope_positions_for_window
from common.multimodal import MultiModalFeatureSpec
from mmcast.v1 import multimodal_pb2, worker_pb2
from worker_svc.sampling import RowSampling
from worker_svc.step_errors import StepError, code


@dataclasses.dataclass
class RequestState:
    request_id: RequestId
    token_ids: list[int]  # prompt + every output token this rank has been told of
    num_prompt_tokens: int  # the original prompt; positions past it continue with ``delta``
    features: list[MultiModalFeatureSpec]  # items sorted by offset (metadata and grids; no payload)
    item_msgs: list[multimodal_pb2.MultiModalItem]  # the same items as received (payload headers included)
    positions: torch.Tensor  # (3, num_prompt_tokens) M-RoPE positions, or (1, n) for 1-D RoPE models
    delta: int  # M-RoPE position minus index after the prompt
    block_ids: list[int]  # KV pool blocks of the request in order
    num_computed: int  # tokens whose KV the pool holds at block_ids
    num_output_tokens: int  # output tokens among token_ids: the index of the next draw
    sampling: RowSampling
    blocks_in_pool: int  # leading blocks complete in the pool (recorded in the session's written set)
    embed_positions: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # item index -> positions
    live: bool = False  # a live session's turn (NewRequest.live): its partial last block is read by the next turn
    positions_from: int = 0  # a live turn: tokens before it are retained KV, their positions never computed here
    kv_moves: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # a live turn's (src, dst, count)

    def window_positions(self, start: int, end: int) -> torch.Tensor:
        """Positions of tokens ``[start, end)``: sliced from the prompt's, continued by ``delta`` past it."""
        if start < self.positions_from:
            raise StepError(
                code.STATE_MISMATCH,
                f"request {self.request_id}: window from {start} reaches into the live session's retained tokens "
                f"(positions start at {self.positions_from})",
                self.request_id,
            )
        if self.positions.shape[0] == 1:  # 1-D RoPE: the prompt's positions, then index + delta
            n = self.positions.shape[1]
            if end <= n:
                return self.positions[:, start:end]
            tail = (torch.arange(max(start, n), end) + self.delta).reshape(1, -1)
            return torch.cat([self.positions[:, start:], tail], 1) if start < n else tail
        return mrope_positions_for_window(self.positions, start, end, self.delta)

    def window_offset(self, start: int) -> int | None:
        """The position of token ``start`` when the window from it lies wholly past the prompt, where token ``i`` sits
        at ``i + delta`` on every row (a decode token's case): the runner builds such windows' positions for the
        whole step in one tensor (``ForwardInput.positions``). None for a window that reaches into the prompt."""
        if start < max(self.positions.shape[1], self.positions_from):
            return None
        return start + self.delta

    def overlapping(self, start: int, end: int) -> list[int]:
        """Indices of the items whose placeholder span intersects ``[start, end)`` (features are sorted)."""
        out = []
        for index, feature in enumerate(self.features):
            if feature.mm_position.offset >= end:
                break
            if feature.overlaps(start, end) and feature.mm_position.get_num_embeds() > 0:
                out.append(index)
        return out

    def item_rows(self, index: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(window-local token indices, encoder-row indices) of item ``index`` inside ``[start, end)``."""
        pos = self.features[index].mm_position
        if pos.is_embed is None:
            lo, hi = max(start, pos.offset), min(end, pos.end)
            return torch.arange(lo - start, hi - start), torch.arange(lo - pos.offset, hi - pos.offset)
        embed = self.embed_positions.get(index)
        if embed is None:
            embed = pos.offset + torch.as_tensor(list(pos.is_embed), dtype=torch.bool).nonzero().reshape(-1)
            self.embed_positions[index] = embed
        inside = (embed >= start) & (embed < end)
        return embed[inside] - start, inside.nonzero().reshape(-1)


def sampling_from_proto(msg: worker_pb2.WorkerSampling, request_id: str, *, vocab_size: int) -> RowSampling:
    where = f"new_requests[{request_id}].sampling"
    if not msg.temperature >= 0 or msg.temperature > 1e4:
        raise StepError(code.OUT_OF_RANGE, f"{where}.temperature={msg.temperature} must be in [0, 1e4]", request_id)
    top_p = msg.top_p or 1.0  # an unset top_p means no nucleus cut
    if not 0 < top_p <= 1:
        raise StepError(code.OUT_OF_RANGE, f"{where}.top_p={msg.top_p} must be in (0, 1]", request_id)
    if msg.logprobs > 64:
        raise StepError(code.OUT_OF_RANGE, f"{where}.logprobs={msg.logprobs} exceeds the limit of 64", request_id)
    # The scheduler refuses a top_k above the vocabulary, so one arriving here is a broken or foreign scheduler;
    # the sampler would treat it as no cut, but the rank says so rather than silently sample differently.
    if msg.top_k > vocab_size:
        raise StepError(
            code.OUT_OF_RANGE, f"{where}.top_k={msg.top_k} exceeds the vocabulary of {vocab_size} tokens", request_id
        )
    try:
        adjust = penalties.from_worker(msg, vocab_size=vocab_size)
    except ValueError as exc:
        raise StepError(code.OUT_OF_RANGE, f"{where}: {exc}", request_id) from None
    return RowSampling(
        temperature=float(msg.temperature),
        top_p=float(top_p),
        seed=int(msg.seed),
        logprobs=int(msg.logprobs),
        return_logprobs=bool(msg.return_logprobs),
        top_k=int(msg.top_k),  # 0 (unset) = no cut
        penalties=adjust,
    )


def check_tokens(tokens, vocab_size: int, where: str, request_id: str) -> None:
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        bad = next(t for t in tokens if t < 0 or t >= vocab_size)
        raise StepError(code.OUT_OF_RANGE, f"{where} holds token id {bad}, outside [0, {vocab_size})", request_id)


def check_blocks(blocks, num_blocks: int, where: str, request_id: str) -> None:
    if blocks and max(blocks) >= num_blocks:
        bad = next(b for b in blocks if b >= num_blocks)
        raise StepError(
            code.OUT_OF_RANGE,
            f"{where} holds block id {bad}, outside the pool [0, {num_blocks}) (--kv-blocks)",
            request_id,
        )


def check_prefix_written(state: RequestState, written: set[int], block_size: int) -> None:
    """KV isolation: a new request's computed prefix is read from the pool, so it may name only blocks that requests
    of the same stream wrote (the scheduler's prefix cache registers a block only after the step that computed it).
    A new stream starts with none, so no stream reads KV another stream left in the pool."""
    rid = state.request_id
    indices = range(state.num_computed // block_size)
    if state.live:  # a live turn reads its partial last block and its move sources too
        reads = set(range(-(-state.num_computed // block_size)))
        for src, _, count in state.kv_moves:
            reads.update(range(src // block_size, (src + count - 1) // block_size + 1))
        indices = sorted(reads)
    for index in indices:
        block = state.block_ids[index]
        if block not in written:
            raise StepError(
                code.STATE_MISMATCH,
                f"new_requests[{rid}].block_ids[{index}]={block} lies in the computed prefix "
                f"(num_computed_tokens={state.num_computed}), but no request of this stream wrote block {block}: a "
                "prefix may reuse only KV blocks its own stream computed",
                rid,
            )


def _positions(
    msg, prompt: list[int], num_prompt: int, features: list, start: int, live: bool, rope_kwargs, where: str
):
    """The prompt's positions and the M-RoPE delta after it (1-D RoPE: ``rope_kwargs`` None); a live turn's from
    ``start``, after the session's ``position_offset``."""
    rid = msg.request_id
    offset = msg.live.position_offset if live else 0
    if live and any(f.mm_position.offset < start for f in features):
        raise StepError(code.STATE_MISMATCH, f"{where}: an item lies in the live session's retained tokens", rid)
    shifted = [f.shifted(-start) for f in features]
    if rope_kwargs is None:
        tail, tail_delta = torch.arange(num_prompt - start).reshape(1, -1), 0
    else:
        try:
            tail, tail_delta = mrope_positions(prompt[start:num_prompt], shifted, **rope_kwargs)
        except ValueError as exc:
            raise StepError(code.STATE_MISMATCH, f"{where}: M-RoPE positions: {exc}", rid) from None
    if start or offset:
        # A live turn: its own tokens' positions from the model's rule, after the session's; the retained tokens'
        # columns stay zero (their KV already holds their positions; window_positions refuses to read them).
        positions = torch.zeros((tail.shape[0], num_prompt), dtype=torch.long)
        positions[:, start:] = tail + offset
        delta = tail_delta + offset - start
    else:
        positions, delta = tail, tail_delta
    return positions, delta


def admit(
    msg: worker_pb2.NewRequest,
    *,
    vocab_size: int,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    rope_kwargs: dict | None,
) -> RequestState:
    """Validates a ``NewRequest`` and builds its state (no KV is touched yet). ``rope_kwargs`` None: 1-D RoPE."""
    rid = msg.request_id
    where = f"new_requests[{rid}]"
    if not rid:
        raise StepError(code.STATE_MISMATCH, "new_requests[].request_id is empty")
    prompt = list(msg.prompt_token_ids)
    n = len(prompt)
    if n == 0:
        raise StepError(code.STATE_MISMATCH, f"{where}.prompt_token_ids is empty", rid)
    if max_model_len and n > max_model_len:
        raise StepError(code.OUT_OF_RANGE, f"{where}: {n} prompt tokens exceed max_model_len {max_model_len}", rid)
    check_tokens(prompt, vocab_size, f"{where}.prompt_token_ids", rid)
    check_blocks(msg.block_ids, num_blocks, f"{where}.block_ids", rid)
    computed = msg.num_computed_tokens
    live = msg.HasField("live")
    if live:
        _check_live(msg, n, computed, len(msg.block_ids) * block_size)
    elif computed % block_size or computed >= n:
        raise StepError(
            code.STATE_MISMATCH,
            f"{where}.num_computed_tokens={computed} must be a multiple of block_size {block_size} and below the "
            f"prompt length {n}",
            rid,
        )
    if msg.num_output_tokens >= n:
        raise StepError(
            code.STATE_MISMATCH, f"{where}.num_output_tokens={msg.num_output_tokens} >= prompt length {n}", rid
        )
    features, msgs = [], []
    for item in sorted(msg.mm_items, key=lambda m: m.position.offset):
        try:
            features.append(item_proto.feature_from_proto(item, max_prompt_len=n))
        except (item_proto.WireError, ValueError) as exc:
            raise StepError(code.BAD_TENSOR, f"{where}: {exc}", rid, item.identifier) from None
        msgs.append(item)
    num_prompt = n - msg.num_output_tokens
    for f in features:
        if f.mm_position.end > num_prompt:
            raise StepError(
                code.STATE_MISMATCH,
                f"{where}: item at [{f.mm_position.offset}, {f.mm_position.end}) runs into the {msg.num_output_tokens} "
                f"output tokens (prompt part is {num_prompt})",
                rid,
                f.identifier,
            )
    start = computed if live else 0
    positions, delta = _positions(msg, prompt, num_prompt, features, start, live, rope_kwargs, where)
    return RequestState(
        request_id=RequestId(rid),
        token_ids=prompt,
        num_prompt_tokens=num_prompt,
        features=features,
        item_msgs=msgs,
        positions=positions,
        delta=delta,
        block_ids=list(msg.block_ids),
        num_computed=computed,
        num_output_tokens=msg.num_output_tokens,
        sampling=sampling_from_proto(msg.sampling, rid, vocab_size=vocab_size),
        blocks_in_pool=computed // block_size,
        live=live,
        positions_from=start,
        kv_moves=[(m.src, m.dst, m.count) for m in msg.live.kv_moves] if live else [],
    )


def _check_live(msg: worker_pb2.NewRequest, n: int, computed: int, capacity: int) -> None:
    """A live turn's context: positions start at its first computed token, the offset is a position, and every
    move copies rows of its own table leftwards into the retained part."""
    rid, where = msg.request_id, f"new_requests[{msg.request_id}].live"
    if msg.num_output_tokens:
        raise StepError(code.STATE_MISMATCH, f"{where}: a live turn is never resumed (num_output_tokens > 0)", rid)
    if computed >= n or msg.live.positions_from != computed:
        raise StepError(
            code.STATE_MISMATCH,
            f"{where}.positions_from={msg.live.positions_from} must equal num_computed_tokens={computed}, below the "
            f"prompt length {n}",
            rid,
        )
    if msg.live.position_offset < 0 or msg.live.position_offset >= 2**40:
        raise StepError(code.OUT_OF_RANGE, f"{where}.position_offset={msg.live.position_offset} is not a position", rid)
    for k, m in enumerate(msg.live.kv_moves):
        if not (m.count >= 1 and m.dst < m.src and m.dst + m.count <= computed and m.src + m.count <= capacity):
            raise StepError(
                code.STATE_MISMATCH,
                f"{where}.kv_moves[{k}]=({m.src}, {m.dst}, {m.count}) must copy >= 1 rows leftwards into the "
                f"{computed} retained tokens, from inside the block table ({capacity} rows)",
                rid,
            )
