"""Usage and the metrics count the payload bytes that really reached the ranks (scheduler_svc/core/transfer.py's
accounting rules), through the real service: an image repeated in one prompt and images shared by concurrent
requests, in every transfer mode."""

import threading

import grpc
import pytest

from mmcast.v1 import generation_pb2_grpc as gg
from mmcast.v1 import worker_pb2
from tests.support.chat import IMG_A, IMG_B, generate, image, request, text, user
from tests.support.service_harness import FakeGroupScheduler


def received(rank) -> tuple[int, int]:
    """(item deliveries, payload tensor bytes) in the payload frames a rank received."""
    items = nbytes = 0
    for raw in rank.frames:
        frame = worker_pb2.StepRequest.FromString(raw)
        if frame.WhichOneof("frame") == "payload":
            items += frame.payload.HasField("header")  # a header starts one field of one delivery
            nbytes += len(frame.payload.chunk.data)
    return items, nbytes


@pytest.mark.parametrize("mode", ["full", "strip", "lazy"])
def test_usage_and_metrics_equal_the_payload_the_ranks_received(tiny_model_dir, mode):
    h = FakeGroupScheduler(tiny_model_dir, n_ranks=2, transfer_mode=mode, rank_kw={"step_delay": 0.02}).start()
    finals = {}
    try:
        with grpc.insecure_channel(h.target) as ch:
            stub = gg.GenerationServiceStub(ch)
            prompts = {
                "twice": [user(image(IMG_A), text("and again"), image(IMG_A), text("same?"))],
                "shared": [user(image(IMG_B), image(IMG_A), text("both"))],
                "other": [user(image(IMG_B), text("alone"))],
            }

            def run(rid):
                finals[rid] = generate(stub, request(prompts[rid], max_tokens=3))[1]

            threads = [threading.Thread(target=run, args=(rid,)) for rid in prompts]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        h.stop()
    usages = [finals[rid].usage for rid in prompts]
    per_rank = [received(rank) for rank in h.ranks]
    fields_per_item = 1  # the tiny model's images carry one payload field (pixel_values)
    assert sum(u.images_sent for u in usages) == sum(n for n, _ in per_rank) // fields_per_item
    assert sum(u.payload_bytes_broadcast for u in usages) == sum(b for _, b in per_rank)
    m = h.server.metrics
    assert m.mm_items.labels("sent", "image")._value.get() == sum(u.images_sent for u in usages)
    saved = sum(
        m.payload_bytes_saved.labels(reason, "image")._value.get()
        for reason in ("prefix_covered", "rank_cached", "encoder_shared")
    )
    assert saved == sum(u.payload_bytes_saved for u in usages)
    # The wire metric adds only the frame headers to the tensor bytes.
    wire = h.server.group.bytes.payload
    assert sum(b for _, b in per_rank) < wire < 1.01 * sum(b for _, b in per_rank) + 4096
    # "twice" alone would have counted IMG_A twice per rank before; each image travels at most once per rank
    # per step, so the sum over requests cannot exceed 2 ranks x (deliveries of distinct images per admission).
    assert finals["twice"].usage.images_sent <= 2
