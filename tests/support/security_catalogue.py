"""The bad-input catalogue: every hostile or broken input tried against real processes, as a table.

Each case names what it probes, the status it must get (a gRPC status code, or ``ProtocolError.<CODE>`` for a
step the rank refuses on its stream) and the words the message must contain (the field and the limit). The cases
run in ``tests/security/test_catalogue.py``; ``scripts/security_doc.py`` renders the table into docs/SECURITY.md.

Client-API cases get a ``ClientCtx`` (a scheduler with bearer tokens and small limits, see ``SCHEDULER_LIMITS``)
and raise ``grpc.RpcError``; step-stream cases get a ``StepCtx`` (a standalone ``mmcast-worker`` with a shared
token) and return what the rank answered.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import queue
import struct
import subprocess
import threading
import zlib
from collections.abc import Callable

import grpc
import numpy as np
import torch
from PIL import Image

from benchmarks.http_api import hostile_inputs as hostile
from common import codec, item_proto
from common.hashing import model_fingerprint
from common.multimodal import (
    FRAME_INDICES_FIELD,
    VIDEO_ENCODED_FIELD,
    FieldKind,
    Modality,
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PayloadEncoding,
    PayloadState,
    PlaceholderRange,
)
from mmcast.v1 import generation_pb2 as pb
from mmcast.v1 import multimodal_pb2, tensor_pb2, worker_pb2
from tests.support import hostile_video

# The catalogue scheduler's limits (flags); the expected messages below name them.
# Hosts the catalogue scheduler may fetch image URLs from (--allowed-media-domains): each resolves to, or is, an
# address the SSRF rules refuse (loopback, link-local metadata, private), so every fetch of the catalogue is refused.
MEDIA_DOMAINS = "localhost,127.0.0.1,169.254.169.254,10.0.0.1"
SCHEDULER_LIMITS = {
    "--max-model-len": 1024,
    "--max-images-per-request": 4,
    "--max-upload-bytes": 262144,
    "--max-request-bytes": 1048576,
    "--max-image-pixels": 1000000,
    "--max-tokens-limit": 512,
    "--max-logprobs": 5,
    "--upload-store-bytes": 8 << 20,
    # default --max-prompt-bytes: 1024 x 8 = 8192
    "--max-pending-upload-bytes-per-tenant": 393216,
    "--max-pending-upload-bytes": 524288,
    # videos (--max-upload-bytes bounds a video file too): small enough that every video case is cheap
    "--max-videos-per-request": 2,
    "--max-video-frames": 16,  # sampled
    "--max-video-seconds": 60,
    "--max-video-total-frames": 600,
    "--max-video-frame-pixels": 65536,  # 256 x 256
    "--max-video-streams": 4,
}
# The standalone rank's limits.
WORKER_LIMITS = {
    "--kv-blocks": 64,
    "--max-tensor-bytes": 1 << 20,
    "--payload-cache-bytes": 4 << 20,
    "--encoder-cache-tokens": 4096,
    "--scheduler-id": "catalogue",
}
PATCH_DIM = 1176  # values per pixel_values row of the tiny Qwen2-VL (3 x 2 x 14 x 14)
# The encoded-video limits the catalogue scheduler's handshake carries (its --max-video-* flags).
VIDEO_LIMITS = worker_pb2.VideoDecodeLimits(
    max_bytes=SCHEDULER_LIMITS["--max-upload-bytes"],
    max_frame_pixels=SCHEDULER_LIMITS["--max-video-frame-pixels"],
    max_duration_seconds=SCHEDULER_LIMITS["--max-video-seconds"],
    max_total_frames=SCHEDULER_LIMITS["--max-video-total-frames"],
    max_sampled_frames=SCHEDULER_LIMITS["--max-video-frames"],
    max_streams=SCHEDULER_LIMITS["--max-video-streams"],
)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str  # pytest id; `pytest tests/security/test_catalogue.py -k <id>` reproduces it
    endpoint: str  # "client" (mmcast.v1.GenerationService) or "step" (mmcast.v1.WorkerService/Step)
    area: str  # image, video, upload, prompt, sampling, message, wire, auth, handshake, tensor, step
    what: str  # the input, in a few words
    # expected gRPC status name, ProtocolError.<CODE>, or ITEM_FAILURE (a step the rank serves, reporting the item
    # in StepResult.item_failures: its file is the item's failure, the scheduler's request gets INVALID_ARGUMENT)
    code: str
    mentions: tuple[str, ...]  # words the message must contain (field, limit, flag)
    run: Callable  # (ctx) -> None (raises grpc.RpcError) for client cases; (ctx) -> (code, message) for step cases
    # Work the case must not cause: scheduler counter -> the most it may grow while the case (and the concurrent
    # well-formed request, whose image is cached and whose text is ~100 bytes) runs.
    untouched: tuple[tuple[str, float], ...] = ()
    # Run twice more and check the scheduler's peak RSS (VmHWM) did not grow past the tolerance of the test.
    repeat_peak: bool = False


CASES: list[Case] = []


def case(endpoint: str, area: str, id: str, code: str, *mentions: str, what: str, untouched=(), repeat_peak=False):
    def register(fn):
        CASES.append(Case(id, endpoint, area, what, code, mentions, fn, tuple(untouched), repeat_peak))
        return fn

    return register


# --- inputs -----------------------------------------------------------------------------------------------------


def png(width: int = 64, height: int = 64, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def jpeg(width: int = 64, height: int = 64, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(out, format="JPEG")
    return out.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims ``width`` x ``height`` (a decompression bomb by header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")
    )


GOOD_IMAGE = png(64, 64, seed=7)  # the well-formed request's image (processed once, then cached)


def user(*parts: pb.ContentPart, role: int = pb.ROLE_USER) -> pb.ChatMessage:
    return pb.ChatMessage(role=role, content=list(parts))


def text(s: str) -> pb.ContentPart:
    return pb.ContentPart(text=s)


def image(data: bytes = b"", sha: str | None = None) -> pb.ContentPart:
    return pb.ContentPart(image=pb.ImageInput(uploaded_sha256=sha) if sha is not None else pb.ImageInput(data=data))


def video(data: bytes = b"", **options) -> pb.ContentPart:
    """A video part: the container file's bytes and sampling options (fps, num_frames, min_pixels, ...)."""
    return pb.ContentPart(video=pb.VideoInput(data=data, **options))


def request(*messages: pb.ChatMessage, max_tokens: int = 4, **sampling) -> pb.GenerateRequest:
    msgs = list(messages) or [user(text("Describe it."))]
    return pb.GenerateRequest(messages=msgs, sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling))


def good_request(request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        messages=[user(image(GOOD_IMAGE), text("What is in the picture?"))],
        sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True),
    )


# --- client-API context --------------------------------------------------------------------------------------


