"""The bad-input catalogue (tests/support/security_catalogue.py) against real processes.

One scheduler + one rank (``LocalGroup``, bearer tokens on the client API, a shared token on the rank streams)
takes every client-API case, each beside a concurrent well-formed request that must still succeed; afterwards
the scheduler's gauges (running, waiting, KV blocks used), cache sizes (uploads, processed images) and unfinished
upload bytes must be back where they were. Cases that name ``untouched`` counters (images decoded, text tokenized)
must not have grown them; ``repeat_peak`` cases run three times and the scheduler's peak RSS (VmHWM: the allocator
settings keep freed memory, so current RSS says little) may grow by at most ``PEAK_TOLERANCE`` over them. A standalone ``mmcast-worker`` takes every step-stream case; afterwards it must still accept a
fresh handshake and serve a well-formed step with an image, and hold nothing (payload and encoder caches empty).

``MMCAST_SECURITY_REPORT_DIR=<folder>`` writes what each case got and how long it took to ``catalogue.json`` there
(docs/SECURITY.md's tables: see ``scripts/security_doc.py``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import grpc
import pytest

from benchmarks.support.proc_memory import peak_mib
from mmcast.v1 import generation_pb2 as pb
from tests.support import security_catalogue as cat
from tests.support.rich_errors import check_contract, details_of
from tests.support.security_support import scrape, wait_for

pytestmark = pytest.mark.slow

CLIENT = [c for c in cat.CASES if c.endpoint == "client"]
STEP = [c for c in cat.CASES if c.endpoint == "step"]
GAUGES = ("mmcast_requests_running", "mmcast_requests_waiting", "mmcast_kv_blocks_used")
CACHES = ("mmcast_upload_store_bytes", "mmcast_processor_cache_bytes", "mmcast_upload_pending_bytes")
# Peak-RSS growth allowed over three runs of a repeat_peak case: gRPC's buffers for a ~1 MB message and the
# concurrent request. Decoding the ICO bomb once would add ~500 MiB (169 MB grey + 507 MB RGB).
PEAK_TOLERANCE = 48 << 20
RANK_CACHES = (
    "mmcast_worker_payload_cache_bytes",
    "mmcast_worker_payload_cache_items",
    "mmcast_worker_encoder_cache_tokens",
)
# Refused before the service reads the request (gRPC's receive limit, the decode guard): no field to name, no details.
BEFORE_SERVICE = (
    "request-over-max-bytes",
    "protobuf-garbage",
    "protobuf-truncated",
    "protobuf-invalid-utf8",
    "upload-garbage-chunk",
    "unknown-method",
)
RESULTS: list[dict] = []


@pytest.fixture(scope="module")
def secrets_dir(catalogue_secrets):
    return catalogue_secrets


@pytest.fixture(scope="module")
def processes(catalogue_group):
    try:
        yield catalogue_group
    finally:
        if os.environ.get("MMCAST_SECURITY_REPORT_DIR"):
            with open(os.path.join(os.environ["MMCAST_SECURITY_REPORT_DIR"], "catalogue.json"), "w") as f:
                json.dump(RESULTS, f, indent=1)


@pytest.fixture(scope="module")
def client_ctx(processes, secrets_dir, tiny_model_dir):
    group, _ = processes
    grpcurl = os.path.join(os.path.dirname(sys.executable), "grpcurl")
    ctx = cat.ClientCtx(
        group.target,
        secrets_dir[1],
        grpcurl if os.path.exists(grpcurl) else None,
        other_token=secrets_dir[3],
        metrics_url=group.metrics_urls["scheduler"],
    )
    ctx.generate(cat.good_request())  # the good request's image is processed and cached once, before any case
    yield ctx
    ctx.close()


@pytest.fixture(scope="module")
def step_ctx(processes, secrets_dir, tiny_model_dir):
    import itertools

    from transformers import AutoConfig

    _, rank = processes
    vocab = AutoConfig.from_pretrained(tiny_model_dir).text_config.vocab_size
    counter = itertools.count(time.time_ns())
    ctx = cat.StepCtx(rank.target, secrets_dir[2], tiny_model_dir, vocab, lambda: next(counter))
    yield ctx
    ctx.close_all()


def peak_rss(group) -> int:
    """The scheduler's peak resident set (VmHWM), bytes."""
    return int(peak_mib(group.pids()["scheduler"]) * 1024) << 10


def scheduler_state(group) -> dict[str, float]:
    metrics = scrape(group.metrics_urls["scheduler"])
    return {name: metrics[name] for name in GAUGES + CACHES}


