"""An in-process fake `Generation` server for testing code that uses the SDK (no model, no workers).

    with FakeGenerationServer() as fake:
        fake.fail("Generate", grpc.StatusCode.UNAVAILABLE, "restarting")  # the next Generate call fails
        with Client(fake.target) as client:
            client.generate("hi", max_tokens=4)
        fake.requests[-1]  # the GenerateRequest it received
        fake.health.set("mmcast.v1.GenerationService", NOT_SERVING)  # act as a scheduler whose worker group is down

Tokens are a deterministic function of the request (so equal requests get equal answers), one delta per token.
Uploaded images are kept in memory; an unknown `uploaded_sha256` is answered with NOT_FOUND, as the real server does.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import hashlib
import threading
import time
from concurrent import futures

import grpc

from mmcast.v1 import generation_pb2 as pb
from mmcast.v1 import generation_pb2_grpc as pb_grpc
from mmcast.v1 import logprob_pb2


@dataclasses.dataclass
class Fault:
    code: grpc.StatusCode
    message: str
    after_tokens: int = 0  # tokens streamed before the abort (Generate only)
    final_error: bool = False  # end with a final message of FINISH_REASON_ERROR instead of a status
    reorder: bool = False  # UploadImage only: no status; the chunks are joined last first, as a stream replayed
    # out of order would arrive (the server's sha256 check then fails)


class FakeGenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, token_delay: float = 0.0) -> None:
        self.lock = threading.Lock()
        self.token_delay = token_delay  # seconds between streamed tokens
        self.requests: list[pb.GenerateRequest] = []
        self.uploads: list[str] = []  # sha256 of every completed upload, in order
        self.upload_chunks: list[list[tuple[int, str]]] = []  # per upload: (chunk bytes, expected_sha256) per chunk
        self.stored: dict[str, bytes] = {}
        self.faults: dict[str, collections.deque[Fault]] = collections.defaultdict(collections.deque)
        self.cancelled: list[str] = []  # request ids whose client went away mid-stream
        self.active: set[str] = set()  # request ids being streamed now
        self.metadata: list[tuple[tuple[str, str], ...]] = []

    def fail(self, method: str, code: grpc.StatusCode, message: str, **kwargs) -> None:
        """The next call of `method` fails with `code` (queue several for several calls)."""
        with self.lock:
            self.faults[method].append(Fault(code, message, **kwargs))

    def _fault(self, method: str) -> Fault | None:
        with self.lock:
            queue = self.faults[method]
            return queue.popleft() if queue else None

    def _record(self, context) -> None:
        with self.lock:
            self.metadata.append(tuple((m.key, m.value) for m in context.invocation_metadata()))

    @staticmethod
    def tokens_for(request: pb.GenerateRequest) -> list[int]:
        """The fake's answer: a function of the messages and sampling only (not the request id)."""
        key = hashlib.sha256(b"".join(m.SerializeToString(deterministic=True) for m in request.messages))
        key.update(str(request.sampling.seed).encode())
        base = int.from_bytes(key.digest()[:4], "little")
        return [(base + 7 * i) % 1000 for i in range(request.sampling.max_tokens)]

    def Generate(self, request, context):
        self._record(context)
        with self.lock:
            self.requests.append(request)
        fault = self._fault("Generate")
        if fault is not None and fault.after_tokens == 0 and not fault.final_error:
            context.abort(fault.code, fault.message)
        images = 0
        for m, message in enumerate(request.messages):
            for p, part in enumerate(message.content):
                if part.WhichOneof("part") != "image":
                    continue
                images += 1
                sha = part.image.uploaded_sha256
                if part.image.WhichOneof("source") == "uploaded_sha256" and sha not in self.stored:
                    context.abort(
                        grpc.StatusCode.NOT_FOUND,
                        f"messages[{m}].content[{p}].image.uploaded_sha256={sha} is not stored; upload it again",
                    )
        request_id = request.request_id or "fake-assigned"
        tokens = self.tokens_for(request)
        with self.lock:
            self.active.add(request_id)
        completed = False
        try:
            started = time.monotonic()
            first = None
            for i, token in enumerate(tokens):
                if fault is not None and not fault.final_error and i == fault.after_tokens:
                    completed = True  # ended by the server, not cancelled by the client
                    context.abort(fault.code, fault.message)
                if self.token_delay:
                    time.sleep(self.token_delay)
                if not context.is_active():
                    return  # the client went away; recorded below
                delta = pb.TokenDelta(token_ids=[token], text=f"t{token} ")
                if request.sampling.return_logprobs:
                    top = [logprob_pb2.TopLogprob(token_id=token, logprob=-0.5)][: request.sampling.logprobs]
                    delta.logprobs.add(token_id=token, logprob=-0.5 - i / 100, top_logprobs=top)
                first = first or time.monotonic()
                yield pb.GenerateResponse(delta=delta)
            final = pb.GenerateFinal(
                finish_reason=pb.FINISH_REASON_LENGTH,
                request_id=request_id,
                usage=pb.Usage(
                    prompt_tokens=sum(len(p.text) for m in request.messages for p in m.content) + 100 * images,
                    completion_tokens=len(tokens),
                    images=images,
                    images_sent=images,
                    payload_bytes_broadcast=1000 * images,
                ),
                timings=pb.Timings(
                    time_to_first_token=datetime.timedelta(seconds=(first or started) - started),
                    total_time=datetime.timedelta(seconds=time.monotonic() - started),
                ),
            )
            if fault is not None and fault.final_error:
                final.finish_reason = pb.FINISH_REASON_ERROR
                final.error.grpc_code = fault.code.value[0]
                final.error.message = fault.message
            yield pb.GenerateResponse(final=final)
            completed = True  # ended normally
        finally:
            # A cancelled RPC may never resume this generator (gRPC closes it at its pending yield), so the
            # cancellation is recorded here, together with leaving `active`, under one lock.
            with self.lock:
                if not completed:
                    self.cancelled.append(request_id)
                self.active.discard(request_id)

    def UploadImage(self, request_iterator, context):
        self._record(context)
        fault = self._fault("UploadImage")
        if fault is not None and not fault.reorder:
            context.abort(fault.code, fault.message)
        chunks, expected, shape = [], "", []
        for i, chunk in enumerate(request_iterator):
            if i == 0:
                expected = chunk.expected_sha256
            chunks.append(chunk.data)
            shape.append((len(chunk.data), chunk.expected_sha256))
        data = b"".join(chunks[::-1] if fault is not None else chunks)
        sha = hashlib.sha256(data).hexdigest()
        if expected and expected != sha:  # as the scheduler answers: google.rpc.BadRequest names the field
            _abort_bad_field(context, "expected_sha256", f"expected_sha256={expected} but the bytes hash to {sha}")
        with self.lock:
            present = sha in self.stored
            self.stored[sha] = data
            self.uploads.append(sha)
            self.upload_chunks.append(shape)
        return pb.UploadImageResponse(sha256=sha, byte_size=len(data), already_present=present)

    def GetServerInfo(self, request, context):
        self._record(context)
        fault = self._fault("GetServerInfo")
        if fault is not None:
            context.abort(fault.code, fault.message)
        return pb.GetServerInfoResponse(
            model="fake",
            model_fingerprint="0" * 64,
            max_model_len=4096,
            max_images_per_request=16,
            max_image_pixels=1 << 22,
            max_request_bytes=64 << 20,
            max_upload_bytes=32 << 20,
            transfer_mode=pb.TRANSFER_MODE_LAZY,
            tensor_parallel_size=1,
            group_ready=True,
        )


