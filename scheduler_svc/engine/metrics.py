"""Scheduler metrics (docs/ARCHITECTURE.md §2.7), one table (common/metric_table.py). Counters count the underlying
unit; PromQL makes the ratios."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from common.metric_table import COUNTER, GAUGE, HISTOGRAM, Metric, MetricSet
from scheduler_svc.engine.stage_timing import STAGES

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_IMAGE_CPU_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 20.0)
# A whole request: from a few steps to minutes of generation.
_REQUEST_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
# Between two tokens of one request: about one step, longer when the step carries prefills or encoder work.
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# One stage of a request before its first token: from a header parse (~100 µs) to a long queue or prefill (10 s).
_STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Tokens per request, prompt or generated: powers of two up to long contexts.
_TOKEN_BUCKETS = tuple(float(2**k) for k in range(0, 18))

# The stages are defined in scheduler_svc/engine/stage_timing.py; this help text is docs/METRICS.md's row.
_STAGE_HELP = (
    "Time one request spent in each stage up to its first token (its TTFT breakdown), one sample per stage "
    "per request that got a first token. In order, disjoint: http_parse (HTTP body read and parse, image "
    "URLs; gRPC message translation), frontend (chat template, image headers, hashing, tokenization), queue "
    "(queued to first scheduled), then of the step that produced the first token: schedule (the core's "
    "schedule()), step_send (control built, serialized, written to every rank stream), rank (the slowest "
    "rank's step time), result_back (the round trip less rank); detokenize (the first token's text), "
    "first_byte (the token delivered to handed to the transport, streamed answers only). Parts of that step on the "
    "ranks, each the slowest rank's: rank_encode, rank_forward, rank_sample (within rank), rank_assemble "
    "(payload frames assembled, overlapping step_send)."
)

# The scheduler's metrics: attribute, kind, name, help, labels, buckets, series created at 0 from the start.
SCHEDULER_METRICS = (
    # --- the step streams to the ranks
    Metric(
        "broadcast_bytes", COUNTER, "mmcast_broadcast_bytes_total",
        "Bytes written to the worker rank streams, summed over ranks.",
        ("kind",), series=("payload", "metadata", "control"),
    ),
    Metric(
        "payload_bytes_saved", COUNTER, "mmcast_broadcast_payload_bytes_saved_total",
        "Payload bytes the full transfer mode would have written for items that were not sent, summed over ranks "
        "(modality: image or video).",
        ("reason", "modality"),
        # video series start with their first
        series=(("prefix_covered", "image"), ("rank_cached", "image"), ("encoder_shared", "image")),
    ),
    Metric(
        "mm_items", COUNTER, "mmcast_mm_items_total",
        "Multimodal item deliveries per rank by disposition (a deferred item counts when sent or dropped) and "
        "modality (image or video).",
        ("disposition", "modality"),
        series=(("sent", "image"), ("stripped", "image"), ("rank_cached", "image"), ("encoder_shared", "image")),
    ),
    Metric(
        "prefix_query_tokens", COUNTER, "mmcast_prefix_cache_query_tokens_total",
        "Prompt tokens looked up in the prefix cache.",
    ),
    Metric(
        "prefix_hit_tokens", COUNTER, "mmcast_prefix_cache_hit_tokens_total",
        "Prompt tokens found in the prefix cache.",
    ),
    # --- request latency and size
    Metric(
        "ttft", HISTOGRAM, "mmcast_time_to_first_token_seconds",
        "Request received to first token sent, on the server.",
        buckets=_TTFT_BUCKETS,
    ),
    Metric(
        "e2e_seconds", HISTOGRAM, "mmcast_e2e_request_latency_seconds",
        "Request received to finished (any finish reason), on the server.",
        buckets=_REQUEST_BUCKETS,
    ),
    Metric(
        "queue_seconds", HISTOGRAM, "mmcast_request_queue_time_seconds",
        "Request received to the first step that schedules it (frontend work included), once per request.",
        buckets=_QUEUE_BUCKETS,
    ),
    Metric(
        "request_stage_seconds", HISTOGRAM, "mmcast_request_stage_seconds", _STAGE_HELP,
        ("stage",), buckets=_STAGE_BUCKETS, series=STAGES,
    ),
    Metric(
        "inter_token_seconds", HISTOGRAM, "mmcast_inter_token_latency_seconds",
        "Time between two consecutive tokens of one request, on the server (one sample per token after the first).",
        buckets=_ITL_BUCKETS,
    ),
    Metric(
        "request_prompt_tokens", HISTOGRAM, "mmcast_request_prompt_tokens",
        "Prompt tokens per admitted request (image placeholders included).",
        buckets=_TOKEN_BUCKETS,
    ),
    Metric(
        "request_generation_tokens", HISTOGRAM, "mmcast_request_generation_tokens",
        "Tokens generated per finished request.",
        buckets=_TOKEN_BUCKETS,
    ),
    # --- steps
    Metric(
        "step_seconds", HISTOGRAM, "mmcast_step_seconds",
        "Wall time of one step: schedule, broadcast, all ranks' answers.",
        buckets=_STEP_BUCKETS,
    ),
    Metric(
        "schedule_seconds", HISTOGRAM, "mmcast_schedule_seconds",
        "Time the scheduler core spends building one step.",
        buckets=_STEP_BUCKETS,
    ),
    Metric(
        "steps_ahead", COUNTER, "mmcast_steps_planned_ahead_total",
        "Steps planned while the previous step ran on the ranks, before its tokens were known (--async-scheduling).",
    ),
    Metric(
        "steps_stall_bounded", COUNTER, "mmcast_steps_stall_bounded_total",
        "Steps whose prefill or encoder work was cut so that the requests decoding in them wait at most about "
        "--max-decode-stall-ms for their token.",
    ),
    Metric(
        "step_cost", GAUGE, "mmcast_step_cost_seconds",
        "The stall bound's measured costs on the ranks, by part: decode_step (a step of decodes alone), "
        "prefill_token (per prefill token), encoder_row (per encoder-output row, image decoding included).",
        ("part",), series=("decode_step", "prefill_token", "encoder_row"),
    ),
    # --- queue and KV pool
    Metric("requests_running", GAUGE, "mmcast_requests_running", "Requests holding KV blocks."),
    Metric("requests_waiting", GAUGE, "mmcast_requests_waiting", "Requests queued for admission."),
    Metric("kv_blocks_used", GAUGE, "mmcast_kv_blocks_used", "KV blocks referenced by running requests."),
    Metric(
        "kv_blocks_total", GAUGE, "mmcast_kv_blocks_capacity",
        "KV blocks in the group's pool (the prefix-cache size).",
    ),
    Metric(
        "kv_events", COUNTER, "mmcast_kv_events_total",
        "Prefix-cache events published (--kv-events-endpoint), by vLLM event type.",
        ("type",), series=("BlockStored", "BlockRemoved", "AllBlocksCleared"),  # vLLM's event types (kv_events.py)
    ),
    Metric(
        "kv_events_dropped", COUNTER, "mmcast_kv_events_dropped_total",
        "Prefix-cache events dropped because the publisher's queue was full (--kv-events-queue).",
    ),
    Metric(
        "kv_event_bytes", COUNTER, "mmcast_kv_event_bytes_total",
        "msgpack payload bytes of the published prefix-cache event batches.",
    ),
    # What the Gateway API Inference Extension's endpoint picker reads beside the queue, running and KV gauges
    # (its model-server protocol; vLLM's vllm:cache_config_info and vllm:lora_requests_info): 1-valued infos.
    Metric(
        "cache_config_info", GAUGE, "mmcast_cache_config_info",
        "The KV pool's geometry, in the labels (value 1): "
        "block_size in tokens, num_gpu_blocks the blocks of the pool.",
        ("block_size", "num_gpu_blocks"),
    ),
    Metric(
        "lora_info", GAUGE, "mmcast_lora_requests_info",
        "LoRA adapters, in the labels (value 1): mmcast serves none (max_lora 0, no running or waiting adapters).",
        ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
    ),
    Metric(
        "kv_usage", GAUGE, "mmcast_kv_cache_usage_ratio",
        "KV blocks used / KV blocks in the pool, 0 to 1 (mmcast_kv_blocks_used / mmcast_kv_blocks_capacity).",
    ),
    # --- the frontend's stores
    Metric(
        "upload_store_bytes", GAUGE, "mmcast_upload_store_bytes",
        "Encoded image bytes held for reference by hash (all tenants).",
    ),
    Metric(
        "processor_cache_bytes", GAUGE, "mmcast_processor_cache_bytes",
        "Processed image bytes held by the frontend (all tenants).",
    ),
    Metric(
        "upload_pending_bytes", GAUGE, "mmcast_upload_pending_bytes",
        "Bytes held by unfinished uploads (all tenants).",
    ),
    # The frontend's work, counted where it is done (frontend_counter): a refused request must add nothing to these.
    Metric(
        "frontend_images_decoded", COUNTER, "mmcast_frontend_images_decoded_total",
        "Images decoded and preprocessed (processor-cache misses).",
    ),
    Metric(
        "frontend_decoded_pixels", COUNTER, "mmcast_frontend_decoded_pixels_total",
        "Pixels (width x height) of the images decoded.",
    ),
    Metric(
        "frontend_videos_decoded", COUNTER, "mmcast_frontend_videos_decoded_total",
        "Videos decoded and preprocessed by the frontend (--payload-encoding pixels; encoded: the owner rank).",
    ),
    Metric(
        "frontend_decoded_video_frames", COUNTER, "mmcast_frontend_decoded_video_frames_total",
        "Sampled video frames the frontend decoded.",
    ),
    Metric("frontend_prompts_tokenized", COUNTER, "mmcast_frontend_prompts_tokenized_total", "Prompts tokenized."),
    Metric(
        "frontend_tokenized_bytes", COUNTER, "mmcast_frontend_tokenized_bytes_total",
        "UTF-8 bytes of the rendered chat templates tokenized.",
    ),
    Metric(
        "frontend_image_cpu_seconds", HISTOGRAM, "mmcast_frontend_image_cpu_seconds",
        "Frontend CPU seconds per image of a request: hashing, header checks and (pixels encoding) decoding.",
        buckets=_IMAGE_CPU_BUCKETS,
    ),
    # --- the vision encoder over the group
    Metric(
        "encoder_items", COUNTER, "mmcast_encoder_items_total",
        "Items scheduled for the vision encoder (each once, whatever the placement).",
    ),
    Metric(
        "encoder_runs", COUNTER, "mmcast_encoder_runs_total",
        "Vision-encoder runs scheduled over the group (sharded placement: one per item encoded; replicated: one "
        "per rank).",
    ),
    Metric(
        "encoder_output_shared_bytes", COUNTER, "mmcast_encoder_output_shared_bytes_total",
        "Encoder-output bytes owner ranks broadcast to the other ranks over the group's collective, summed over "
        "receivers (sharded placement).",
    ),
    # --- requests and the group's health
    Metric("preemptions", COUNTER, "mmcast_preemptions_total", "Requests preempted for lack of KV blocks."),
    Metric("group_up", GAUGE, "mmcast_worker_group_up", "1 when every rank has completed its handshake."),
    Metric(
        "group_recoveries", COUNTER, "mmcast_worker_group_recoveries_total",
        "Times the worker group was lost and its requests requeued.",
    ),
    Metric(
        "poison_requests", COUNTER, "mmcast_poison_requests_total",
        "Requests failed because they crashed the worker group twice (poison isolation).",
    ),
    Metric(
        "requests_finished", COUNTER, "mmcast_requests_finished_total", "Finished requests by finish reason.",
        ("reason",),
    ),
    Metric("prompt_tokens", COUNTER, "mmcast_prompt_tokens_total", "Prompt tokens of admitted requests."),
    Metric("generation_tokens", COUNTER, "mmcast_generation_tokens_total", "Tokens generated."),
    # --- the OpenAI-compatible HTTP API (openai_api.py); `route` is one of HTTP_ROUTES or "other"
    Metric(
        "http_requests", COUNTER, "mmcast_http_requests_total",
        "HTTP API requests answered, by route, method and status code.",
        ("route", "method", "status"),
    ),
    Metric(
        "http_seconds", HISTOGRAM, "mmcast_http_request_duration_seconds",
        "HTTP API request received to its response complete (a stream: to its last event), by route and method.",
        ("route", "method"), buckets=_REQUEST_BUCKETS,
    ),
    Metric("http_in_flight", GAUGE, "mmcast_http_requests_in_flight", "HTTP API requests being answered."),
    Metric(
        "http_closed", COUNTER, "mmcast_http_connections_closed_total",
        "HTTP connections the server closed on a deadline (header_timeout, write_timeout; http_guard.py).",
        ("reason",), series=("header_timeout", "write_timeout"),  # http_guard.py
    ),
)  # fmt: skip


class SchedulerMetrics(MetricSet):
    """One registry per scheduler, so several can live in one test process."""

    TABLE = SCHEDULER_METRICS

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self._cache_config: tuple[int, int] | None = None
        self.lora_info.labels("0", "", "").set(1)

    def set_cache_config(self, block_size: int, num_blocks: int) -> None:
        """The pool's geometry as the info metric's labels; only the current pool's series remains."""
        if self._cache_config != (block_size, num_blocks):
            self.cache_config_info.clear()
            self.cache_config_info.labels(str(block_size), str(num_blocks)).set(1)
            self._cache_config = (block_size, num_blocks)

    def frontend_counter(self, name: str) -> Counter:
        """The counter of one kind of frontend work (``images_decoded``, ``prompts_tokenized``, ...)."""
        return getattr(self, f"frontend_{name}")