class Concurrent:
    """A well-formed request running on its own thread while a case runs."""

    def __init__(self, ctx: cat.ClientCtx) -> None:
        self.responses: list[pb.GenerateResponse] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(ctx,), daemon=True)
        self.thread.start()

    def _run(self, ctx) -> None:
        try:
            self.responses = ctx.generate(cat.good_request())
        except BaseException as exc:  # noqa: BLE001 - reported by check()
            self.error = exc

    def check(self) -> None:
        self.thread.join(60)
        assert not self.thread.is_alive(), "the concurrent well-formed request did not finish"
        assert self.error is None, f"the concurrent well-formed request failed: {self.error!r}"
        final = self.responses[-1].final
        assert final.finish_reason == pb.FINISH_REASON_LENGTH and final.usage.completion_tokens == 4, final


@pytest.mark.parametrize("case", CLIENT, ids=[c.id for c in CLIENT])
def test_client_case(case, processes, client_ctx):
    group, _ = processes
    if case.id.startswith("grpcurl") and client_ctx.grpcurl is None:
        pytest.skip("grpcurl is not installed (make tools)")
    before = scheduler_state(group)
    counters = scrape(group.metrics_urls["scheduler"])
    peak = peak_rss(group)
    good = Concurrent(client_ctx)
    t0 = time.perf_counter()
    with pytest.raises(grpc.RpcError) as caught:
        case.run(client_ctx)
    seconds = time.perf_counter() - t0
    good.check()
    for _ in range(2 if case.repeat_peak else 0):
        with pytest.raises(grpc.RpcError) as again:
            case.run(client_ctx)
        assert again.value.code().name == case.code, again.value.details()
    code, message = caught.value.code().name, caught.value.details() or ""
    RESULTS.append(
        {"id": case.id, "endpoint": case.endpoint, "code": code, "message": message, "seconds": round(seconds, 4)}
    )
    assert code == case.code, f"{case.id}: expected {case.code}, got {code}: {message}"
    for word in case.mentions:
        assert word in message, f"{case.id}: the message does not name {word!r}: {message}"
    assert " at 0x" not in message, f"{case.id}: the message leaks an object address: {message}"
    if isinstance(caught.value, grpc.Call):  # the google.rpc details docs/ERRORS.md promises for this code
        if case.id in BEFORE_SERVICE:
            assert details_of(caught.value) == {}, case.id
        else:
            request = pb.UploadImageRequest if case.id.startswith("upload") else pb.GenerateRequest
            check_contract(caught.value, request.DESCRIPTOR)
    after = scrape(group.metrics_urls["scheduler"])
    for name, most in case.untouched:
        assert after[name] - counters[name] <= most, f"{case.id}: {name} grew by {after[name] - counters[name]}"
    if case.repeat_peak:
        grown = peak_rss(group) - peak
        assert grown <= PEAK_TOLERANCE, f"{case.id}: three runs grew the scheduler's peak RSS by {grown >> 20} MiB"
    # Nothing left behind: no request running or queued, no block held, no upload or processed image kept.
    wait_for(lambda: scheduler_state(group) == before, 5, f"{case.id}: scheduler state back to {before}")
    assert group.restarts == 0 and group.failure is None


@pytest.mark.parametrize("case", STEP, ids=[c.id for c in STEP])
def test_step_case(case, processes, step_ctx):
    _, rank = processes
    t0 = time.perf_counter()
    try:
        code, message = case.run(step_ctx)
    finally:
        step_ctx.close_all()
    seconds = time.perf_counter() - t0
    RESULTS.append(
        {"id": case.id, "endpoint": case.endpoint, "code": code, "message": message, "seconds": round(seconds, 4)}
    )
    assert code == case.code, f"{case.id}: expected {case.code}, got {code}: {message}"
    for word in case.mentions:
        assert word in message, f"{case.id}: the message does not name {word!r}: {message}"
    # The rank still serves a fresh handshake and a step with an image, and then holds nothing.
    cat.valid_step(step_ctx)

    def empty():
        metrics = scrape(rank.metrics_url)
        return all(metrics[name] == 0 for name in RANK_CACHES)

    wait_for(empty, 5, f"{case.id}: the rank's caches empty after its streams closed")
    assert rank.process.poll() is None, rank.log_tail()


def test_no_crash_statuses(processes):
    """After the whole catalogue: no call ended in UNKNOWN or INTERNAL (an uncaught exception) on either
    service, and every process is the one that started."""
    group, rank = processes
    for url in (group.metrics_urls["scheduler"], rank.metrics_url):
        bad = {
            k: v
            for k, v in scrape(url).items()
            if k.startswith("grpc_server_handled_total") and ('"Unknown"' in k or '"Internal"' in k) and v
        }
        assert not bad, f"{url}: {bad}"
    assert group.restarts == 0 and group.failure is None and rank.process.poll() is None


def test_catalogue_size():
    assert len(CLIENT) >= 40 and len(STEP) >= 20, (len(CLIENT), len(STEP))
    assert len({c.id for c in cat.CASES}) == len(cat.CASES), "case ids must be unique"
