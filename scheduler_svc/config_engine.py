"""The scheduler's caches, batching and transfer to the ranks: the second part of ``SchedulerConfig``
(config.py)."""

from __future__ import annotations

import dataclasses

from common.settings import setting
from scheduler_svc.config_limits import BATCHING, CACHES, INT_MAX, WIRE

TRANSFER_MODES = ("full", "strip", "lazy")
PAYLOAD_ENCODINGS = ("encoded", "pixels")
ENCODER_PLACEMENTS = ("sharded", "replicated")


@dataclasses.dataclass
class EngineSettings:
    """The prefix cache and the ranks' caches, the step budgets, what travels to the ranks."""

    # --- caches -------------------------------------------------------------------------------------------------
    processor_cache_bytes: int = setting(
        1 << 30,
        "bytes of processed images (and, under --payload-encoding pixels, videos) kept so one seen before is "
        "neither decoded, processed nor hashed again (pixels: the pixels; encoded: the file with its grid and "
        "identifier, so its header is not read again either)",
        min=0,
        max=INT_MAX,
        section=CACHES,
    )
    upload_store_bytes: int = setting(
        256 << 20, "bytes of uploaded encoded images kept for reference by hash", min=0, max=INT_MAX, section=CACHES
    )
    block_size: int = setting(
        16, "tokens per KV block (prefix-cache granularity); must equal the ranks'", min=1, max=1024, section=CACHES
    )
    kv_blocks: int = setting(
        0, "KV blocks to use (0 = the ranks' pool size; never more than it)", min=0, max=2**31 - 1, section=CACHES
    )
    encoder_cache_tokens: int = setting(
        0,
        "encoder-output rows the ranks hold (0 = the ranks' budget; never more)",
        min=0,
        max=INT_MAX,
        section=CACHES,
    )
    max_live_sessions: int = setting(
        64,
        "live sessions open at once (each keeps its KV blocks between turns; GenerateRequest.live); 0 refuses them",
        min=0,
        max=65536,
        section=CACHES,
    )
    live_session_idle_seconds: float = setting(
        300.0,
        "a live session with no turn for this long is closed and its KV freed",
        min=1.0,
        max=86400.0,
        section=CACHES,
    )
    max_live_turns: int = setting(
        64, "turns one live session may keep in its KV (LiveSession.keep_turns)", min=1, max=4096, section=CACHES
    )
    payload_cache_bytes: int = setting(
        0, "payload bytes each rank holds (0 = the ranks' budget; never more)", min=0, max=INT_MAX, section=CACHES
    )

    # --- batching ---------------------------------------------------------------------------------------------
    max_num_batched_tokens: int = setting(
        2048,
        "tokens computed in one step over all requests (chunked prefill): running decodes first, new prompts in "
        "the rest, so a burst of new requests prefills over several steps instead of stalling every decode",
        min=1,
        max=2**31 - 1,
        section=BATCHING,
    )
    max_num_encoder_tokens: int = setting(
        1024,
        "encoder-output rows one step may encode (the vision encoder's work per step); a step's first item is "
        "encoded whatever its size, so no image is ever starved (0 = no limit but the encoder cache)",
        min=0,
        max=INT_MAX,
        section=BATCHING,
    )
    max_decode_stall_ms: float = setting(
        150.0,
        "while requests decode, the prefill and encoder work of requests queued since they began is cut so that "
        "a step should take at most this long, from the costs the ranks measure (a step's first image or block of "
        "tokens always goes in); otherwise the token and encoder budgets alone apply (0 = no time bound)",
        min=0.0,
        max=3_600_000.0,
        section=BATCHING,
    )
    max_num_seqs: int = setting(64, "requests running at once", min=1, max=65536, section=BATCHING)
    async_scheduling: bool = setting(
        True,
        "build a plain decode step while the previous one runs on the ranks, before its tokens are known (each rank "
        "takes the token it sampled last step as the input); other steps wait for the answer as before "
        "(--async-scheduling false: every step waits)",
        section=BATCHING,
    )
    async_grammar: bool = setting(
        True,
        "under --async-scheduling, build a constrained request's decode steps ahead too: its mask follows the step's "
        "control to rank 0 once the previous step's token is known, while the forward runs (only with ranks that "
        "acknowledge late masks); false: a step with a constrained request waits for the previous answer",
        section=BATCHING,
    )
    max_waiting: int = setting(
        256, "requests queued before admission; more get RESOURCE_EXHAUSTED", min=0, max=1_000_000, section=BATCHING
    )

    # --- wire ---------------------------------------------------------------------------------------------------
    transfer_mode: str = setting(
        "lazy",
        "which payloads go to the ranks: full (all at admission), strip (uncovered at admission), "
        "lazy (in the step that encodes them, only to ranks lacking them)",
        choices=TRANSFER_MODES,
        section=WIRE,
    )
    payload_encoding: str = setting(
        "encoded",
        "what an image's payload is on the way to the ranks: encoded (the file as the client sent it; the "
        "rank that encodes it decodes and preprocesses it) or pixels (the frontend's float32 pixel_values)",
        choices=PAYLOAD_ENCODINGS,
        section=WIRE,
    )
    encoder_placement: str = setting(
        "sharded",
        "which ranks run the vision encoder on an item: sharded (one owner per item, its output shared over "
        "the group's collective) or replicated (every rank, each with its own copy of the payload)",
        choices=ENCODER_PLACEMENTS,
        section=WIRE,
    )
    chunk_size_bytes: int = setting(
        1 << 20, "bytes per payload chunk on the step streams", min=1, max=64 << 20, section=WIRE
    )