class ClientCtx:
    """A plaintext channel to the catalogue scheduler, with the tenant's token."""

    def __init__(
        self, target: str, token: str, grpcurl: str | None, *, other_token: str = "", metrics_url: str = ""
    ) -> None:
        self.target = target
        self.token = token
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.other_metadata = (("authorization", f"Bearer {other_token}"),)  # a second tenant
        self.metrics_url = metrics_url  # the scheduler's /metrics
        self.grpcurl = grpcurl
        big = 16 << 20  # the client may send more than the server accepts: the server's limits are under test
        self.channel = grpc.insecure_channel(
            target, options=[("grpc.max_send_message_length", big), ("grpc.max_receive_message_length", big)]
        )
        self.generate_raw = self.channel.unary_stream(
            "/mmcast.v1.GenerationService/Generate",
            request_serializer=lambda b: b,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        self.upload_raw = self.channel.stream_unary(
            "/mmcast.v1.GenerationService/UploadImage",
            request_serializer=lambda b: b,
            response_deserializer=pb.UploadImageResponse.FromString,
        )

    def generate(self, req: pb.GenerateRequest, metadata=None) -> list[pb.GenerateResponse]:
        return list(
            self.generate_raw(
                req.SerializeToString(), metadata=self.metadata if metadata is None else metadata, timeout=60
            )
        )

    def upload(self, chunks: list[pb.UploadImageRequest]) -> pb.UploadImageResponse:
        return self.upload_raw(iter([c.SerializeToString() for c in chunks]), metadata=self.metadata, timeout=60)

    def close(self) -> None:
        self.channel.close()


def generate(req: pb.GenerateRequest):
    return lambda ctx: ctx.generate(req)


# --- client API: images -------------------------------------------------------------------------------------------

for _id, _data, _code, _mentions, _what in [
    (
        "image-undecodable",
        b"this is not an image" * 10,
        "INVALID_ARGUMENT",
        ("messages[0].content[0].image", "not a decodable image"),
        "image bytes that are not an image",
    ),
    (
        "image-truncated-png",
        png(64, 64, 1)[:300],
        "INVALID_ARGUMENT",
        ("messages[0].content[0].image", "decod"),
        "a PNG cut after 300 bytes",
    ),
    (
        "image-truncated-jpeg",
        jpeg(64, 64, 1)[:400],
        "INVALID_ARGUMENT",
        ("messages[0].content[0].image", "decod"),
        "a JPEG cut after 400 bytes",
    ),
    (
        "image-zero-size",
        png_header_only(0, 64),
        "INVALID_ARGUMENT",
        ("messages[0].content[0].image",),
        "a PNG whose header says 0 x 64 pixels",
    ),
    (
        "image-bomb-header",
        png_header_only(100_000, 100_000),
        "INVALID_ARGUMENT",
        ("messages[0].content[0].image", "10000000000 pixels", "1000000", "--max-image-pixels"),
        "a 200-byte PNG claiming 100000 x 100000 pixels (decompression bomb)",
    ),
    (
        "image-over-pixel-limit",
        png_header_only(2000, 1000),
        "INVALID_ARGUMENT",
        ("messages[0].content[0].image", "2000x1000", "1000000", "--max-image-pixels"),
        "a PNG header of 2000 x 1000 pixels, over --max-image-pixels",
    ),
    (
        "image-extreme-aspect",
        png(1, 400, 2),
        "INVALID_ARGUMENT",
        ("messages[0].content[0].image", "aspect ratio"),
        "a valid 1 x 400 image the processor cannot resize",
    ),
    (
        "image-over-upload-bytes",
        b"\x89PNG" + bytes(300_000),
        "RESOURCE_EXHAUSTED",
        ("messages[0].content[0].image", "262144", "--max-upload-bytes"),
        "300 kB of inline image bytes",
    ),
    (
        "image-empty-data",
        b"",
        "INVALID_ARGUMENT",
        ("messages[0].content[0].image.data", "empty"),
        "an image part with empty data",
    ),
]:
    case("client", "image", _id, _code, *_mentions, what=_what)(generate(request(user(image(_data), text("Look.")))))


@case(
    "client",
    "image",
    "image-no-source",
    "INVALID_ARGUMENT",
    "messages[0].content[0].image",
    "neither data nor uploaded_sha256",
    what="an image part with neither bytes nor a hash",
)
def _(ctx):
    ctx.generate(request(user(pb.ContentPart(image=pb.ImageInput()), text("Look."))))


@case(
    "client",
    "image",
    "too-many-images",
    "INVALID_ARGUMENT",
    "more than 4 images",
    "--max-images-per-request",
    what="5 images where 4 are allowed",
)
def _(ctx):
    ctx.generate(request(user(*[image(png(32, 32, s)) for s in range(5)], text("Count them."))))


@case(
    "client",
    "image",
    "image-unknown-hash",
    "NOT_FOUND",
    "uploaded_sha256",
    "not in the upload store",
    what="a reference to a hash never uploaded",
)
def _(ctx):
    ctx.generate(request(user(image(sha=hashlib.sha256(b"never uploaded").hexdigest()), text("Look."))))


@case(
    "client",
    "image",
    "image-malformed-hash",
    "INVALID_ARGUMENT",
    "uploaded_sha256",
    "64 lowercase hex",
    what="a reference that is not a sha256 hex digest",
)
def _(ctx):
    ctx.generate(request(user(image(sha="ABC../etc/passwd"), text("Look."))))


# --- client API: image formats and what the header says it will cost (checked before any pixel is decoded) -------

NOT_DECODED = (("mmcast_frontend_images_decoded_total", 0), ("mmcast_frontend_decoded_pixels_total", 0))
NOT_TOKENIZED = (("mmcast_frontend_tokenized_bytes_total", 4096),)  # the concurrent request's ~100 bytes only

for _id, _data, _name, _what in [
    (
        "image-format-ico-bomb",
        hostile.ico_bomb,
        "ICO",
        "a 13000 x 13000 image in a 194 kB .ico (Pillow's ICO plugin decodes inside Image.open)",
    ),
    ("image-format-ico", lambda: hostile.ico_around(png(32, 32)), "ICO", "a small .ico"),
    ("image-format-tiff", hostile.tiff, "TIFF", "a 64 x 64 TIFF"),
    ("image-format-psd", hostile.psd_header, "PSD", "a Photoshop header"),
]:
    case(
        "client",
        "image",
        _id,
        "INVALID_ARGUMENT",
        "messages[0].content[0].image",
        f"{_name} images are not accepted",
        "JPEG, PNG, WEBP, GIF, BMP",
        "--image-formats",
        what=_what,
        untouched=NOT_DECODED + NOT_TOKENIZED,
        repeat_peak=True,
    )((lambda make: lambda ctx: ctx.generate(request(user(image(make()), text("Look.")))))(_data))


@case(
    "client",
    "image",
    "image-token-bomb",
    "INVALID_ARGUMENT",
    "messages[0].content[0].image",
    "1000x1000",
    "1296 prompt tokens",
    "context of 1024",
    "--max-model-len",
    untouched=NOT_DECODED + NOT_TOKENIZED,
    repeat_peak=True,
    what="a 5 kB solid 1000 x 1000 PNG (inside --max-image-pixels) that is 1296 tokens",
)
def _(ctx):
    ctx.generate(request(user(image(hostile.solid_png(1000, 1000)), text("Look."))))


@case(
    "client",
    "image",
    "images-tokens-together",
    "INVALID_ARGUMENT",
    "messages[0].content[2].image",
    "324",
    "context of 1024",
    untouched=NOT_DECODED + NOT_TOKENIZED,
    what="three 504 x 504 images of 324 tokens each and max_tokens 100: each fits, together they do not",
)
def _(ctx):
    ctx.generate(
        request(
            user(*[image(hostile.solid_png(504, 504, value=v)) for v in (1, 2, 3)], text("Compare.")), max_tokens=100
        )
    )


@case(
    "client",
    "upload",
    "upload-format-ico-bomb",
    "INVALID_ARGUMENT",
    "upload",
    "ICO images are not accepted",
    "--image-formats",
    untouched=NOT_DECODED,
    repeat_peak=True,
    what="an upload of the ICO bomb",
)
def _(ctx):
    ctx.upload([pb.UploadImageRequest(data=hostile.ico_bomb())])


@case(
    "client",
    "upload",
    "upload-token-bomb",
    "INVALID_ARGUMENT",
    "upload",
    "1296 prompt tokens",
    "1024",
    untouched=NOT_DECODED,
    what="an upload of an image no request could hold (1296 tokens, context 1024)",
)
def _(ctx):
    ctx.upload([pb.UploadImageRequest(data=hostile.solid_png(1000, 1000))])


# --- client API: uploads ----------------------------------------------------------------------------------------


@case("client", "upload", "upload-empty", "INVALID_ARGUMENT", "upload is empty", what="an upload stream with no bytes")
def _(ctx):
    ctx.upload([pb.UploadImageRequest()])


@case(
    "client",
    "upload",
    "upload-over-limit",
    "RESOURCE_EXHAUSTED",
    "262144",
    "--max-upload-bytes",
    what="300 kB uploaded in 64 kB chunks",
)
def _(ctx):
    ctx.upload([pb.UploadImageRequest(data=bytes(65536)) for _ in range(5)])


@case(
    "client",
    "upload",
    "upload-hash-mismatch",
    "INVALID_ARGUMENT",
    "expected_sha256",
    "does not match",
    what="an upload whose expected_sha256 is not the bytes' hash",
)
def _(ctx):
    ctx.upload([pb.UploadImageRequest(data=png(32, 32, 3), expected_sha256="0" * 64)])


@case(
    "client",
    "upload",
    "upload-not-an-image",
    "INVALID_ARGUMENT",
    "upload",
    "not a decodable image",
    what="an upload of bytes that are no image",
)
def _(ctx):
    ctx.upload([pb.UploadImageRequest(data=b"#!/bin/sh\nrm -rf /\n")])


@case(
    "client",
    "upload",
    "upload-bomb-header",
    "INVALID_ARGUMENT",
    "upload",
    "--max-image-pixels",
    what="an upload of a PNG header claiming 100000 x 100000 pixels",
)
def _(ctx):
    ctx.upload([pb.UploadImageRequest(data=png_header_only(100_000, 100_000))])


class StalledUpload:
    """An upload that sends ``size`` bytes and then waits (until ``cancel``) without finishing."""

    def __init__(self, ctx: ClientCtx, size: int, metadata) -> None:
        self._release = threading.Event()

        def chunks():
            yield pb.UploadImageRequest(data=bytes(size)).SerializeToString()
            self._release.wait(60)

        self.future = ctx.upload_raw.future(chunks(), metadata=metadata, timeout=60)

    def cancel(self) -> None:
        self.future.cancel()  # the client goes away: the server must release what it counted
        self._release.set()


def pending_upload_bytes(ctx: ClientCtx) -> float:
    from tests.support.security_support import scrape

    return scrape(ctx.metrics_url)["mmcast_upload_pending_bytes"]


def stalled(ctx: ClientCtx, sizes_and_metadata) -> list[StalledUpload]:
    """Starts the uploads and waits until the server counts all their bytes."""
    from tests.support.security_support import wait_for

    uploads = [StalledUpload(ctx, size, md) for size, md in sizes_and_metadata]
    total = sum(size for size, _ in sizes_and_metadata)
    wait_for(lambda: pending_upload_bytes(ctx) >= total, 20, f"the server counting {total} pending upload bytes")
    return uploads


@case(
    "client",
    "upload",
    "upload-pending-per-tenant",
    "RESOURCE_EXHAUSTED",
    "393216",
    "--max-pending-upload-bytes-per-tenant",
    repeat_peak=True,
    what="a tenant's second unfinished upload while its first holds 250 kB (bound 384 KiB per tenant)",
)
def _(ctx):
    held = stalled(ctx, [(256_000, ctx.metadata)])
    try:
        ctx.upload([pb.UploadImageRequest(data=bytes(65536)) for _ in range(3)])
    finally:
        for u in held:
            u.cancel()


@case(
    "client",
    "upload",
    "upload-pending-total",
    "RESOURCE_EXHAUSTED",
    "524288",
    "--max-pending-upload-bytes",
    what="an upload while two tenants' unfinished uploads hold 512 kB together (bound 512 KiB in all)",
)
def _(ctx):
    held = stalled(ctx, [(256_000, ctx.metadata), (256_000, ctx.other_metadata)])
    try:
        ctx.upload_raw(
            iter([pb.UploadImageRequest(data=bytes(20_000)).SerializeToString()]),
            metadata=ctx.other_metadata,
            timeout=60,
        )
    finally:
        for u in held:
            u.cancel()


# --- client API: videos ---------------------------------------------------------------------------------------
# The scheduler reads a video's container header only (common/video_input.py); under the default encoded payload the
# owner rank decodes the sampled frames. Files: tests/support/hostile_video.py.

VIDEO = "messages[0].content[0].video"
VIDEO_NOT_DECODED = (("mmcast_frontend_videos_decoded_total", 0), ("mmcast_frontend_decoded_video_frames_total", 0))
FORMATS = "mov, mp4, matroska, webm, avi"


def video_request(data: bytes, **options) -> pb.GenerateRequest:
    return request(user(video(data, **options), text("What happens?")))


def then_a_good_video(make: Callable[[], bytes]):
    """A case whose file only the owner rank finds bad (it decodes the frames): the request fails with the item's
    error; then a well-formed video on the same rank is served, and the case raises the first error."""

    def run(ctx: ClientCtx):
        try:
            ctx.generate(video_request(make()))
        except grpc.RpcError as exc:
            first = exc
        else:
            raise AssertionError("the bad video was served")
        final = ctx.generate(video_request(hostile_video.good()))[-1].final
        assert final.usage.completion_tokens >= 1, final
        raise first

    return run


for _id, _make, _mentions, _what, _kwargs in [
    (
        "video-truncated",
        lambda: hostile_video.truncated(),
        ("not a readable video container", FORMATS),
        "an H.264 MP4 cut in half: its index (moov, at the end) is gone",
        {"untouched": VIDEO_NOT_DECODED + NOT_TOKENIZED},
    ),
    (
        "video-header-16k",
        lambda: hostile_video.h264_claiming(16000, 16000),
        ("16000x16000 = 256000000 pixels", "65536 (--max-video-frame-pixels)"),
        "a 1.6 kB H.264 MP4 whose SPS, stsd and tkhd claim 16000 x 16000 frames (FFmpeg's probing would allocate "
        "~670 MB for them): refused on the header, nothing decoded",
        {"untouched": VIDEO_NOT_DECODED + NOT_TOKENIZED, "repeat_peak": True},
    ),
    (
        "video-header-16384",
        lambda: hostile_video.h264_claiming(16384, 16384),
        ("frame size could not be read (0x0", "65536 (--max-video-frame-pixels)"),
        "an SPS claiming 16384 x 16384, past FFmpeg's own bound (its parser drops the size)",
        {"untouched": VIDEO_NOT_DECODED + NOT_TOKENIZED},
    ),
    (
        "video-header-10-hours",
        lambda: hostile_video.ten_hours(),
        ("lasts 36000.0 s", "60.0 (--max-video-seconds)"),
        "36 frames one every 1000 s: a 10-hour video in 2 kB",
        {"untouched": VIDEO_NOT_DECODED + NOT_TOKENIZED},
    ),
    (
        "video-frames-over-total",
        lambda: hostile_video.good(frames=700, width=16, height=16, fps=100),
        ("700 frames", "600 (--max-video-total-frames)"),
        "a 16 x 16 video of 700 frames at 100 fps (its header's count)",
        {"untouched": VIDEO_NOT_DECODED + NOT_TOKENIZED},
    ),
    (
        "video-streams-500-decoders",
        lambda: hostile_video.many_tracks(500, decoders=True),
        ("more streams than the limit", "4 (--max-video-streams)"),
        "an MP4 of 501 H.264 tracks in 248 kB (FFmpeg's probing would open a decoder for each: 157 MB)",
        {"untouched": VIDEO_NOT_DECODED + NOT_TOKENIZED, "repeat_peak": True},
    ),
    (
        "video-streams-2500",
        lambda: hostile_video.many_tracks(2500),
        ("more streams than the limit", "4 (--max-video-streams)"),
        "an MP4 of 2501 tracks (100-byte trak boxes) in 250 kB",
        {"untouched": VIDEO_NOT_DECODED + NOT_TOKENIZED},
    ),
    (
        "video-codec-not-allowed",
        lambda: hostile_video.other_codec("mpeg2video"),
        ("codec 'mpeg2video' is not accepted", "h264, hevc, vp8, vp9, av1, mpeg4, mjpeg"),
        "MPEG-2 video in Matroska (a codec PyAV encodes, outside the accepted decoders)",
        {"untouched": VIDEO_NOT_DECODED + NOT_TOKENIZED},
    ),
    (
        "video-audio-only",
        lambda: hostile_video.audio_only(),
        ("no video stream", "audio"),
        "an MP4 of AAC audio alone",
        {"untouched": VIDEO_NOT_DECODED + NOT_TOKENIZED},
    ),
    (
        "video-is-an-image",
        lambda: png(64, 64, 4),
        ("not a readable video container", FORMATS, "PNG image", "image part"),
        "a PNG sent as a video",
        {"untouched": VIDEO_NOT_DECODED + NOT_TOKENIZED},
    ),
]:
    case("client", "video", _id, "INVALID_ARGUMENT", VIDEO, *_mentions, what=_what, **_kwargs)(
        (lambda make: lambda ctx: ctx.generate(video_request(make())))(_make)
    )

for _id, _make, _mentions, _what in [
    (
        "video-corrupt-packets",
        lambda: hostile_video.corrupt_packets(),
        ("could not be used", "could not be decoded"),
        "an MP4 whose index is intact and whose every sample is noise: only the owner rank finds it, decoding",
    ),
    (
        "video-header-lies-frame-count",
        lambda: hostile_video.fewer_frames_than_header(),
        ("fewer frames than its header gives (20)", "frame 15", "the header lies"),
        "a faststart MP4 whose index counts 20 frames, cut after 12 (sampled: 0, 5, 10, 15)",
    ),
    (
        "video-header-lies-frame-size",
        lambda: hostile_video.frames_change_size(),
        ("frame 10 decodes to 96x64", "64x48", "the header lies"),
        "a Motion-JPEG AVI whose header and first 10 frames say 64 x 48 and whose last 10 frames are 96 x 64",
    ),
]:
    case("client", "video", _id, "INVALID_ARGUMENT", VIDEO, *_mentions, what=_what + "; the rank then serves a video")(
        then_a_good_video(_make)
    )

for _id, _options, _mentions, _what in [
    ("video-fps-out-of-range", {"fps": 1000.0}, (f"{VIDEO}.fps=1000.0", "(0, 60]"), "fps 1000"),
    (
        "video-num-frames-over-limit",
        {"num_frames": 1000},
        ("num_frames=1000 asks for 1000 sampled frames", "16 (--max-video-frames)"),
        "num_frames 1000 (of a 20-frame video)",
    ),
    ("video-num-frames-zero", {"num_frames": 0}, (f"{VIDEO}.num_frames=0", ">= 1"), "num_frames 0"),
    ("video-fps-and-num-frames", {"fps": 2.0, "num_frames": 4}, ("fps and num_frames are exclusive",), "both"),
    (
        "video-min-over-max-pixels",
        {"min_pixels": 9000, "max_pixels": 8000},
        ("min_pixels=9000 exceeds max_pixels=8000",),
        "min_pixels 9000 > max_pixels 8000",
    ),
]:
    case("client", "video", _id, "INVALID_ARGUMENT", VIDEO, *_mentions, what=_what, untouched=NOT_TOKENIZED)(
        (lambda o: lambda ctx: ctx.generate(video_request(hostile_video.good(), **o)))(_options)
    )


@case(
    "client",
    "video",
    "image-is-a-video",
    "INVALID_ARGUMENT",
    "messages[0].content[0].image",
    "not a decodable image",
    "MP4 video",
    "video part",
    untouched=NOT_DECODED + NOT_TOKENIZED,
    what="an MP4 sent as an image",
)
def _(ctx):
    ctx.generate(request(user(image(hostile_video.good()), text("Look."))))


@case(
    "client",
    "video",
    "too-many-videos",
    "INVALID_ARGUMENT",
    "messages[0].content[2].video",
    "more than 2 videos",
    "--max-videos-per-request",
    untouched=VIDEO_NOT_DECODED + NOT_TOKENIZED,
    what="3 videos where 2 are allowed",
)
def _(ctx):
    clip = hostile_video.good()
    ctx.generate(request(user(*[video(clip, num_frames=2 * k) for k in (1, 2, 3)], text("Compare."))))


@case(
    "client",
    "video",
    "video-over-upload-bytes",
    "RESOURCE_EXHAUSTED",
    VIDEO,
    "video has 300000 bytes",
    "262144",
    "--max-upload-bytes",
    what="300 kB of inline video bytes",
)
def _(ctx):
    ctx.generate(video_request(hostile_video.good() + bytes(300_000 - len(hostile_video.good()))))


@case(
    "client",
    "upload",
    "upload-neither-image-nor-video",
    "INVALID_ARGUMENT",
    "upload",
    "neither an image",
    "nor a video",
    untouched=NOT_DECODED + VIDEO_NOT_DECODED,
    what="an upload of bytes that are no image and no video",
)
def _(ctx):
    ctx.upload([pb.UploadImageRequest(data=bytes(range(256)) * 40)])


@case(
    "client",
    "upload",
    "upload-video-header-16k",
    "INVALID_ARGUMENT",
    "upload",
    "nor a video",
    "16000x16000",
    "--max-video-frame-pixels",
    untouched=NOT_DECODED + VIDEO_NOT_DECODED,
    repeat_peak=True,
    what="an upload of the 16000 x 16000 H.264 header",
)
def _(ctx):
    ctx.upload([pb.UploadImageRequest(data=hostile_video.h264_claiming(16000, 16000))])


# --- client API: prompt and context ----------------------------------------------------------------------------

LONG_TEXT = "the quick brown fox jumps over the lazy dog " * 150  # ~1400 tokens (6.6 kB, under the 8192-byte bound)


@case(
    "client",
    "prompt",
    "prompt-over-byte-bound",
    "INVALID_ARGUMENT",
    "messages[0].content[0].text",
    "8192",
    "--max-prompt-bytes",
    untouched=NOT_TOKENIZED,
    repeat_peak=True,
    what="900 kB of text (the limit: the 1024-token context x 8 bytes), refused before tokenizing",
)
def _(ctx):
    ctx.generate(request(user(text("漢字 and text " * 60_000))))


@case("client", "prompt", "messages-empty", "INVALID_ARGUMENT", "messages is empty", what="no messages at all")
def _(ctx):
    ctx.generate(pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4)))


