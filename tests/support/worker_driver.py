"""Test-side stand-ins for the scheduler's frontend and step builder, and the plain-transformers oracle.

``process_prompt`` turns text and PIL images into the token ids and items the scheduler's frontend would produce
(through the model's own processor). ``MiniScheduler`` drives one or more worker ranks over real Step streams:
explicit prefix hits (block ids reused from an earlier request), chunked prefill, encoder scheduling for the items
overlapping each window, payloads per transfer mode, deltas for decode steps. ``oracle`` is the reference:
``model.generate`` on the same checkpoint, without any cache tricks, at a fixed number of tokens.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import hashlib
import itertools
import os
import queue
import secrets
import shutil
import tempfile
import threading
import time

import grpc
import numpy as np
import torch
from PIL import Image

from common import codec, item_proto
from common.hashing import model_fingerprint
from common.ids import ItemId
from common.multimodal import (
    FieldKind,
    Modality,
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PayloadState,
    PlaceholderRange,
    strip_covered_mm_data,
)
from mmcast.v1 import worker_pb2

_EPOCHS = itertools.count(int(time.time() * 1000))
_MAX_MSG = 256 << 20
# The shared token of every rank the tests start (ranks refuse to start without authentication).
RANK_TOKEN = "test-rank-" + secrets.token_hex(16)
_token_file: str | None = None


def rank_token_file() -> str:
    """A file (mode 0600, removed at exit) holding ``RANK_TOKEN``, for ``--shared-token-file``/``--worker-token-file``."""
    global _token_file
    if _token_file is None:
        folder = tempfile.mkdtemp(prefix="mmcast-test-token-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        path = os.path.join(folder, "rank-token")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(RANK_TOKEN + "\n")
        _token_file = path
    return _token_file


def bearer(token: str | None = RANK_TOKEN) -> tuple[tuple[str, str], ...] | None:
    """Call metadata carrying ``token`` (None: no credentials)."""
    return (("authorization", f"Bearer {token}"),) if token else None


def next_epoch() -> int:
    return next(_EPOCHS)


def noise_image(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


@dataclasses.dataclass
class Prompt:
    token_ids: list[int]
    features: list[MultiModalFeatureSpec]  # full items (payload included), ordered by offset
    inputs: dict  # the processor's output, for the oracle


def process_prompt(processor, segments, image_token_id: int) -> Prompt:
    """``segments``: strings and PIL images in order, as one user turn of the chat template."""
    content = [{"type": "text", "text": s} if isinstance(s, str) else {"type": "image"} for s in segments]
    images = [s for s in segments if not isinstance(s, str)]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    features: list[MultiModalFeatureSpec] = []
    if images:
        is_image = inputs["input_ids"][0] == image_token_id
        starts = [i for i in range(len(ids)) if is_image[i] and (i == 0 or not is_image[i - 1])]
        # Each image's placeholder run, as the processor expanded it (the images are separated by other tokens).
        lengths = []
        for start in starts:
            end = start
            while end < len(ids) and is_image[end]:
                end += 1
            lengths.append(end - start)
        grids = inputs.get("image_grid_thw")  # None for a family without a grid (LLaVA: one (3, H, W) per image)
        rows = grids.prod(-1).tolist() if grids is not None else [1] * len(starts)
        pixels = torch.split(inputs["pixel_values"], rows)
        for index, start in enumerate(starts):
            length = lengths[index]
            fields = {"pixel_values": MultiModalFieldElem(pixels[index].contiguous(), kind=FieldKind.FLAT)}
            if grids is not None:
                fields["image_grid_thw"] = MultiModalFieldElem(grids[index : index + 1].clone(), keep_on_cpu=True)
            data = MultiModalKwargsItem(fields)
            ident = ItemId(hashlib.sha256(codec.tensor_bytes(pixels[index].contiguous())).hexdigest())
            features.append(MultiModalFeatureSpec(data, Modality.IMAGE, ident, PlaceholderRange(start, length)))
    return Prompt(ids, features, dict(inputs))


def with_pixels_replaced(prompt: Prompt, index: int, seed: int) -> Prompt:
    """The same prompt whose item ``index`` carries other pixels (same shape, other identifier)."""
    features = list(prompt.features)
    old = features[index]
    pixels = torch.randn(old.data["pixel_values"].data.shape, generator=torch.Generator().manual_seed(seed))
    data = MultiModalKwargsItem({**old.data, "pixel_values": MultiModalFieldElem(pixels, kind=FieldKind.FLAT)})
    ident = ItemId(hashlib.sha256(codec.tensor_bytes(pixels)).hexdigest())
    features[index] = dataclasses.replace(old, data=data, identifier=ident)
    return Prompt(prompt.token_ids, features, prompt.inputs)


def oracle(model, prompt: Prompt, max_new_tokens: int = 8) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from plain ``generate`` (no stop token: fixed length)."""
    import copy

    gen = copy.deepcopy(model.generation_config)
    gen.max_new_tokens, gen.do_sample = max_new_tokens, False
    gen.eos_token_id = []  # ignore_eos: no stop token, and no suppression of the ones the model picks
    gen.output_logits, gen.return_dict_in_generate = True, True
    with torch.inference_mode():
        out = model.generate(**prompt.inputs, generation_config=gen)
    tokens = out.sequences[0, len(prompt.token_ids) :].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs


