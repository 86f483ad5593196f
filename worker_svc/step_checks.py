"""Phase 1 of a step (``Session.check``): the rules a step must satisfy before a rank changes anything, one function
each, in the order ``Session.check`` applies them.

Each check reads the rank's state as it will be after the step's evictions, finishes, admissions and deltas and
raises the ``StepError`` naming the broken rule, the field and the value; none changes the state. Every rank sees
the same control bytes, so every rank reaches the same verdict, and a bad step fails on all ranks before any of
them starts collective work (payloads and caches are per rank: the group's vote settles those, see
``worker_svc/process_group.py``).
"""

from __future__ import annotations

import torch

from common import item_proto
from common.ids import ItemId, RequestId
from common.multimodal import FRAME_INDICES_FIELD, Modality, PayloadEncoding
from mmcast.v1 import worker_pb2
from worker_svc.caches import EncoderCache, FrameError, PayloadAssembler, PayloadCache
from worker_svc.request_state import RequestState, admit, check_blocks, check_prefix_written, check_tokens
from worker_svc.step_errors import StepError, code

Payloads = dict[ItemId, dict[str, torch.Tensor]]  # identifier -> field name -> tensor
Window = tuple[RequestState, int, int]  # (request, first token computed this step, end)
EncoderWork = tuple[ItemId, object, "int | None"]  # (identifier, feature, owner rank; None = every rank encodes it)


def check_step_id(control: worker_pb2.StepControl, last_step_id: int) -> None:
    """Step ids only grow on a stream: a repeated or older step is a scheduler that lost track."""
    if control.step_id <= last_step_id:
        raise StepError(
            code.STATE_MISMATCH, f"step_id {control.step_id} is not above the previous step_id {last_step_id}"
        )


def take_assembled(assembler: PayloadAssembler) -> Payloads:
    """The payload frames that arrived before this control form whole tensors (taken out of the assembler)."""
    try:
        return assembler.take()
    except FrameError as exc:
        raise StepError(code.BAD_TENSOR, str(exc)) from None


def check_finished(control: worker_pb2.StepControl, requests: dict[RequestId, RequestState]) -> list[RequestId]:
    """Each finished request is held, and named once."""
    finished: list[RequestId] = []
    for rid in control.finished_request_ids:
        if rid not in requests or rid in finished:
            raise StepError(
                code.UNKNOWN_REQUEST, f"finished_request_ids names {rid!r}, which this rank does not hold", rid
            )
        finished.append(RequestId(rid))
    return finished


def check_new_requests(
    control: worker_pb2.StepControl, held: set[RequestId], runner, written: set[int]
) -> tuple[list[RequestState], dict[ItemId, object]]:
    """Each new request is not held yet, is admissible (``request_state.admit``: tokens, blocks, items, length) and
    reads only prefix blocks this stream wrote. Also returns the step's item messages by identifier (one that
    announces payload fields preferred)."""
    new: list[RequestState] = []
    step_items: dict[ItemId, object] = {}
    for msg in control.new_requests:
        if msg.request_id in held or any(s.request_id == msg.request_id for s in new):
            raise StepError(
                code.STATE_MISMATCH,
                f"new_requests[{msg.request_id}]: this rank already holds the request",
                msg.request_id,
            )
        state = admit(
            msg,
            vocab_size=runner.vocab_size,
            num_blocks=runner.pool.num_blocks,
            block_size=runner.block_size,
            max_model_len=runner.max_model_len,
            rope_kwargs=runner.rope_kwargs if runner.uses_mrope else None,
        )
        check_prefix_written(state, written, runner.block_size)
        new.append(state)
        for item in state.item_msgs:
            if item.identifier not in step_items or item_proto.payload_field_headers(item):
                step_items[ItemId(item.identifier)] = item
    return new, step_items


def check_running(
    control: worker_pb2.StepControl,
    held: set[RequestId],
    new: list[RequestState],
    requests: dict[RequestId, RequestState],
    runner,
) -> list[tuple[RequestState, worker_pb2.RunningRequest]]:
    """Each delta names a held request once (and not a new one), agrees on its computed-token count, and carries
    token ids inside the vocabulary and block ids inside the pool."""
    running: list[tuple[RequestState, worker_pb2.RunningRequest]] = []
    seen: set[str] = {s.request_id for s in new}
    for delta in control.running:
        rid = delta.request_id
        where = f"running[{rid}]"
        if rid not in held or rid in seen:
            raise StepError(code.UNKNOWN_REQUEST, f"{where}: this rank does not hold the request", rid)
        seen.add(rid)
        state = requests[RequestId(rid)]
        if delta.num_computed_tokens != state.num_computed:
            raise StepError(
                code.STATE_MISMATCH,
                f"{where}.num_computed_tokens={delta.num_computed_tokens}, this rank computed {state.num_computed}",
                rid,
            )
        check_tokens(delta.new_token_ids, runner.vocab_size, f"{where}.new_token_ids", rid)
        check_blocks(delta.new_block_ids, runner.pool.num_blocks, f"{where}.new_block_ids", rid)
        running.append((state, delta))
    return running