@case(
    "client",
    "prompt",
    "prompt-whitespace",
    "INVALID_ARGUMENT",
    "the prompt is empty",
    what="messages holding only whitespace",
)
def _(ctx):
    ctx.generate(request(user(text("   \n\t "))))


@case(
    "client",
    "prompt",
    "prompt-over-context",
    "INVALID_ARGUMENT",
    "tokens",
    "1024",
    "--max-model-len",
    what="a prompt of thousands of tokens, over the 1024-token context",
)
def _(ctx):
    ctx.generate(request(user(text(LONG_TEXT))))


@case(
    "client",
    "prompt",
    "prompt-plus-max-tokens-over-context",
    "INVALID_ARGUMENT",
    "sampling.max_tokens=500",
    "500 to generate",
    "context of 1024",
    what="a 700-token prompt with max_tokens 500",
)
def _(ctx):
    ctx.generate(request(user(text("the quick brown fox jumps over the lazy dog " * 36)), max_tokens=500))


@case(
    "client",
    "prompt",
    "prompt-placeholder-token",
    "INVALID_ARGUMENT",
    "messages[0].content[0].text",
    "placeholder token",
    what="text smuggling the image placeholder token <|image_pad|>",
)
def _(ctx):
    ctx.generate(request(user(text("fake image: <|image_pad|><|image_pad|>"))))