# --- streams -------------------------------------------------------------------------------------------------


def handshake(model_dir, *, rank=0, world_size=1, epoch=None, block_size=16, scheduler_id="test", **overrides):
    hs = worker_pb2.Handshake(
        protocol_version=item_proto.PROTOCOL_VERSION,
        model_fingerprint=model_fingerprint(model_dir),
        rank=rank,
        world_size=world_size,
        scheduler_epoch=next_epoch() if epoch is None else epoch,
        scheduler_id=scheduler_id,
        block_size=block_size,
    )
    for key, value in overrides.items():
        if isinstance(value, list | tuple):
            getattr(hs, key).extend(value)
        else:
            setattr(hs, key, value)
    return hs


class StreamClient:
    """One Step stream that writes pre-serialized ``StepRequest`` bytes, as the scheduler does. ``token``: the
    bearer token it presents (default: the ranks' test token; None: no credentials)."""

    def __init__(self, target: str, hs: worker_pb2.Handshake, token: str | None = RANK_TOKEN) -> None:
        self.channel = grpc.insecure_channel(
            target, options=[("grpc.max_send_message_length", _MAX_MSG), ("grpc.max_receive_message_length", _MAX_MSG)]
        )
        self._queue: queue.Queue = queue.Queue()
        call = self.channel.stream_stream(
            "/mmcast.v1.WorkerService/Step",
            request_serializer=lambda b: b,
            response_deserializer=worker_pb2.StepResponse.FromString,
        )
        self._responses = call(iter(self._queue.get, None), metadata=bearer(token))
        self.handshake_bytes = worker_pb2.StepRequest(handshake=hs).SerializeToString()
        self.send(self.handshake_bytes)
        self.ack = self.recv()  # raises grpc.RpcError when the rank refuses the handshake

    def send(self, data: bytes) -> None:
        self._queue.put(data)

    def recv(self, timeout: float = 60.0) -> worker_pb2.StepResponse:
        box: list = []
        thread = threading.Thread(target=lambda: box.append(self._next()), daemon=True)
        thread.start()
        thread.join(timeout)
        if not box:
            raise TimeoutError(f"no frame from the rank within {timeout} s")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _next(self):
        try:
            return next(self._responses)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            return exc

    def close(self) -> None:
        self._queue.put(None)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass
        self.channel.close()


# --- a minimal scheduler -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Req:
    rid: str
    prompt: Prompt
    max_new_tokens: int
    chunk: int  # most prompt tokens computed per step
    computed: int  # tokens computed (the prefix hit at admission)
    block_ids: list[int]
    sampling: worker_pb2.WorkerSampling
    outputs: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    told: int = 0  # outputs the ranks have been told of
    blocks_told: int = 0
    admitted: bool = False
    finished_told: bool = False

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.max_new_tokens


