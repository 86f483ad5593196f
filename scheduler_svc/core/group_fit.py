"""Whether a request fits the worker group's pools on its own, whatever the load (else it would wait forever):
its tokens in the KV pool, each item's placeholders, payload and tensors in the ranks' caches and limits.
"""

from __future__ import annotations

from common.errors import InvalidArgument, ResourceExhausted
from scheduler_svc.core.request import Request
from scheduler_svc.core.step_plan import payload_nbytes


def check_fits_group(core, request: Request) -> None:
    """Raises ResourceExhausted or InvalidArgument naming the field (``core``: the Scheduler, its group's budgets)."""
    capacity = core.kv_blocks * core.config.block_size
    need = request.num_prompt_tokens + request.sampling.max_tokens
    if need > capacity:
        raise ResourceExhausted(
            f"prompt ({request.num_prompt_tokens} tokens) + sampling.max_tokens ({request.sampling.max_tokens}) "
            f"= {need} tokens exceeds the KV pool of {capacity} tokens ({core.kv_blocks} blocks of "
            f"{core.config.block_size}; --kv-blocks / the workers' pool)",
            field=("messages", "sampling.max_tokens"),  # over the pool whatever the load: no retry hint
        )
    unique: dict[str, int] = {}
    prev_end = 0
    for k, f in enumerate(request.mm_features):
        field = request.image_fields[k] if k < len(request.image_fields) else "messages"
        _check_item(core, request, k, f, prev_end, field)
        prev_end = f.mm_position.end
        unique[f.identifier] = payload_nbytes(f)
    total = sum(unique.values())
    if core.config.transfer_mode == "full" and total > core.payload_cache_bytes:  # strip: transfer.py's doc
        raise ResourceExhausted(
            f"the request's images hold {total} payload bytes, more than a rank's payload cache "
            f"({core.payload_cache_bytes}); --transfer-mode={core.config.transfer_mode} sends them all at "
            "admission: use --transfer-mode lazy or give the workers a larger payload cache",
            field="messages",
        )


def _check_item(core, request: Request, k: int, f, prev_end: int, field: str) -> None:
    """Item ``k``: its placeholder span in order inside the prompt, its payload present, its encoder rows, tensors
    and payload bytes within the ranks' caches and limits."""
    pos, where = f.mm_position, f"image {k} (item {f.identifier[:16]})"
    if pos.length < 1 or pos.offset < prev_end or pos.end > request.num_prompt_tokens:
        raise InvalidArgument(
            f"{where}: placeholder [{pos.offset}, {pos.end}) must be non-empty, after the previous item "
            f"(ends at {prev_end}) and inside the prompt ({request.num_prompt_tokens} tokens)",
            field=field,
        )
    if f.data is None or not f.data.payload_fields():
        raise InvalidArgument(f"{where} has no payload; the scheduler's copy must keep every item's data", field=field)
    if pos.get_num_embeds() > core.encoder_cache_tokens:
        raise ResourceExhausted(
            f"{where} needs {pos.get_num_embeds()} encoder rows; the ranks' encoder cache holds "
            f"{core.encoder_cache_tokens} (--encoder-cache-tokens / the workers' encoder budget)",
            field=field,
        )
    max_tensor = getattr(core.group, "max_tensor_bytes", 0)
    for name, elem in f.data.payload_fields().items():
        size = elem.data.numel() * elem.data.element_size()
        if max_tensor and size > max_tensor:
            raise ResourceExhausted(
                f"{where}: {name} has {size} bytes; the ranks accept tensors up to "
                f"{max_tensor} bytes (the workers' max tensor size)",
                field=field,
            )
    nbytes = payload_nbytes(f)
    if nbytes > core.payload_cache_bytes:
        raise ResourceExhausted(
            f"{where} has {nbytes} payload bytes; a rank's payload cache holds {core.payload_cache_bytes} "
            "(--payload-cache-bytes / the workers' payload budget)",
            field=field,
        )
