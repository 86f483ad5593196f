"""An in-process fake worker rank on port 0 that records every frame it receives, byte for byte.

It answers handshakes and steps like a real rank (rank 0 samples a fixed token per request that completes
its known tokens) and can be told to fail: drop its stream after N steps, refuse the handshake, or answer a
step with a protocol error.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from common import item_proto
from common.auth import BearerTokenInterceptor, TokenTable
from mmcast.v1 import worker_pb2


@dataclasses.dataclass
class FakeRankConfig:
    rank: int
    world_size: int
    fingerprint: str
    kv_blocks: int = 256
    payload_cache_bytes: int = 1 << 30
    encoder_cache_tokens: int = 1 << 16
    max_model_len: int = 32768
    drop_after_steps: int | None = None  # end the stream with UNAVAILABLE when this many steps were answered
    drop_once_after_steps: int | None = None  # the same, once (cleared when it fires)
    refuse_handshake: str | None = None  # abort the handshake with FAILED_PRECONDITION and this message
    step_delay: float = 0.0  # seconds each step takes
    token: str | None = None  # demand 'authorization: Bearer <token>' on Step streams, as a real rank does


class FakeRank:
    def __init__(self, cfg: FakeRankConfig) -> None:
        self.cfg = cfg
        self.frames: list[bytes] = []  # every raw StepRequest received, in order, across streams
        self.bytes_by_kind = {"payload": 0, "metadata": 0, "control": 0}
        self.steps_answered = 0
        self.handshakes: list[worker_pb2.Handshake] = []
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self.sequences: dict[str, list[int]] = {}  # request id -> tokens the rank was told

    async def start(self) -> str:
        handler = grpc.stream_stream_rpc_method_handler(self._step, request_deserializer=None, response_serializer=None)
        interceptors = []
        if self.cfg.token:  # the real rank's interceptor: UNAUTHENTICATED before any frame is read
            table = TokenTable.single(self.cfg.token, "scheduler")
            interceptors.append(BearerTokenInterceptor(table, ("/mmcast.v1.WorkerService/",)))
        self.server = grpc.aio.server(
            interceptors=interceptors, options=[("grpc.max_receive_message_length", 256 << 20)]
        )
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("mmcast.v1.WorkerService", {"Step": handler})]
        )
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)

    def _count(self, raw: bytes, frame: worker_pb2.StepRequest) -> None:
        kind = frame.WhichOneof("frame")
        if kind == "payload":
            self.bytes_by_kind["payload"] += len(raw)
        elif kind == "control":
            metadata, rest = item_proto.control_byte_breakdown(frame.control, len(raw))
            self.bytes_by_kind["metadata"] += metadata
            self.bytes_by_kind["control"] += rest
        else:
            self.bytes_by_kind["control"] += len(raw)

    async def _step(self, request_iterator, context):
        cfg = self.cfg
        async for raw in request_iterator:
            self.frames.append(raw)
            frame = worker_pb2.StepRequest.FromString(raw)
            self._count(raw, frame)
            kind = frame.WhichOneof("frame")
            if kind == "handshake":
                self.handshakes.append(frame.handshake)
                if cfg.refuse_handshake:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, cfg.refuse_handshake)
                ack = worker_pb2.HandshakeAck(
                    protocol_version=item_proto.PROTOCOL_VERSION,
                    model_fingerprint=cfg.fingerprint,
                    rank=cfg.rank,
                    world_size=cfg.world_size,
                    kv_blocks=cfg.kv_blocks,
                    payload_cache_bytes=cfg.payload_cache_bytes,
                    encoder_cache_tokens=cfg.encoder_cache_tokens,
                    max_tensor_bytes=1 << 30,
                    max_model_len=cfg.max_model_len,
                    device="cpu",
                )
                yield worker_pb2.StepResponse(handshake_ack=ack).SerializeToString()
            elif kind == "keepalive":
                yield worker_pb2.StepResponse(keepalive=frame.keepalive).SerializeToString()
            elif kind == "control":
                if cfg.drop_after_steps is not None and self.steps_answered >= cfg.drop_after_steps:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake rank dropped its stream")
                if cfg.drop_once_after_steps is not None and self.steps_answered >= cfg.drop_once_after_steps:
                    cfg.drop_once_after_steps = None
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake rank dropped its stream once")
                result = worker_pb2.StepResult(step_id=frame.control.step_id, rank=cfg.rank)
                sampled = self._sample(frame.control)
                if cfg.rank == 0:
                    result.sampled.extend(sampled)
                self.steps_answered += 1
                await asyncio.sleep(cfg.step_delay)
                yield worker_pb2.StepResponse(step_result=result).SerializeToString()

    def _sample(self, control: worker_pb2.StepControl) -> list[worker_pb2.SampledToken]:
        """A deterministic 'model': the next token is a function of the whole sequence so far, so a request
        recomputed after a recovery continues exactly where it was."""
        out = []
        for rid in control.finished_request_ids:
            self.sequences.pop(rid, None)
        ends = []
        for req in control.new_requests:
            self.sequences[req.request_id] = list(req.prompt_token_ids)
            ends.append((req.request_id, req.num_computed_tokens + req.num_scheduled_tokens))
        for req in control.running:
            self.sequences[req.request_id].extend(req.new_token_ids)
            ends.append((req.request_id, req.num_computed_tokens + req.num_scheduled_tokens))
        for rid, end in ends:
            if end == len(self.sequences[rid]):
                token = next_token(self.sequences[rid])
                out.append(worker_pb2.SampledToken(request_id=rid, token_id=token, logprob=-0.5))
        return out


def next_token(sequence: list[int]) -> int:
    """The fake model's greedy choice after ``sequence`` (never a special token of the tiny vocabulary)."""
    return (sum(sequence[-4:]) * 31 + len(sequence)) % 997


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]