@case(
    "client",
    "message",
    "request-over-max-bytes",
    "RESOURCE_EXHAUSTED",
    "1048576",
    what="a 1.5 MB serialized request, over --max-request-bytes (the gRPC receive limit)",
)
def _(ctx):
    ctx.generate(request(user(text("x" * 1_500_000))))


# --- client API: sampling -----------------------------------------------------------------------------------------

for _id, _kwargs, _mentions, _what in [
    ("max-tokens-zero", {"max_tokens": 0}, ("sampling.max_tokens", ">= 1"), "max_tokens 0"),
    (
        "max-tokens-over-limit",
        {"max_tokens": 100_000},
        ("sampling.max_tokens=100000", "512", "--max-tokens-limit"),
        "max_tokens 100000",
    ),
    ("temperature-negative", {"temperature": -1.0}, ("sampling.temperature=-1.0", "[0, 2]"), "temperature -1"),
    ("temperature-nan", {"temperature": float("nan")}, ("sampling.temperature=nan", "[0, 2]"), "temperature NaN"),
    ("temperature-infinite", {"temperature": float("inf")}, ("sampling.temperature=inf", "[0, 2]"), "temperature +inf"),
    ("top-p-zero", {"top_p": 0.0}, ("sampling.top_p=0.0", "(0, 1]"), "top_p 0"),
    ("top-p-over-one", {"top_p": 1.5}, ("sampling.top_p=1.5", "(0, 1]"), "top_p 1.5"),
    ("logprobs-over-limit", {"logprobs": 6}, ("sampling.logprobs=6", "5", "--max-logprobs"), "logprobs 6"),
    ("stop-too-many", {"stop": ["s"] * 17}, ("sampling.stop", "17", "16"), "17 stop strings"),
    ("stop-too-long", {"stop": ["z" * 300]}, ("sampling.stop[0]", "300", "256"), "a 300-character stop string"),
    ("stop-empty-string", {"stop": [""]}, ("sampling.stop[0]", "empty"), "an empty stop string"),
    (
        "stop-token-outside-vocab",
        {"stop_token_ids": [1 << 30]},
        ("sampling.stop_token_ids[0]", "vocabulary"),
        "a stop token id outside the vocabulary",
    ),
]:
    _max = _kwargs.pop("max_tokens", 4)
    case("client", "sampling", _id, "INVALID_ARGUMENT", *_mentions, what=_what)(
        generate(request(max_tokens=_max, **_kwargs))
    )