def _abort_bad_field(context, field: str, message: str) -> None:
    """INVALID_ARGUMENT with a google.rpc.BadRequest naming ``field``: the scheduler's form of a bad field."""
    from google.protobuf import any_pb2
    from google.rpc import code_pb2, error_details_pb2, status_pb2
    from grpc_status import rpc_status

    detail = any_pb2.Any()
    violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
    detail.Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=message, details=[detail])
    context.abort_with_status(rpc_status.to_status(status))


def _serving_health(server: grpc.Server):
    """grpc.health.v1 reporting the generation service SERVING, as a ready scheduler does: the SDK's channel
    checks it (mmcast_client/_core/). None where grpcio-health-checking is not installed: the SDK's channel then
    treats the server as healthy (gRPC logs that the health service is unimplemented)."""
    try:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    except ImportError:
        return None
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    service = next(iter(pb.DESCRIPTOR.services_by_name.values())).full_name
    servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return servicer


class FakeGenerationServer:
    """The fake servicer on a loopback port (`port=0`: chosen by the OS); `with` starts and stops it."""

    def __init__(self, token_delay: float = 0.0, max_workers: int = 16, port: int = 0) -> None:
        self.servicer = FakeGenerationServicer(token_delay)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers),
            options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)],
        )
        pb_grpc.add_GenerationServiceServicer_to_server(self.servicer, self.server)
        self.health = _serving_health(self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.target = f"127.0.0.1:{self.port}"

    def __getattr__(self, name):  # requests, uploads, fail(), ... of the servicer
        return getattr(self.servicer, name)

    def start(self) -> FakeGenerationServer:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=None)

    def __enter__(self) -> FakeGenerationServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