class MiniScheduler:
    """Drives ranks over real streams. ``mode``: ``lazy`` (payload in the step that encodes the item) or ``full``
    (every uncovered payload at admission)."""

    def __init__(
        self,
        streams: list[StreamClient],
        *,
        block_size: int = 16,
        mode: str = "lazy",
        chunk_size=1 << 20,
        uses_mrope: bool = True,
    ):
        self.streams = streams
        self.uses_mrope = uses_mrope  # the model's rule (common/families/__init__.py): what a stripped item keeps
        self.block_size = block_size
        self.mode = mode
        self.chunk_size = chunk_size
        self.next_block = 0
        self.step_id = 0
        self.encoded: set[str] = set()  # the ranks' encoder-cache mirror
        self.held: set[str] = set()  # the ranks' payload-cache mirror
        self.sent_payload_ids: list[str] = []  # identifiers whose payload was written, in order
        self.stripped_ids: list[str] = []  # identifiers sent as STRIPPED metadata
        self.stripped_msgs: list = []  # their MultiModalItem messages, as written to the streams
        # bytes written to each stream, by kind
        self.sent_by_rank = [{"payload": 0, "metadata": 0, "control": len(s.handshake_bytes)} for s in streams]
        self.results: list[list[worker_pb2.StepResponse]] = []
        self._evict_payload: list[str] = []  # evictions the next control carries
        self._evict_encoder: list[str] = []

    def evict_everything(self) -> None:
        """The next step tells the ranks to drop every payload and encoder output (their caches become empty)."""
        self._evict_payload += sorted(self.held)
        self._evict_encoder += sorted(self.encoded)
        self.held.clear()
        self.encoded.clear()

    @property
    def sent(self) -> dict[str, int]:
        """Bytes written, summed over streams."""
        return {k: sum(d[k] for d in self.sent_by_rank) for k in ("payload", "metadata", "control")}

    def alloc(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def add(
        self,
        prompt: Prompt,
        rid: str,
        *,
        max_new_tokens: int = 8,
        chunk: int = 1 << 30,
        hit_from: Req | None = None,
        hit_blocks: int = 0,
        sampling: worker_pb2.WorkerSampling | None = None,
        outputs: list[int] = (),
    ) -> Req:
        """A request to admit; ``outputs``: tokens it generated before a preemption (resumed as a new request)."""
        blocks = list(hit_from.block_ids[:hit_blocks]) if hit_from else []
        return Req(
            rid=rid,
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            chunk=chunk,
            computed=len(blocks) * self.block_size,
            block_ids=blocks,
            sampling=sampling or worker_pb2.WorkerSampling(temperature=0.0, top_p=1.0, return_logprobs=True),
            outputs=list(outputs),
        )

    def _payload_frames(self, feature: MultiModalFeatureSpec) -> list[bytes]:
        frames = []
        for name, elem in feature.data.payload_fields().items():
            frames += codec.payload_frames(feature.identifier, name, elem.data, chunk_size=self.chunk_size)
        self.sent_payload_ids.append(feature.identifier)
        self.held.add(feature.identifier)
        return frames

    def build_step(self, reqs: list[Req], finished: list[str] = ()) -> tuple[list[bytes], worker_pb2.StepControl, list]:
        """Frames for one step of ``reqs`` (each gets its next window); returns (payload frames, control, plan)."""
        self.step_id += 1
        control = worker_pb2.StepControl(
            step_id=self.step_id,
            finished_request_ids=list(finished),
            evict_payload_ids=self._evict_payload,
            evict_encoder_ids=self._evict_encoder,
        )
        self._evict_payload, self._evict_encoder = [], []
        payloads: list[bytes] = []
        plan = []
        for req in reqs:
            known = req.prompt.token_ids + req.outputs
            start = req.computed
            count = min(req.chunk, len(known) - start)  # a decode step: computed == len(known) - 1, one token
            end = start + count
            assert end <= len(known), (req.rid, start, count, len(known))
            need = -(-end // self.block_size)
            req.block_ids += self.alloc(need - len(req.block_ids))
            if not req.admitted:
                wire_features = strip_covered_mm_data(req.prompt.features, req.computed, uses_mrope=self.uses_mrope)
                msg = control.new_requests.add(
                    request_id=req.rid,
                    prompt_token_ids=known,
                    block_ids=req.block_ids,
                    num_computed_tokens=req.computed,
                    num_scheduled_tokens=count,
                    num_output_tokens=len(req.outputs),
                    sampling=req.sampling,
                )
                for f in wire_features or ():
                    if f.payload_state is PayloadState.STRIPPED:
                        self.stripped_ids.append(f.identifier)
                        state = PayloadState.STRIPPED
                    elif f.identifier in self.held:
                        state = PayloadState.RANK_CACHED
                    elif self.mode == "full":
                        payloads += self._payload_frames(f)
                        state = PayloadState.PRESENT
                    else:
                        state = PayloadState.DEFERRED
                    msg.mm_items.append(item_proto.feature_to_proto(f, payload_state=state))
                    if state is PayloadState.STRIPPED:
                        self.stripped_msgs.append(msg.mm_items[-1])
                req.admitted = True
                req.told = len(req.outputs)
                req.blocks_told = len(req.block_ids)
            else:
                control.running.add(
                    request_id=req.rid,
                    new_token_ids=req.outputs[req.told :],
                    new_block_ids=req.block_ids[req.blocks_told :],
                    num_computed_tokens=start,
                    num_scheduled_tokens=count,
                )
                req.told = len(req.outputs)
                req.blocks_told = len(req.block_ids)
            for f in req.prompt.features:
                if f.overlaps(start, end) and f.identifier not in self.encoded:
                    if f.identifier not in self.held:
                        payloads += self._payload_frames(f)
                    control.encoder_inputs.add(item_identifier=f.identifier)
                    self.encoded.add(f.identifier)
            plan.append((req, end, end == len(known)))
        return payloads, control, plan

    def send(self, payloads: list[bytes], control: worker_pb2.StepControl, ranks=None) -> None:
        control_bytes = worker_pb2.StepRequest(control=control).SerializeToString()
        metadata, rest = item_proto.control_byte_breakdown(control, len(control_bytes))
        for index, stream in enumerate(self.streams):
            if ranks is not None and index not in ranks:
                continue
            sent = self.sent_by_rank[index]
            for frame in payloads:
                stream.send(frame)
                sent["payload"] += len(frame)
            stream.send(control_bytes)
            sent["metadata"] += metadata
            sent["control"] += rest

    def step(self, reqs: list[Req], finished: list[str] = ()) -> list[worker_pb2.StepResponse]:
        payloads, control, plan = self.build_step(reqs, finished)
        self.send(payloads, control)
        frames = [s.recv() for s in self.streams]
        self.results.append(frames)
        for frame in frames:
            if frame.WhichOneof("frame") != "step_result":
                raise StepRefused(frame)
        sampled = {t.request_id: t for t in frames[0].step_result.sampled}
        for req, end, produces in plan:
            req.computed = end
            assert (req.rid in sampled) == produces, (req.rid, produces, list(sampled))
            if produces:
                token = sampled[req.rid]
                req.outputs.append(token.token_id)
                req.logprobs.append(token.logprob)
                req.top.append([(t.token_id, t.logprob) for t in token.top_logprobs])
        return frames

    def run(self, reqs: list[Req]) -> None:
        """Steps every unfinished request together until all have their tokens, then tells the ranks."""
        while True:
            active = [r for r in reqs if not r.done]
            if not active:
                break
            self.step(active)
        finished = [r.rid for r in reqs if not r.finished_told]
        if finished:
            self.step([], finished)
            for r in reqs:
                r.finished_told = True


class StepRefused(AssertionError):
    def __init__(self, frame: worker_pb2.StepResponse) -> None:
        super().__init__(f"rank answered {frame}")
        self.frame = frame


# --- an in-process rank --------------------------------------------------------------------------------------


async def _cancel_pending_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class InProcessWorker:
    """A rank (world size 1) served by ``worker_svc.main`` on port 0 in a background event loop."""

    def __init__(self, config) -> None:
        import asyncio

        from worker_svc import main

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.running = self.call(main.start(config))
        self.call(main.load(self.running))
        self.worker = self.running.worker
        self.metrics = self.running.metrics
        self.target = f"127.0.0.1:{self.running.port}"

    def call(self, coro, timeout: float = 120.0):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stream(self, model_dir, token: str | None = RANK_TOKEN, **handshake_kwargs) -> StreamClient:
        return StreamClient(self.target, handshake(model_dir, **handshake_kwargs), token)

    def stop(self) -> None:
        self.call(self.running.server.stop(0))
        self.worker.executor.shutdown(wait=True)
        self.call(_cancel_pending_tasks())  # stream readers left waiting by the stopped server
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def serves_a_request(env, prompt) -> None:
    """A fresh stream to ``env``'s rank admits ``prompt`` and streams its two tokens: the rank still serves."""
    stream = env.rank.stream(env.model_dir)
    sched = MiniScheduler([stream])
    req = sched.add(prompt, "after", max_new_tokens=2)
    sched.run([req])
    stream.close()
    assert len(req.outputs) == 2