# --- client API: roles, content, ids ----------------------------------------------------------------------------

for _id, _msg, _mentions, _what in [
    (
        "role-unspecified",
        user(text("hi"), role=pb.ROLE_UNSPECIFIED),
        ("messages[0].role=0", "not a known role"),
        "a message with ROLE_UNSPECIFIED",
    ),
    (
        "role-unknown-value",
        user(text("hi"), role=42),
        ("messages[0].role=42", "not a known role"),
        "a message with role 42 (no such enum value)",
    ),
    (
        "content-part-empty",
        user(pb.ContentPart(), text("hi")),
        ("messages[0].content[0]", "no text, image or video"),
        "a content part with neither text, image nor video",
    ),
]:
    case("client", "message", _id, "INVALID_ARGUMENT", *_mentions, what=_what)(generate(request(_msg)))

for _id, _req, _mentions, _what in [
    (
        "request-id-too-long",
        pb.GenerateRequest(request_id="r" * 200),
        ("request_id", "200", "128"),
        "a 200-character request_id",
    ),
    (
        "request-id-bad-characters",
        pb.GenerateRequest(request_id="../../etc\n"),
        ("request_id", "only"),
        "a request_id with a newline and slashes",
    ),
    (
        "cache-salt-too-long",
        pb.GenerateRequest(cache_salt="s" * 300),
        ("cache_salt", "300", "256"),
        "a 300-character cache_salt",
    ),
]:
    _req.messages.append(user(text("hi")))
    _req.sampling.max_tokens = 4
    case("client", "message", _id, "INVALID_ARGUMENT", *_mentions, what=_what)(generate(_req))


@case(
    "client",
    "message",
    "request-id-duplicate",
    "ALREADY_EXISTS",
    "already in flight",
    what="a request_id equal to one still streaming",
)
def _(ctx):
    first = ctx.generate_raw(
        pb.GenerateRequest(
            request_id="dup-1",
            messages=[user(text("Tell a long story."))],
            sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True),
        ).SerializeToString(),
        metadata=ctx.metadata,
        timeout=60,
    )
    try:
        next(first)  # in flight: its first tokens arrived
        ctx.generate(
            pb.GenerateRequest(
                request_id="dup-1", messages=[user(text("hi"))], sampling=pb.SamplingParams(max_tokens=4)
            )
        )
    finally:
        first.cancel()


# --- client API: bytes that are not the message --------------------------------------------------------------


@case(
    "client",
    "wire",
    "protobuf-garbage",
    "INVALID_ARGUMENT",
    "mmcast.v1.GenerateRequest",
    "not a valid",
    what="Generate with bytes that are not protobuf (identity serializer)",
)
def _(ctx):
    list(ctx.generate_raw(b"\xff\xff\xff\xff\x0fgarbage", metadata=ctx.metadata, timeout=30))


