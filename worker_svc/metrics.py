"""Prometheus metrics of a worker rank, one table (common/metric_table.py). Counters count the underlying unit
(bytes, items, errors); PromQL makes the ratios. Every metric of one rank lives in one registry, so in-process tests
can hold several ranks."""

from __future__ import annotations

from common.metric_table import COUNTER, GAUGE, HISTOGRAM, Metric, MetricSet
from mmcast.v1 import worker_pb2
from worker_svc.step_errors import code_name

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_CACHES = ("payload", "encoder")
# Every code from the start, so a dashboard shows a 0 rate rather than no data before the first error.
_PROTOCOL_ERROR_CODES = tuple(
    code_name(value)
    for value in worker_pb2.ProtocolErrorCode.values()
    if value != worker_pb2.PROTOCOL_ERROR_CODE_UNSPECIFIED
)

# A rank's metrics: attribute, kind, name, help, labels, buckets, series created at 0 from the start.
WORKER_METRICS = (
    Metric(
        "received_bytes", COUNTER, "mmcast_worker_received_bytes_total",
        "Serialized step-stream bytes received, by kind (payload frames, item metadata, other control).",
        ("kind",), series=("payload", "metadata", "control"),
    ),
    # --- the vision encoder and the images this rank owns
    Metric(
        "encoder_seconds", HISTOGRAM, "mmcast_worker_encoder_seconds",
        "Vision-encoder time per step with encoder work.",
        buckets=_STEP_BUCKETS,
    ),
    Metric(
        "encoder_runs", COUNTER, "mmcast_worker_encoder_runs_total",
        "Items this rank ran through the vision encoder (sharded placement: the items it owns).",
    ),
    Metric(
        "preprocess_seconds", HISTOGRAM, "mmcast_worker_preprocess_seconds",
        "Decoding and preprocessing of one encoded image payload on its owner rank.",
        buckets=_STEP_BUCKETS,
    ),
    Metric(
        "encoder_collective_bytes", COUNTER, "mmcast_worker_encoder_collective_bytes_total",
        "Encoder-output bytes this rank sent (as an item's owner) or received over the group's collective.",
    ),
    Metric(
        "encoder_collective_seconds", HISTOGRAM, "mmcast_worker_encoder_collective_seconds",
        "Time per step in the encoder status exchange and the encoder-output broadcasts (sharded placement).",
        buckets=_STEP_BUCKETS,
    ),
    Metric(
        "image_failures", COUNTER, "mmcast_worker_image_failures_total",
        "Encoded image payloads this rank owned that failed to decode or preprocess (the request failed alone).",
    ),
    Metric(
        "step_seconds", HISTOGRAM, "mmcast_worker_step_seconds",
        "Time from a step control received to its result sent.",
        buckets=_STEP_BUCKETS,
    ),
    Metric(
        "steps", COUNTER, "mmcast_worker_steps_total",
        "Step controls applied, by the thread that ran them: short steps of running requests run on the event "
        "loop's thread (--inline-step-max-ms), the rest on the compute thread.",
        ("thread",), series=("event_loop", "compute"),
    ),
    # --- caches; hit ratio = hits / queries, per cache
    Metric("payload_cache_bytes", GAUGE, "mmcast_worker_payload_cache_bytes", "Bytes held in the payload cache."),
    Metric("payload_cache_items", GAUGE, "mmcast_worker_payload_cache_items", "Items held in the payload cache."),
    Metric(
        "encoder_cache_tokens", GAUGE, "mmcast_worker_encoder_cache_tokens",
        "Encoder-output rows (LLM tokens) held in the encoder cache.",
    ),
    Metric(
        "cache_queries", COUNTER, "mmcast_worker_cache_queries_total",
        "Lookups: payload = an item this rank encodes (its payload is needed), encoder = an item's encoder output "
        "used by a request's tokens in a step (once per request window).",
        ("cache",), series=_CACHES,
    ),
    Metric(
        "cache_hits", COUNTER, "mmcast_worker_cache_hits_total",
        "Lookups answered by an entry held before the step: payload = received in an earlier step, encoder = "
        "computed in an earlier step.",
        ("cache",), series=_CACHES,
    ),
    # --- the protocol with the scheduler
    Metric(
        "protocol_errors", COUNTER, "mmcast_worker_protocol_errors_total",
        "Protocol errors reported to the scheduler, by code.",
        ("code",), series=_PROTOCOL_ERROR_CODES,
    ),
    Metric(
        "handshakes_refused", COUNTER, "mmcast_worker_handshakes_refused_total",
        "Handshakes of authenticated peers refused (mismatching model, rank, scheduler id or a stale epoch).",
    ),
)  # fmt: skip


class WorkerMetrics(MetricSet):
    TABLE = WORKER_METRICS

    def set_cache_sizes(self, payload_bytes: int, payload_items: int, encoder_tokens: int) -> None:
        self.payload_cache_bytes.set(payload_bytes)
        self.payload_cache_items.set(payload_items)
        self.encoder_cache_tokens.set(encoder_tokens)