def check_windows(
    control: worker_pb2.StepControl,
    new: list[RequestState],
    running: list[tuple[RequestState, worker_pb2.RunningRequest]],
    runner,
) -> list[Window]:
    """The window ``[computed, computed + scheduled)`` of every request computed this step, in control order (new
    requests first), each within what the request will hold after the step (``check_window``)."""
    after = [
        (s, m.num_scheduled_tokens, len(s.token_ids), len(s.block_ids))
        for s, m in zip(new, control.new_requests, strict=True)
    ] + [
        (
            s,
            d.num_scheduled_tokens,
            len(s.token_ids) + len(d.new_token_ids) + d.input_is_last_sampled,  # + the token sampled last step
            len(s.block_ids) + len(d.new_block_ids),
        )
        for s, d in running
    ]
    windows: list[Window] = []
    for state, count, num_tokens, num_blocks in after:
        if count == 0:
            continue  # held but not computed this step
        windows.append(check_window(state, count, num_tokens, num_blocks, runner))
    return windows


def check_window(state: RequestState, count: int, num_tokens: int, num_blocks: int, runner) -> Window:
    """A window ends within the request's tokens, the model's context length and the blocks of its table."""
    start, end = state.num_computed, state.num_computed + count
    rid = state.request_id
    if end > num_tokens:
        raise StepError(
            code.STATE_MISMATCH,
            f"request {rid}: num_scheduled_tokens={count} from {start} reaches token {end}, the rank knows "
            f"{num_tokens} tokens",
            rid,
        )
    if runner.max_model_len and end > runner.max_model_len:
        raise StepError(code.OUT_OF_RANGE, f"request {rid}: {end} tokens exceed max_model_len", rid)
    needed = -(-end // runner.block_size)  # every token computed this step is written at its slot in the pool
    if needed > num_blocks:
        raise StepError(
            code.STATE_MISMATCH,
            f"request {rid}: {end} computed tokens need {needed} blocks of {runner.block_size}, the block table "
            f"holds {num_blocks}",
            rid,
        )
    return state, start, end


def check_encoder_inputs(
    control: worker_pb2.StepControl,
    incoming: Payloads,
    step_items: dict[ItemId, object],
    *,
    items: dict[ItemId, list],
    payloads: PayloadCache,
    encoded: EncoderCache,
    rank: int,
    world_size: int,
    images_allowed: bool,
    videos=None,
    runner,
) -> tuple[list[EncoderWork], set[ItemId], int, int]:
    """Each item to encode that the rank does not hold encoded already belongs to a request of the step or one the
    rank holds (``items``: identifier -> [message, holders]) and has an owner inside the group; the rank that
    encodes it holds a usable payload (``check_local_encoder_input``; ``videos``: the handshake's
    ``common.video_input.VideoInput``, None when it allowed no encoded video); the encoder cache stays within its
    budget.
    Returns the encoder work, the encoder cache's identifiers after the step, how many payloads the payload cache
    supplied, and how many it was asked for (one per item this rank encodes)."""
    encoded_after, encoder_tokens = encoder_cache_after(control, encoded)
    gone_payloads = set(control.evict_payload_ids)
    work: list[EncoderWork] = []
    payload_hits = payload_queries = 0
    for enc in control.encoder_inputs:
        ident = ItemId(enc.item_identifier)
        if ident in encoded_after:
            continue  # already encoded on this rank; the scheduler's mirror may lag one step
        msg = check_item_known(ident, step_items, items)
        owner = check_owner(enc, ident, world_size)
        if owner is not None and owner != rank:  # another rank encodes it; its output comes over the group
            feature = decode_item(msg, ident)
        else:
            kept = {} if control.reset_caches or ident in gone_payloads else (payloads.get(ident) or {})
            fields = dict(kept, **incoming.get(ident, {}))
            payload_queries += 1
            payload_hits += ident not in incoming and bool(fields)
            feature = check_local_encoder_input(
                msg,
                ident,
                fields,
                images_allowed=images_allowed,
                videos=videos,
                payloads_held=len(payloads),
                runner=runner,
            )
        work.append((ident, feature, owner))
        encoded_after.add(ident)
        encoder_tokens += feature.mm_position.get_num_embeds()
    check_encoder_budget(encoder_tokens, encoded.budget_tokens)
    return work, encoded_after, payload_hits, payload_queries


def encoder_cache_after(control: worker_pb2.StepControl, encoded: EncoderCache) -> tuple[set[ItemId], int]:
    """The encoder cache's identifiers and rows once the step's reset and evictions apply."""
    if control.reset_caches:
        return set(), 0
    gone = set(control.evict_encoder_ids)
    entries = encoded.entries
    return set(entries) - gone, encoded.tokens - sum(entries[i].shape[0] for i in gone if i in entries)


def check_item_known(ident: ItemId, step_items: dict[ItemId, object], items: dict[ItemId, list]):
    """An item to encode is one of a new request of this step or of a request the rank holds."""
    msg = step_items.get(ident) or (items.get(ident) or [None])[0]
    if msg is None:
        raise StepError(
            code.STATE_MISMATCH,
            f"encoder_inputs names item {ident[:16]}, which no request held by this rank contains",
            item_identifier=ident,
        )
    return msg


def check_owner(enc: worker_pb2.EncoderInput, ident: ItemId, world_size: int) -> int | None:
    """A sharded item's owner is a rank of the group (None: replicated, every rank encodes it)."""
    owner = None if enc.replicated else enc.owner_rank
    if owner is not None and owner >= world_size:
        raise StepError(
            code.OUT_OF_RANGE,
            f"encoder_inputs[{ident[:16]}].owner_rank={owner}; the group has {world_size} ranks",
            item_identifier=ident,
        )
    return owner


def decode_item(msg, ident: ItemId, payload: dict[str, torch.Tensor] | None = None):
    """The item's metadata (and payload, where given) decode and agree with each other."""
    try:
        return item_proto.feature_from_proto(msg, payload=payload)
    except (item_proto.WireError, ValueError) as exc:
        raise StepError(code.BAD_TENSOR, f"encoder_inputs[{ident[:16]}]: {exc}", item_identifier=ident) from None


def check_local_encoder_input(
    msg,
    ident: ItemId,
    fields: dict[str, torch.Tensor],
    *,
    images_allowed: bool,
    payloads_held: int,
    runner,
    videos=None,
):
    """An item this rank encodes decodes with its payload, is in an encoding the handshake allowed, has every field
    the encoder reads, and passes the runner's own input checks; an encoded video's sampled frames and grid agree
    with each other, its placeholder range and the handshake's --max-video-frames (``VideoInput.item_problem``:
    what needs its file is the owner's to check when it decodes, an item failure)."""
    feature = decode_item(msg, ident, fields)
    video = feature.modality is Modality.VIDEO
    if feature.encoding is PayloadEncoding.ENCODED:
        if not (videos is not None if video else images_allowed):
            what = (
                "video, but the handshake set no video limits"
                if video
                else "image, but the handshake allowed no image format"
            )
            raise StepError(
                code.BAD_TENSOR, f"encoder_inputs[{ident[:16]}] is an encoded {what}", item_identifier=ident
            )
    missing = [n for n in runner.encoder_fields(feature) if feature.data is None or n not in feature.data]
    if missing:
        raise StepError(
            code.MISSING_PAYLOAD,
            f"encoder_inputs[{ident[:16]}] needs field(s) {', '.join(missing)}, which this rank does not hold "
            f"(payload cache has {payloads_held} items; none arrived for this item this step)",
            item_identifier=ident,
        )
    problem = runner.encoder_input_problem(feature)
    if problem is None and video and feature.encoding is PayloadEncoding.ENCODED:
        problem = videos.item_problem(
            feature.data[FRAME_INDICES_FIELD].data.tolist(),
            feature.data["video_grid_thw"].data,
            feature.mm_position.get_num_embeds(),
        )
    if problem is not None:
        raise StepError(code.BAD_TENSOR, f"encoder_inputs[{ident[:16]}]: {problem}", item_identifier=ident)
    return feature


def check_encoder_budget(encoder_tokens: int, budget_tokens: int) -> None:
    """The encoder cache's rows after the step fit ``--encoder-cache-tokens``."""
    if encoder_tokens > budget_tokens:
        raise StepError(
            code.OUT_OF_RANGE,
            f"encoder cache would hold {encoder_tokens} rows after this step, over the budget of {budget_tokens} "
            "(--encoder-cache-tokens)",
        )


def check_encoder_outputs_for_windows(
    windows: list[Window], work: list[EncoderWork], encoded_after: set[ItemId]
) -> tuple[int, int]:
    """Every item a window's tokens overlap is encoded after the step: held already or encoded now. Returns how
    many of those (window, item) uses the encoder cache supplied, and how many there were."""
    scheduled = {ident for ident, _, _ in work}
    encoder_hits = encoder_queries = 0
    for state, start, end in windows:
        for index in state.overlapping(start, end):
            ident = state.features[index].identifier
            if ident not in encoded_after:
                raise StepError(
                    code.MISSING_PAYLOAD,
                    f"request {state.request_id}: tokens [{start}, {end}) need the encoder output of item "
                    f"{ident[:16]} (placeholders [{state.features[index].mm_position.offset}, "
                    f"{state.features[index].mm_position.end})), which this rank neither holds nor is told to "
                    "compute in encoder_inputs",
                    state.request_id,
                    ident,
                )
            encoder_queries += 1
            encoder_hits += ident not in scheduled
    return encoder_hits, encoder_queries


def check_payload_budget(control: worker_pb2.StepControl, incoming: Payloads, payloads: PayloadCache) -> None:
    """The payload cache's bytes after the step's reset, evictions and arrivals fit ``--payload-cache-bytes``."""
    payload_bytes = payloads.bytes_after(set(control.evict_payload_ids), incoming, control.reset_caches)
    if payload_bytes > payloads.budget_bytes:
        raise StepError(
            code.OUT_OF_RANGE,
            f"payload cache would hold {payload_bytes} bytes after this step, over the budget of "
            f"{payloads.budget_bytes} (--payload-cache-bytes)",
        )
