"""Rich error details (``google.rpc``, docs/ERRORS.md) as a client of a real ``mmcast-scheduler`` process sees them.

The scheduler runs from the CLI in its own process, its worker group one recording fake rank in this process.
Each bad input is checked by parsing the call's ``grpc-status-details-bin`` with
``grpc_status.rpc_status.from_call`` (tests/support/rich_errors.py), never through the server's own helper: the detail
types, the field paths, the retry delays and the resource names, and that the plain code and message are the
ones clients saw before details existed. After the bad inputs a well-formed request is served.
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import time

import grpc
import pytest
from PIL import Image

from common.hashing import model_fingerprint
from mmcast.v1 import generation_pb2 as g
from mmcast.v1 import generation_pb2_grpc as gg
from mmcast_local.child_processes import free_ports
from tests.support.fake_rank import FakeRank, FakeRankConfig
from tests.support.rich_errors import check_contract, details_of, retry_seconds, violations
from tests.support.security_support import serving, wait_for
from tests.support.service_harness import LoopThread
from tests.support.worker_driver import RANK_TOKEN, rank_token_file

pytestmark = pytest.mark.slow  # a scheduler process (most of its start is importing torch and transformers)

# The reconnect backoff, fixed (initial = max) and shorter than the 1 s default hint, so the hint seen is computed.
BACKOFF = 0.4
LIMITS = {
    "--max-image-pixels": 1_000_000,
    "--max-upload-bytes": 65536,
    "--max-pending-upload-bytes-per-tenant": 4096,
    "--group-deadline-seconds": 0.5,
    "--reconnect-backoff-initial-seconds": BACKOFF,
    "--reconnect-backoff-max-seconds": BACKOFF,
    "--drain-seconds": 0,
}


def png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (90, 140, 200)).save(buf, "PNG")
    return buf.getvalue()


def user(*parts) -> g.ChatMessage:
    return g.ChatMessage(role=g.ROLE_USER, content=list(parts))


def request(*parts, max_tokens: int = 4, **sampling) -> g.GenerateRequest:
    return g.GenerateRequest(
        messages=[user(*parts)], sampling=g.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    )


class Scheduler:
    def __init__(self, model_dir, log_path) -> None:
        self.loop = LoopThread()
        self.rank = FakeRank(
            FakeRankConfig(rank=0, world_size=1, fingerprint=model_fingerprint(model_dir), token=RANK_TOKEN)
        )
        self.loop.run(self.rank.start())
        self.target = f"127.0.0.1:{free_ports(1)[0]}"
        self.log_path = log_path
        argv = [
            sys.executable,
            "-m",
            "scheduler_svc.main",
            "--model",
            str(model_dir),
            "--workers",
            self.rank.address,
            "--listen",
            self.target,
            "--metrics-port",
            "0",
            "--worker-token-file",
            rank_token_file(),
            *[x for k, v in LIMITS.items() for x in (k, str(v))],
        ]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log_path.open("wb"))
        self.channel = grpc.insecure_channel(self.target)
        self.stub = gg.GenerationServiceStub(self.channel)

    def wait_serving(self, timeout: float = 180.0) -> None:
        def ready():
            assert self.process.poll() is None, self.log_path.read_text()[-3000:]
            return serving(self.target, "mmcast.v1.GenerationService")

        wait_for(ready, timeout, f"the scheduler at {self.target} did not become SERVING", interval=0.1)

    def generate(self, req: g.GenerateRequest) -> list[g.GenerateResponse]:
        return list(self.stub.Generate(req, timeout=30))

    def failure(self, call) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            call()
        return info.value

    def stop(self) -> None:
        self.channel.close()
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        self.loop.run(self.rank.stop())
        self.loop.close()


@pytest.fixture(scope="module")
def scheduler(tiny_model_dir, tmp_path_factory):
    s = Scheduler(tiny_model_dir, tmp_path_factory.mktemp("errors") / "scheduler.log")
    try:
        s.wait_serving()
        yield s
    finally:
        s.stop()


def test_three_bad_inputs_carry_the_details_a_client_acts_on(scheduler):
    s = scheduler
    # 1. an image over --max-image-pixels: BadRequest naming the image's path, the message naming limit and flag
    err = s.failure(
        lambda: s.generate(request(g.ContentPart(text="look"), g.ContentPart(image=g.ImageInput(data=png(1100, 1000)))))
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(
        "messages[0].content[1].image: image is 1100x1000 = 1100000 pixels; the limit is 1000000 (--max-image-pixels)"
    ), err.details()
    assert violations(err) == [("messages[0].content[1].image", err.details())]
    assert set(details_of(err)) == {"BadRequest"}  # a limit of the request: no retry hint
    check_contract(err, g.GenerateRequest.DESCRIPTOR)

    # 2. a bad sampling parameter
    err = s.failure(lambda: s.generate(request(g.ContentPart(text="hi"), temperature=3.0)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "sampling.temperature=3.0 must be in [0, 2]"
    assert violations(err) == [("sampling.temperature", err.details())]
    check_contract(err, g.GenerateRequest.DESCRIPTOR)

    # 3. a reference to an image never uploaded: ResourceInfo with its sha256, nothing to retry
    sha = hashlib.sha256(b"an image this server never received").hexdigest()
    err = s.failure(
        lambda: s.generate(
            request(g.ContentPart(text="and this?"), g.ContentPart(image=g.ImageInput(uploaded_sha256=sha)))
        )
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert err.details().startswith(f"messages[0].content[1].image.uploaded_sha256={sha} is not in the upload store")
    info = details_of(err)["ResourceInfo"]
    assert (info.resource_type, info.resource_name, info.description) == ("mmcast.v1/image", sha, err.details())
    assert retry_seconds(err) is None and violations(err) == []
    check_contract(err, g.GenerateRequest.DESCRIPTOR)

    # the service kept serving
    final = s.generate(request(g.ContentPart(text="still there?")))[-1].final
    assert final.finish_reason == g.FINISH_REASON_LENGTH and final.usage.completion_tokens == 4


def test_resource_exhausted_says_when_to_retry_only_where_a_retry_can_succeed(scheduler):
    s = scheduler
    # load: unfinished uploads over --max-pending-upload-bytes-per-tenant -> RetryInfo, no field at fault
    err = s.failure(lambda: s.stub.UploadImage(iter([g.UploadImageRequest(data=bytes(8192))]), timeout=30))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-pending-upload-bytes-per-tenant" in err.details()
    assert retry_seconds(err) == 1.0 and violations(err) == []
    check_contract(err, g.UploadImageRequest.DESCRIPTOR)
    # a limit of the request: an inline image over --max-upload-bytes -> the field, no RetryInfo
    err = s.failure(lambda: s.generate(request(g.ContentPart(image=g.ImageInput(data=b"\x89PNG" + bytes(70_000))))))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "(--max-upload-bytes)" in err.details()
    assert violations(err) == [("messages[0].content[0].image", err.details())]
    assert retry_seconds(err) is None
    check_contract(err, g.GenerateRequest.DESCRIPTOR)


def test_unavailable_hints_the_groups_next_reconnect(scheduler):
    """The group lost past --group-deadline-seconds: UNAVAILABLE with RetryInfo no later than the scheduler's next
    reconnect attempt (at most the backoff away, not the 1 s default); then the group returns and serves."""
    s = scheduler
    s.rank.cfg.refuse_handshake = "rank restarting"
    s.rank.cfg.drop_once_after_steps = 0
    try:
        t0 = time.monotonic()
        err = s.failure(lambda: s.generate(request(g.ContentPart(text="anyone there?"))))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "group" in err.details(), err.details()
        assert 0.1 <= retry_seconds(err) <= BACKOFF, retry_seconds(err)
        assert time.monotonic() - t0 < 30
        check_contract(err, g.GenerateRequest.DESCRIPTOR)
    finally:
        s.rank.cfg.refuse_handshake = None
    s.wait_serving(30)
    final = s.generate(request(g.ContentPart(text="back again")))[-1].final
    assert final.usage.completion_tokens == 4