@case(
    "client",
    "wire",
    "protobuf-truncated",
    "INVALID_ARGUMENT",
    "mmcast.v1.GenerateRequest",
    "not a valid",
    what="a valid GenerateRequest cut in the middle of a field",
)
def _(ctx):
    raw = request(user(text("a prompt long enough to cut"))).SerializeToString()
    list(ctx.generate_raw(raw[: len(raw) // 2], metadata=ctx.metadata, timeout=30))


@case(
    "client",
    "wire",
    "protobuf-invalid-utf8",
    "INVALID_ARGUMENT",
    "mmcast.v1.GenerateRequest",
    "not a valid",
    what="a request_id string field holding invalid UTF-8",
)
def _(ctx):
    list(ctx.generate_raw(b"\x0a\x04\xff\xfe\xfd\xfc", metadata=ctx.metadata, timeout=30))


@case(
    "client",
    "wire",
    "upload-garbage-chunk",
    "INVALID_ARGUMENT",
    "mmcast.v1.UploadImageRequest",
    "not a valid",
    what="UploadImage with a chunk that is not protobuf",
)
def _(ctx):
    ctx.upload_raw(iter([b"\xff\xff\xff"]), metadata=ctx.metadata, timeout=30)


@case("client", "wire", "unknown-method", "UNIMPLEMENTED", what="a method the service does not have")
def _(ctx):
    ctx.channel.unary_unary("/mmcast.v1.GenerationService/Shutdown")(b"", metadata=ctx.metadata, timeout=30)


@case(
    "client",
    "wire",
    "grpcurl-bad-enum-json",
    "INVALID_ARGUMENT",
    "messages[0].role=0",
    what="grpcurl (schema from reflection) sending ROLE_UNSPECIFIED",
)
def _(ctx):
    body = '{"messages": [{"role": "ROLE_UNSPECIFIED", "content": [{"text": "hi"}]}], "sampling": {"maxTokens": 4}}'
    proc = subprocess.run(
        [
            ctx.grpcurl,
            "-plaintext",
            "-max-time",
            "30",
            "-H",
            f"authorization: Bearer {ctx.token}",
            "-d",
            body,
            ctx.target,
            "mmcast.v1.GenerationService/Generate",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    raise GrpcurlError(proc.stderr + proc.stdout)


# --- client API: authentication ------------------------------------------------------------------------------


@case(
    "client",
    "auth",
    "token-missing",
    "UNAUTHENTICATED",
    "authorization",
    "Bearer",
    what="a call without authorization metadata",
)
def _(ctx):
    ctx.generate(good_request(), metadata=())


@case("client", "auth", "token-wrong", "UNAUTHENTICATED", "not valid", what="a bearer token nobody was given")
def _(ctx):
    ctx.generate(good_request(), metadata=(("authorization", "Bearer " + "x" * 32),))


@case("client", "auth", "token-wrong-scheme", "UNAUTHENTICATED", "Bearer", what="'authorization: Basic ...'")
def _(ctx):
    ctx.generate(good_request(), metadata=(("authorization", "Basic dXNlcjpwYXNz"),))


@case("client", "auth", "token-twice", "UNAUTHENTICATED", "more than one", what="two authorization entries")
def _(ctx):
    ctx.generate(good_request(), metadata=ctx.metadata + (("authorization", "Bearer " + "y" * 32),))


@case("client", "auth", "upload-without-token", "UNAUTHENTICATED", "authorization", what="UploadImage without a token")
def _(ctx):
    ctx.upload_raw(iter([pb.UploadImageRequest(data=GOOD_IMAGE).SerializeToString()]), metadata=(), timeout=30)


class GrpcurlError(grpc.RpcError):
    """grpcurl's printed status as an RpcError ('ERROR:\\n  Code: InvalidArgument\\n  Message: ...')."""

    _CODES = {c.name.replace("_", "").lower(): c for c in grpc.StatusCode}

    def __init__(self, output: str) -> None:
        super().__init__(output)
        self.output = output

    def code(self) -> grpc.StatusCode:
        for line in self.output.splitlines():
            if line.strip().startswith("Code:"):
                return self._CODES[line.split(":", 1)[1].strip().lower()]
        return grpc.StatusCode.OK

    def details(self) -> str:
        for line in self.output.splitlines():
            if line.strip().startswith("Message:"):
                return line.split(":", 1)[1].strip()
        return self.output


# --- step stream context ---------------------------------------------------------------------------------------


class Stream:
    """One Step stream to a rank: raw frames out, StepResponse messages in (metadata carries the shared token)."""

    def __init__(self, target: str, metadata) -> None:
        self.channel = grpc.insecure_channel(
            target, options=[("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        )
        self._queue: queue.Queue = queue.Queue()
        call = self.channel.stream_stream(
            "/mmcast.v1.WorkerService/Step",
            request_serializer=lambda b: b,
            response_deserializer=worker_pb2.StepResponse.FromString,
        )
        self._responses = call(iter(self._queue.get, None), metadata=metadata)

    def send(self, *frames) -> Stream:
        for frame in frames:
            self._queue.put(frame if isinstance(frame, bytes) else frame.SerializeToString())
        return self

    def answer(self, timeout: float = 30.0) -> tuple[str, str, worker_pb2.StepResponse | None]:
        """(code, message, frame): ``ProtocolError.<CODE>``, a gRPC status name, or ``OK`` with the frame."""
        box: list = []

        def read():
            try:
                box.append(next(self._responses))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box.append(exc)

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        thread.join(timeout)
        if not box:
            raise TimeoutError(f"no answer from the rank within {timeout} s")
        got = box[0]
        if isinstance(got, grpc.RpcError):
            return got.code().name, got.details() or "", None
        if isinstance(got, StopIteration):
            return "EOF", "", None
        if isinstance(got, BaseException):
            raise got
        if got.WhichOneof("frame") == "error":
            return (
                "ProtocolError."
                + worker_pb2.ProtocolErrorCode.Name(got.error.code).removeprefix("PROTOCOL_ERROR_CODE_"),
                got.error.message,
                got,
            )
        return "OK", "", got

    def close(self) -> None:
        self._queue.put(None)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass
        self.channel.close()


class StepCtx:
    """A standalone rank: its address, token and model fingerprint; opens streams and builds frames."""

    def __init__(self, target: str, token: str, model_dir, vocab_size: int, epochs) -> None:
        self.target = target
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.fingerprint = model_fingerprint(model_dir)
        self.vocab_size = vocab_size
        self.epochs = epochs  # callable: the next (increasing) epoch
        self.streams: list[Stream] = []

    def handshake(self, **overrides) -> worker_pb2.StepRequest:
        hs = worker_pb2.Handshake(
            protocol_version=item_proto.PROTOCOL_VERSION,
            model_fingerprint=self.fingerprint,
            rank=0,
            world_size=1,
            scheduler_epoch=self.epochs(),
            scheduler_id=WORKER_LIMITS["--scheduler-id"],
            block_size=16,
            video_limits=VIDEO_LIMITS,  # as the catalogue scheduler sends them: the rank takes encoded videos
        )
        for key, value in overrides.items():
            if value is None:
                hs.ClearField(key)
            else:
                setattr(hs, key, value)
        return worker_pb2.StepRequest(handshake=hs)

    def stream(self, metadata=None) -> Stream:
        s = Stream(self.target, self.metadata if metadata is None else metadata)
        self.streams.append(s)
        return s

    def open(self, **overrides) -> Stream:
        """A stream whose handshake the rank accepted."""
        s = self.stream().send(self.handshake(**overrides))
        code, message, _ = s.answer()
        assert code == "OK", f"handshake refused: {code} {message}"
        return s

    def close_all(self) -> None:
        while self.streams:
            self.streams.pop().close()


def control(step_id: int = 1, **fields) -> worker_pb2.StepRequest:
    return worker_pb2.StepRequest(control=worker_pb2.StepControl(step_id=step_id, **fields))


def text_request(rid: str = "r", n: int = 8, **overrides) -> worker_pb2.NewRequest:
    msg = worker_pb2.NewRequest(
        request_id=rid,
        prompt_token_ids=[5] * n,
        block_ids=[0],
        num_scheduled_tokens=n,
        sampling=worker_pb2.WorkerSampling(),
    )
    for key, value in overrides.items():
        if isinstance(value, list):
            del getattr(msg, key)[:]
            getattr(msg, key).extend(value)
        elif hasattr(value, "CopyFrom"):
            getattr(msg, key).CopyFrom(value)
        else:
            setattr(msg, key, value)
    return msg


def image_item(
    ident: str = "img-1",
    rows: int = 4,
    grid=(1, 2, 2),
    offset: int = 2,
    length: int = 1,
    state=multimodal_pb2.PAYLOAD_STATE_DEFERRED,
) -> multimodal_pb2.MultiModalItem:
    grid_header, _ = codec.encode_tensor(torch.tensor([list(grid)], dtype=torch.int64), inline=True)
    item = multimodal_pb2.MultiModalItem(
        identifier=ident,
        modality=multimodal_pb2.MODALITY_IMAGE,
        position=multimodal_pb2.PlaceholderRange(offset=offset, length=length),
        payload_state=state,
    )
    item.fields.add(name="image_grid_thw", kind=multimodal_pb2.FIELD_KIND_BATCHED, keep_on_cpu=True, tensor=grid_header)
    item.fields.add(
        name="pixel_values",
        kind=multimodal_pb2.FIELD_KIND_FLAT,
        tensor=tensor_pb2.TensorHeader(
            dtype=tensor_pb2.DTYPE_FLOAT32, shape=[rows, PATCH_DIM], byte_size=rows * PATCH_DIM * 4
        ),
    )
    return item


def payload(ident: str = "img-1", rows: int = 4, chunk_size: int = 4096) -> list[bytes]:
    tensor = torch.randn((rows, PATCH_DIM), generator=torch.Generator().manual_seed(1))
    return codec.payload_frames(ident, "pixel_values", tensor, chunk_size=chunk_size)


def payload_frame(ident="img-1", header=None, index=None, data=b"", field="pixel_values") -> worker_pb2.StepRequest:
    frame = worker_pb2.PayloadFrame(item_identifier=ident, field_name=field)
    if header is not None:
        frame.header.CopyFrom(header)
    if index is not None:
        frame.chunk.index, frame.chunk.data = index, data
    return worker_pb2.StepRequest(payload=frame)


def header(dtype=tensor_pb2.DTYPE_FLOAT32, shape=(4, PATCH_DIM), byte_size=None, chunk_size=4096, num_chunks=None):
    size = byte_size if byte_size is not None else 4 * int(np.prod(shape))
    chunks = num_chunks if num_chunks is not None else -(-size // chunk_size)
    return tensor_pb2.TensorHeader(
        dtype=dtype, shape=list(shape), byte_size=size, chunk_size=chunk_size, num_chunks=chunks
    )


def with_image_step(frames: list, **item_kwargs) -> list:
    """``frames`` (payload frames) then a control admitting a request with one image whose encoder work is due."""
    item = image_item(**item_kwargs)
    req = text_request(n=8)
    req.mm_items.append(item)
    return [
        *frames,
        control(new_requests=[req], encoder_inputs=[worker_pb2.EncoderInput(item_identifier=item.identifier)]),
    ]


def refused_handshake(**overrides):
    def run(ctx: StepCtx):
        return ctx.stream().send(ctx.handshake(**overrides)).answer()[:2]

    return run


def after_handshake(frames_of: Callable):
    """A case that opens an accepted stream, sends ``frames_of(ctx)`` and returns the rank's answer."""

    def run(ctx: StepCtx):
        s = ctx.open()
        return s.send(*frames_of(ctx)).answer()[:2]

    return run


# --- step stream: who may open one ------------------------------------------------------------------------------


@case("step", "auth", "step-token-missing", "UNAUTHENTICATED", "authorization", what="a Step stream without a token")
def _(ctx):
    return ctx.stream(metadata=()).send(ctx.handshake()).answer()[:2]


@case("step", "auth", "step-token-wrong", "UNAUTHENTICATED", "not valid", what="a Step stream with a wrong token")
def _(ctx):
    return ctx.stream(metadata=(("authorization", "Bearer " + "z" * 32),)).send(ctx.handshake()).answer()[:2]


@case(
    "step",
    "auth",
    "step-no-token-max-epoch",
    "UNAUTHENTICATED",
    "authorization",
    what="no token and scheduler_epoch 2^64-1 (would lock the real scheduler out)",
)
def _(ctx):
    return ctx.stream(metadata=()).send(ctx.handshake(scheduler_epoch=(1 << 64) - 1)).answer()[:2]


for _id, _overrides, _mentions, _what in [
    (
        "handshake-wrong-fingerprint",
        {"model_fingerprint": "0" * 64},
        ("handshake.model_fingerprint",),
        "another model's fingerprint",
    ),
    ("handshake-wrong-rank", {"rank": 3}, ("handshake.rank=3", "rank=0"), "rank 3 at rank 0's address"),
    (
        "handshake-wrong-protocol-version",
        {"protocol_version": 7},
        ("handshake.protocol_version=7",),
        "protocol version 7",
    ),
    ("handshake-wrong-world-size", {"world_size": 4}, ("handshake.world_size=4", "world_size=1"), "world size 4"),
    ("handshake-wrong-block-size", {"block_size": 32}, ("handshake.block_size=32", "block_size=16"), "block size 32"),
    (
        "handshake-wrong-scheduler-id",
        {"scheduler_id": "intruder"},
        ("handshake.scheduler_id='intruder'",),
        "a scheduler id the rank is not configured for",
    ),
]:
    case("step", "handshake", _id, "FAILED_PRECONDITION", *_mentions, what=_what)(refused_handshake(**_overrides))


@case(
    "step",
    "handshake",
    "handshake-stale-epoch",
    "FAILED_PRECONDITION",
    "scheduler_epoch",
    "older than epoch",
    what="an epoch below one the rank already accepted (a stale scheduler)",
)
def _(ctx):
    newer = ctx.epochs()
    ctx.open(scheduler_epoch=newer).close()
    return ctx.stream().send(ctx.handshake(scheduler_epoch=newer - 1)).answer()[:2]


@case(
    "step",
    "handshake",
    "handshake-same-epoch-while-active",
    "FAILED_PRECONDITION",
    "not newer than the active",
    what="a second stream with the active stream's epoch",
)
def _(ctx):
    epoch = ctx.epochs()
    ctx.open(scheduler_epoch=epoch)
    return ctx.stream().send(ctx.handshake(scheduler_epoch=epoch)).answer()[:2]


@case(
    "step",
    "handshake",
    "first-frame-not-handshake",
    "FAILED_PRECONDITION",
    "first frame",
    "handshake",
    what="a stream that starts with a step control",
)
def _(ctx):
    return ctx.stream().send(control()).answer()[:2]


@case(
    "step",
    "handshake",
    "second-handshake",
    "FAILED_PRECONDITION",
    "unexpected handshake",
    what="a handshake on an already open stream",
)
def _(ctx):
    return ctx.open().send(ctx.handshake()).answer()[:2]


@case(
    "step",
    "wire",
    "step-frame-garbage",
    "INVALID_ARGUMENT",
    "mmcast.v1.StepRequest",
    "not a valid",
    what="bytes that are not a StepRequest after the handshake",
)
def _(ctx):
    return ctx.open().send(b"\xff\xff\xff\xff\x0f").answer()[:2]


# --- step stream: tensors ---------------------------------------------------------------------------------------

_TENSOR_CASES = [
    (
        "chunks-out-of-order",
        lambda c: with_image_step(payload()[:1] + payload()[2:3] + payload()[1:2] + payload()[3:]),
        ("chunk 2 out of order", "expected chunk 1"),
        "chunk 2 before chunk 1",
    ),
    (
        "chunk-missing",
        lambda c: with_image_step(payload()[:-1]),
        ("missing chunks",),
        "the control arrives before the last chunk",
    ),
    (
        "chunk-extra",
        lambda c: with_image_step(payload() + [payload_frame(index=5, data=bytes(16))]),
        ("chunk without a preceding header",),
        "a chunk after the tensor was complete",
    ),
    (
        "chunk-wrong-size",
        lambda c: with_image_step([payload_frame(header=header(), index=0, data=bytes(100))]),
        ("chunk 0 has 100 bytes", "expected 4096"),
        "a chunk shorter than the announced chunk size",
    ),
    (
        "header-size-disagrees",
        lambda c: with_image_step([payload_frame(header=header(byte_size=1000))]),
        ("byte_size 1000", "18816"),
        "a header whose byte_size is not dtype x shape",
    ),
    (
        "header-unknown-dtype",
        lambda c: with_image_step([payload_frame(header=header(dtype=42))]),
        ("unknown dtype 42",),
        "a header with dtype 42",
    ),
    (
        "header-negative-dimension",
        lambda c: with_image_step([payload_frame(header=header(shape=(-4, PATCH_DIM), byte_size=0))]),
        ("negative dimension",),
        "a header with a dimension of -4",
    ),
    (
        "header-giant-empty-shape",
        lambda c: with_image_step([payload_frame(header=header(shape=(0, 2, 2**62), byte_size=0))]),
        ("zero dimensions counted as 1", "max_tensor_bytes"),
        "shape (0, 2, 2^62): empty, but strides would overflow",
    ),
    (
        "header-too-many-dims",
        lambda c: with_image_step([payload_frame(header=header(shape=(1,) * 40, byte_size=4))]),
        ("40 dimensions", "16"),
        "a 40-dimensional tensor",
    ),
    (
        "tensor-over-limit",
        lambda c: with_image_step([payload_frame(header=header(shape=(1024, PATCH_DIM)))]),
        ("exceeds the limit of 1048576", "max_tensor_bytes"),
        "a 4.8 MB tensor, over --max-tensor-bytes 1 MiB",
    ),
    (
        "payload-flood",
        lambda c: with_image_step([f for i in range(5) for f in payload(f"flood-{i}", rows=200, chunk_size=1 << 20)]),
        ("payload cache budget of 4194304", "--payload-cache-bytes"),
        "5 x 0.9 MB of payload frames before any control, over --payload-cache-bytes 4 MiB",
    ),
    (
        "payload-empty-identifier",
        lambda c: with_image_step([payload_frame(ident="", header=header())]),
        ("item_identifier and field_name",),
        "a payload frame without an item identifier",
    ),
    (
        "payload-never-sent",
        lambda c: with_image_step([]),
        ("encoder_inputs", "pixel_values", "does not hold"),
        "encoder work on an item whose payload never arrived",
    ),
    (
        "payload-rows-disagree-with-grid",
        lambda c: with_image_step(payload(rows=8), rows=8),
        ("pixel_values has 8 patch rows", "needs 4"),
        "8 patch rows for a 1 x 2 x 2 grid",
    ),
    (
        "payload-wrong-shape",
        lambda c: with_image_step(payload(rows=4), rows=6),
        ("payload is", "metadata announces"),
        "a payload whose shape differs from the item's metadata",
    ),
]
for _id, _frames, _mentions, _what in _TENSOR_CASES:
    _code = "ProtocolError.MISSING_PAYLOAD" if _id == "payload-never-sent" else "ProtocolError.BAD_TENSOR"
    case("step", "tensor", _id, _code, *_mentions, what=_what)(after_handshake(_frames))


# --- step stream: step controls ------------------------------------------------------------------------------

_STEP_CASES = [
    (
        "step-unknown-request",
        "ProtocolError.UNKNOWN_REQUEST",
        lambda c: [control(running=[worker_pb2.RunningRequest(request_id="ghost", num_scheduled_tokens=1)])],
        ("running[ghost]", "does not hold"),
        "a delta for a request the rank never saw",
    ),
    (
        "finish-unknown-request",
        "ProtocolError.UNKNOWN_REQUEST",
        lambda c: [control(finished_request_ids=["ghost"])],
        ("finished_request_ids", "ghost"),
        "finishing a request the rank never saw",
    ),
    (
        "step-id-not-increasing",
        "ProtocolError.STATE_MISMATCH",
        lambda c: [control(step_id=0)],
        ("step_id 0", "not above"),
        "step id 0 (must increase)",
    ),
    (
        "block-id-out-of-range",
        "ProtocolError.OUT_OF_RANGE",
        lambda c: [control(new_requests=[text_request(block_ids=[10_000])])],
        ("block id 10000", "64", "--kv-blocks"),
        "block 10000 in a 64-block pool",
    ),
    (
        "token-id-out-of-vocab",
        "ProtocolError.OUT_OF_RANGE",
        lambda c: [control(new_requests=[text_request(prompt_token_ids=[5, 1 << 30, 5])])],
        ("prompt_token_ids", "1073741824", "outside"),
        "token id 2^30",
    ),
    (
        "prefix-foreign-block",
        "ProtocolError.STATE_MISMATCH",
        lambda c: [control(new_requests=[text_request(n=40, num_computed_tokens=32, block_ids=[0, 1, 2])])],
        ("block_ids[0]=0", "no request of this stream wrote"),
        "a 32-token prefix in blocks this stream never wrote",
    ),
    (
        "computed-not-block-aligned",
        "ProtocolError.STATE_MISMATCH",
        lambda c: [control(new_requests=[text_request(n=40, num_computed_tokens=5, block_ids=[0, 1, 2])])],
        ("num_computed_tokens=5", "block_size 16"),
        "5 computed tokens with 16-token blocks",
    ),
    (
        "scheduled-past-prompt",
        "ProtocolError.STATE_MISMATCH",
        lambda c: [control(new_requests=[text_request(num_scheduled_tokens=50)])],
        ("num_scheduled_tokens=50", "knows 8"),
        "50 tokens scheduled of an 8-token prompt",
    ),
    (
        "sampling-out-of-range",
        "ProtocolError.OUT_OF_RANGE",
        lambda c: [control(new_requests=[text_request(sampling=worker_pb2.WorkerSampling(top_p=2.0))])],
        ("sampling.top_p=2.0", "(0, 1]"),
        "top_p 2 in a new request",
    ),
    (
        "item-outside-prompt",
        "ProtocolError.BAD_TENSOR",
        lambda c: [control(new_requests=[text_request(mm_items=[image_item(offset=30)])])],
        ("position", "exceeds the prompt length 8"),
        "an image placed after the end of the prompt",
    ),
    (
        "item-grid-negative",
        "ProtocolError.STATE_MISMATCH",
        lambda c: [control(new_requests=[text_request(mm_items=[image_item(grid=(-1, -2, 4), length=2)])])],
        ("grid (-1, -2, 4)", "positive"),
        "an image grid of (-1, -2, 4)",
    ),
    (
        "encoder-unknown-item",
        "ProtocolError.STATE_MISMATCH",
        lambda c: [control(encoder_inputs=[worker_pb2.EncoderInput(item_identifier="nobody")])],
        ("encoder_inputs", "nobody"),
        "encoder work for an item no request holds",
    ),
]
for _id, _code, _frames, _mentions, _what in _STEP_CASES:
    case("step", "step", _id, _code, *_mentions, what=_what)(after_handshake(_frames))


# --- step stream: encoded videos ----------------------------------------------------------------------------
# An encoded video item carries the file (video_bytes), the frames to decode (video_frame_indices) and its grid. What
# needs no file (the frames' order and count, the grid against them and the placeholder) is checked before the step
# runs: a bad step. What needs the file's header (a frame past its end, a grid its size cannot give) is the owner's
# to find when it opens the file, before decoding: an item failure, reported in the step's result.


def video_item(
    data: bytes, frames=(0, 5, 10, 15), grid=(2, 4, 4), length: int | None = None, ident: str = "vid-1"
) -> tuple[multimodal_pb2.MultiModalItem, list[bytes]]:
    """An encoded video item at offset 2 (``length``: its placeholder; default the grid's tokens) and its payload
    frames, as the scheduler's frontend makes them (``_feature``)."""
    t, h, w = grid
    length = t * h * w // 4 if length is None else length
    payload = {
        VIDEO_ENCODED_FIELD: torch.frombuffer(bytearray(data), dtype=torch.uint8),
        FRAME_INDICES_FIELD: torch.tensor(list(frames), dtype=torch.int64),
    }
    fields = {name: MultiModalFieldElem(x, keep_on_cpu=False, kind=FieldKind.FLAT) for name, x in payload.items()}
    fields["video_grid_thw"] = MultiModalFieldElem(
        torch.tensor([list(grid)], dtype=torch.int64), keep_on_cpu=True, kind=FieldKind.BATCHED
    )
    feature = MultiModalFeatureSpec(
        MultiModalKwargsItem(fields),
        Modality.VIDEO,
        ident,
        PlaceholderRange(2, length),
        payload_nbytes=sum(int(x.nbytes) for x in payload.values()),
        encoding=PayloadEncoding.ENCODED,
    )
    msg = item_proto.feature_to_proto(feature, PayloadState.DEFERRED)
    frames_out = [f for name, x in payload.items() for f in codec.payload_frames(ident, name, x, chunk_size=1 << 16)]
    return msg, frames_out


def with_video_step(**item_kwargs) -> list:
    """The payload frames of a 20-frame 64 x 48 video item, then a control admitting a request holding it (its
    encoder work due)."""
    item, frames = video_item(hostile_video.good(), **item_kwargs)
    n = item.position.length + 4
    req = text_request(n=n, block_ids=list(range(-(-n // 16))))
    req.mm_items.append(item)
    encode = worker_pb2.EncoderInput(item_identifier=item.identifier)
    return [*frames, control(new_requests=[req], encoder_inputs=[encode])]


def item_failure(**item_kwargs):
    """A case whose step the rank serves, reporting the item as failed: ``("ITEM_FAILURE", its message)``."""

    def run(ctx: StepCtx):
        code, message, frame = ctx.open().send(*with_video_step(**item_kwargs)).answer()
        if code != "OK":
            return code, message
        result = frame.step_result
        assert not result.sampled, result  # the request's window reaches the failed item: nothing is sampled
        failures = [f.message for f in result.item_failures if f.item_identifier == "vid-1"]
        return ("ITEM_FAILURE", failures[0]) if failures else ("OK", "")

    return run


for _id, _kwargs, _mentions, _what in [
    (
        "video-frames-not-increasing",
        {"frames": (0, 10, 5, 15)},
        ("video_frame_indices[2]=5 follows 10", "strictly increasing"),
        "video_frame_indices 0, 10, 5, 15",
    ),
    (
        "video-frames-too-many",
        {"frames": tuple(range(18)), "grid": (9, 4, 4)},
        ("video_frame_indices has 18 frames", "16 (--max-video-frames)"),
        "18 frames to decode where the handshake allows 16",
    ),
    (
        "video-grid-disagrees-with-frames",
        {"grid": (5, 4, 4)},
        ("video_grid_thw=(5, 4, 4) has 5 temporal patches", "4 frames make 2"),
        "a grid of 5 temporal patches for 4 frames",
    ),
]:
    case("step", "video", _id, "ProtocolError.BAD_TENSOR", *_mentions, what=_what)(
        after_handshake((lambda kw: lambda c: with_video_step(**kw))(_kwargs))
    )


@case(
    "step",
    "video",
    "video-grid-over-placeholder",
    "ProtocolError.STATE_MISMATCH",
    "8 placeholder tokens",
    "grid (2, 200, 200)",
    "gives 20000",
    what="a grid of 2 x 200 x 200 patches (frames resized to 2800 x 2800) behind an 8-token placeholder",
)
def _(ctx):
    return ctx.open().send(*with_video_step(grid=(2, 200, 200), length=8)).answer()[:2]


for _id, _kwargs, _mentions, _what in [
    (
        "video-frames-past-the-file",
        {"frames": (0, 5, 10, 30)},
        ("video_frame_indices asks for frame 30", "20 frames"),
        "frame 30 of a 20-frame file",
    ),
    (
        "video-grid-disagrees-with-file",
        {"grid": (2, 2, 16)},
        ("video_grid_thw=(2, 2, 16)", "224x28", "64x48"),
        "a grid of 2 x 16 patches (frames resized to 224 x 28) for a 64 x 48 file: as many tokens as its real grid (2, 4, 4)",
    ),
]:
    case("step", "video", _id, "ITEM_FAILURE", *_mentions, what=_what)(item_failure(**_kwargs))


@case(
    "step",
    "video",
    "video-without-handshake-limits",
    "ProtocolError.BAD_TENSOR",
    "encoded video",
    "no video limits",
    what="an encoded video on a stream whose handshake set no video limits",
)
def _(ctx):
    return ctx.open(video_limits=None).send(*with_video_step()).answer()[:2]


def valid_step(ctx: StepCtx) -> None:
    """A fresh stream with a well-formed step (text and one image): the rank serves it, then forgets it."""
    s = ctx.open()
    frames = with_image_step(payload())
    code, message, frame = s.send(*frames).answer()
    assert code == "OK" and frame.WhichOneof("frame") == "step_result", (code, message)
    assert frame.step_result.sampled and frame.step_result.stats.encoder_items == 1
    code, message, frame = s.send(control(step_id=2, finished_request_ids=["r"])).answer()
    assert code == "OK" and frame.WhichOneof("frame") == "step_result", (code, message)
    s.close()
    ctx.streams.remove(s)
