"""The TTFT breakdown of one request on both doors, against a real tp=2 group (the shared ``serve_local_tp2``): the
finished-request log line's ``ttft_<stage>_seconds`` keys and ``mmcast_request_stage_seconds{stage}``
(scheduler_svc/engine/stage_timing.py defines the stages).

Each request carries a new image, so its first token's step runs the vision encoder on a rank. The client times
its own TTFT; the disjoint stages lie inside it, so their sum may not exceed it."""

from __future__ import annotations

import base64
import json
import time
import uuid

import grpc
import httpx
import pytest

from mmcast.v1 import generation_pb2_grpc as gg
from scheduler_svc.engine.request_log import FINISHED_MESSAGE
from scheduler_svc.engine.stage_timing import DISJOINT_STAGES, RANK_PARTS, STAGES
from tests.support.chat import image, request, text, user
from tests.support.oracle import scrape, wait_until
from tests.support.security_catalogue import png

pytestmark = pytest.mark.slow

HISTOGRAM = "mmcast_request_stage_seconds"
ROUNDING = 1e-5  # the log line rounds each value to the microsecond


@pytest.fixture(scope="module")
def group(serve_local_tp2):
    return serve_local_tp2


def new_image() -> bytes:
    return png(112, 112, seed=uuid.uuid4().int % 2**32)  # noise: no rank holds it yet


def grpc_ttft(group, request_id: str) -> float:
    """Sends one streamed Generate; returns the seconds from the call to the first delta with tokens."""
    req = request([user(image(new_image()), text("describe it"))], max_tokens=4, request_id=request_id)
    with grpc.insecure_channel(group.target) as ch:
        t0 = time.monotonic()
        ttft = None
        for resp in gg.GenerationServiceStub(ch).Generate(req, timeout=60):
            if ttft is None and resp.HasField("delta") and resp.delta.token_ids:
                ttft = time.monotonic() - t0
    assert ttft is not None
    return ttft


def http_ttft(group, request_id: str, stream: bool) -> float:
    """Sends one chat completion with an inline image; returns the seconds to the first content (whole answers:
    to the body, which comes after the last token)."""
    url = "data:image/png;base64," + base64.b64encode(new_image()).decode()
    body = {
        "model": httpx.get(group.openai_base_url + "/models", timeout=10).json()["data"][0]["id"],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}],
            }
        ],
        "max_tokens": 4,
        "stream": stream,
        "ignore_eos": True,
    }
    headers = {"x-request-id": request_id}
    t0 = time.monotonic()
    with httpx.stream("POST", group.openai_base_url + "/chat/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        if not stream:
            r.read()
            return time.monotonic() - t0
        ttft = None
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0].get("delta", {}).get("content"):
                    ttft = time.monotonic() - t0
    assert ttft is not None
    return ttft


def finished_record(group, request_id: str) -> dict:
    def find():
        for line in (group.log_dir / "scheduler.log").read_text(errors="replace").splitlines():
            if line.startswith("{") and f'"{request_id}"' in line:
                record = json.loads(line)
                if record.get("msg") == FINISHED_MESSAGE and record.get("request_id") == request_id:
                    return record
        return None

    assert wait_until(lambda: find() is not None, timeout=10), f"no finished line for {request_id}"
    return find()


def stage_counts(group) -> dict[str, tuple[float, float]]:
    url = group.metrics_urls["scheduler"]
    return {s: (scrape(url, HISTOGRAM + "_count", stage=s), scrape(url, HISTOGRAM + "_sum", stage=s)) for s in STAGES}


def stages_of(record: dict) -> dict[str, float]:
    return {s: record[f"ttft_{s}_seconds"] for s in STAGES if f"ttft_{s}_seconds" in record}


def test_every_stage_of_a_streamed_request_lies_inside_its_ttft_on_both_doors(group):
    before = stage_counts(group)
    tag = uuid.uuid4().hex[:8]
    sent = {
        f"stages-grpc-{tag}": grpc_ttft(group, f"stages-grpc-{tag}"),
        f"stages-sse-{tag}": http_ttft(group, f"stages-sse-{tag}", stream=True),
    }
    records = {rid: finished_record(group, rid) for rid in sent}
    for rid, client_ttft in sent.items():
        record, stages = records[rid], stages_of(records[rid])
        assert set(stages) == set(STAGES), (rid, sorted(set(STAGES) - set(stages)))
        assert all(v >= 0 for v in stages.values()), (rid, stages)
        # Real ranks did real work in the first token's step: the encoder, the language model, rank 0's draw.
        for part in ("rank", "rank_encode", "rank_forward", "rank_sample", "rank_assemble", "frontend"):
            assert stages[part] > 0, (rid, part, stages)
        disjoint = sum(stages[s] for s in DISJOINT_STAGES)
        assert disjoint <= client_ttft + ROUNDING * len(DISJOINT_STAGES), (rid, disjoint, client_ttft, stages)
        # Up to the engine's delivery the stages lie inside the server's own TTFT as well.
        engine_side = disjoint - stages["detokenize"] - stages["first_byte"]
        assert engine_side <= record["time_to_first_token_seconds"] + ROUNDING * len(DISJOINT_STAGES), (rid, stages)
        inside_rank = stages["rank_encode"] + stages["rank_forward"] + stages["rank_sample"]
        assert inside_rank <= stages["rank"] * 1.05 + 0.002, (rid, stages)  # each part is its slowest rank's
    after = stage_counts(group)
    for s in STAGES:  # one sample per stage per request, its value the log line's
        count, total = after[s][0] - before[s][0], after[s][1] - before[s][1]
        assert count == len(sent), (s, count)
        assert total == pytest.approx(sum(stages_of(r)[s] for r in records.values()), abs=ROUNDING * len(sent))


def test_a_whole_http_answer_has_no_first_byte_stage(group):
    """Its body is written after the last token: a first_byte there would time the whole generation."""
    before = stage_counts(group)
    rid = f"stages-whole-{uuid.uuid4().hex[:8]}"
    http_ttft(group, rid, stream=False)
    stages = stages_of(finished_record(group, rid))
    assert set(stages) == set(STAGES) - {"first_byte"} and set(RANK_PARTS) <= set(stages)
    after = stage_counts(group)
    assert after["first_byte"][0] == before["first_byte"][0]
    assert all(after[s][0] - before[s][0] == 1 for s in stages)
