"""common/video_input.py against transformers itself (the oracle venv, tests/oracle), and its refusals.

The oracle is transformers' own processor (``AutoProcessor.from_pretrained`` of the tiny model folders, with
torchvision present) fed each clip file as sent, in one subprocess for the whole corpus. Compared: the header-only
plan (frame indices, ``video_grid_thw``, tokens, ``second_per_grid_ts``, Qwen3-VL's timestamps through the prompt's
``input_ids``) and ``process``'s ``pixel_values_videos``, bit for bit, for every clip, family and option set.
"""

from __future__ import annotations

import dataclasses
import fractions
import io

import numpy as np
import pytest
import torch

from common.errors import InvalidArgument
from common.tiny_model import SPECIAL_TOKEN_IDS
from common.video_input import VideoInput, VideoLimits, VideoOptions
from tests.oracle import oracle, oracle_options
from tests.video_clips import clip_corpus, make_clip

# The first test may install the oracle venv (about a minute; later runs find its stamp).
pytestmark = pytest.mark.timeout(900)

FIELD = "messages[0].content[1].video"
VIDEO_TOKEN = SPECIAL_TOKEN_IDS["<|video_pad|>"]

# Option sets per video processor class: the model's defaults, the fps rule with its bounds, the num_frames rule
# (odd counts pad the last temporal patch), and both size bounds.
OPTIONS = {
    "Qwen2VLVideoProcessor": [
        {},
        {"fps": 6.0, "max_frames": 6},
        {"num_frames": 5, "max_pixels": 5000},
        {"fps": 1.5, "min_pixels": 20000},
        {"num_frames": 8},
    ],
    "Qwen3VLVideoProcessor": [
        {},
        {"fps": 5.0},
        {"num_frames": 7, "max_pixels": 60000},
        {"fps": 10.0, "max_frames": 5, "min_pixels": 100000},
    ],
}
VARIANTS = {"qwen2_vl": "tiny_model_dir", "qwen2_5_vl": "tiny_model_25_dir", "qwen3_vl": "tiny_model_q3_dir"}


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clips")
    corpus = clip_corpus()
    for clip in corpus:
        (folder / clip.name).write_bytes(clip.data)
    return folder, corpus


@pytest.fixture(scope="module")
def models(request):
    return {variant: request.getfixturevalue(name) for variant, name in VARIANTS.items()}


@pytest.fixture(scope="module")
def compared(oracle_venv, clips, models, tmp_path_factory):
    """``[(variant, clip, options, mine, theirs)]``: every clip x option set x variant, the oracle's answers from
    one subprocess."""
    folder, corpus = clips
    cases, keys = [], []
    for variant, model_dir in models.items():
        video = VideoInput.from_model_dir(model_dir)
        for options in OPTIONS[video.kind]:
            call, attributes = oracle_options(options, video.kind)
            for clip in corpus:
                keys.append((variant, video, clip, options))
                cases.append(
                    {
                        "model_dir": str(model_dir),
                        "video": str(folder / clip.name),
                        "options": call,
                        "attributes": attributes,
                        "prompt": "What happens?",
                    }
                )
    out_dir = tmp_path_factory.mktemp("oracle")
    answer = oracle({"mode": "preprocess", "model_dir": cases[0]["model_dir"], "out_dir": str(out_dir), "cases": cases})
    assert answer["versions"]["transformers"] == "5.24.0"
    return list(zip(keys, answer["results"], strict=True))


def _plan(video: VideoInput, clip, options: dict):
    header = video.probe(clip.data, FIELD)
    return header, video.plan(header, VideoOptions(**options), FIELD)


def test_corpus_covers_containers_codecs_and_rotation(clips):
    _, corpus = clips
    names = " ".join(c.name for c in corpus)
    for part in ("h264", "vp9", ".webm", ".mp4", "rot90", "audio", "75x53"):
        assert part in names
    assert all(c.width <= 160 and c.height <= 120 and c.frames / c.fps <= 3 for c in corpus)


def test_header_plan_equals_the_processor(compared):
    """Frame indices, grid, placeholder count and second_per_grid_ts from the header alone equal transformers'."""
    checked = 0
    for (variant, video, clip, options), theirs in compared:
        where = f"{variant} {clip.name} {options}"
        assert "error" not in theirs, f"{where}: {theirs.get('error')}"
        header, plan = _plan(video, clip, options)
        assert (header.width, header.height) == (clip.width, clip.height), where  # coded size: rotation ignored
        assert header.total_frames == clip.frames and header.fps == clip.fps, where
        assert list(plan.frame_indices) == theirs["frames_indices"], where
        assert plan.grid.tolist() == theirs["video_grid_thw"], where
        assert plan.grid.dtype == torch.int64
        assert plan.tokens == theirs["input_ids"].count(VIDEO_TOKEN), where
        if variant == "qwen2_5_vl":
            # transformers carries it as a float32 tensor; the plan's float64 rounds to the same value
            assert np.float32(plan.second_per_grid_t) == np.float32(theirs["second_per_grid_ts"][0]), where
        else:
            assert "second_per_grid_ts" not in theirs, where
        checked += 1
    assert checked >= 100


def test_prompt_ids_equal_the_processor(compared, models):
    """The chat template's text with ``placeholder_text`` in place of its video token tokenizes to the processor's
    input_ids: Qwen2-VL's repeated token, Qwen3-VL's ``<t seconds>`` blocks (the plan's timestamps)."""
    from common.processor import load_processor

    tokenizers = {variant: load_processor(path).tokenizer for variant, path in models.items()}
    for (variant, video, clip, options), theirs in compared:
        _, plan = _plan(video, clip, options)
        text = theirs["text"].replace("<|video_pad|>", video.placeholder_text(plan), 1)
        ids = tokenizers[variant](text)["input_ids"]
        assert ids == theirs["input_ids"], f"{variant} {clip.name} {options}"


def test_pixels_equal_the_processor_bit_for_bit(compared):
    for (variant, video, clip, options), theirs in compared:
        _, plan = _plan(video, clip, options)
        pixels = video.process(clip.data, plan, FIELD)
        ref = np.load(theirs["pixel_values_videos"])
        assert pixels.dtype == torch.float32 and tuple(pixels.shape) == tuple(ref.shape)
        assert np.array_equal(pixels.numpy(), ref), (
            f"{variant} {clip.name} {options}: max abs difference {np.abs(pixels.numpy() - ref).max()}"
        )


def test_generate_reference(oracle_venv, tiny_model_25_dir, clips):
    """The oracle's ``generate`` mode: greedy tokens with log-probabilities, exactly ``max_new_tokens`` of them."""
    folder, corpus = clips
    answer = oracle(
        {
            "mode": "generate",
            "model_dir": str(tiny_model_25_dir),
            "max_new_tokens": 3,
            "cases": [{"video": str(folder / corpus[0].name), "options": {}, "prompt": "What happens?"}],
        }
    )
    result = answer["results"][0]
    assert "error" not in result, result.get("error")
    assert len(result["tokens"]) == len(result["logprobs"]) == 3
    assert all(lp <= 0 for lp in result["logprobs"])
    video = VideoInput.from_model_dir(tiny_model_25_dir)
    _, plan = _plan(video, corpus[0], {})
    assert result["input_ids"].count(VIDEO_TOKEN) == plan.tokens


def test_settings_key_names_what_changes_tokens(tiny_model_dir):
    video = VideoInput.from_model_dir(tiny_model_dir)
    base = video.settings_key(VideoOptions())
    assert base["cap_pixels_per_frame"] is False and base["fps"] == 2.0 and base["num_frames"] is None
    assert video.settings_key(VideoOptions(fps=4.0)) != base
    assert video.settings_key(VideoOptions(num_frames=8))["fps"] is None
    assert video.settings_key(VideoOptions(max_pixels=5000))["size"]["longest_edge"] == 5000
    assert video.settings_key(VideoOptions()) == base


def test_video_processor_config_loads_image_only_in_the_product_venv(tiny_model_q3_dir):
    """The tiny folder's video_preprocessor_config.json does not disturb the image-only processor load."""
    from common.processor import load_processor

    processor = load_processor(tiny_model_q3_dir)
    assert processor.image_processor is not None and getattr(processor, "video_processor", None) is None
    assert (tiny_model_q3_dir / "video_preprocessor_config.json").exists()


# --- refusals --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def video(tiny_model_dir):
    return VideoInput.from_model_dir(tiny_model_dir)


def _refused(video: VideoInput, data: bytes, options: VideoOptions | None = None, *words: str) -> str:
    with pytest.raises(InvalidArgument) as info:
        header = video.probe(data, FIELD)
        plan = video.plan(header, options or VideoOptions(), FIELD)
        video.process(data, plan, FIELD)
    message = info.value.message
    assert info.value.fields == (FIELD,) and message.startswith(FIELD + ": "), message
    for word in words:
        assert word in message, message
    return message


@pytest.fixture(scope="module")
def good():
    return make_clip(codec="h264", width=96, height=64, fps=24, seconds=1)


def test_refuses_what_is_not_a_video(video, good):
    from PIL import Image

    _refused(video, good[: len(good) // 2], None, "not a readable video container")  # its index is at the end
    _refused(video, bytes(range(256)) * 40, None, "not a readable video container", "10240 bytes")
    png = io.BytesIO()
    Image.new("RGB", (32, 32)).save(png, "PNG")
    _refused(video, png.getvalue(), None, "not a readable video container", "allowed format")
    # A playlist naming a local file: no demuxer outside the allowed ones runs, so nothing is opened.
    hls = b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n"
    _refused(video, hls, None, "not a readable video container")
    _refused(video, make_clip(audio_only=True, seconds=1), None, "no video stream", "audio")


def test_refuses_by_limits_before_decoding(video, good):
    _refused(
        video, make_clip(codec="mpeg4", width=1920, height=1088, fps=1, frames=1, flat=True), None,
        "1920x1088 = 2088960 pixels", "2073600 (--max-video-frame-pixels)",
    )  # fmt: skip
    # Over twice the limit, FFmpeg's probing refuses to decode the frame that gives MPEG-4's size: none is read.
    _refused(
        video, make_clip(codec="mpeg4", width=3840, height=2160, fps=1, frames=1, flat=True), None,
        "frame size could not be read (0x0", "over twice the limit", "2073600 (--max-video-frame-pixels)",
    )  # fmt: skip
    long = make_clip(codec="h264", width=64, height=64, fps=fractions.Fraction(1, 1000), frames=3)
    _refused(video, long, None, "lasts 3000.0 s", "600.0 (--max-video-seconds)")
    many = make_clip(codec="h264", width=32, height=32, fps=10, frames=2, video_streams=9)
    _refused(video, many, None, "more than 8 streams", "8 (--max-video-streams)")
    small = dataclasses.replace
    limited = VideoInput(video.settings, small(video.limits, max_bytes=1000))
    _refused(limited, good, None, f"{len(good)} bytes", "1000 (--max-upload-bytes)")
    limited = VideoInput(video.settings, small(video.limits, max_total_frames=10))
    _refused(limited, good, None, "24 frames", "10 (--max-video-total-frames)")
    limited = VideoInput(video.settings, small(video.limits, max_sampled_frames=4))
    _refused(
        limited, good, VideoOptions(num_frames=8), "num_frames=8 asks for 8 sampled frames", "4 (--max-video-frames)"
    )
    limited = VideoInput(video.settings, VideoLimits(), codecs=("h264",))
    _refused(limited, make_clip(codec="vp9", width=64, height=64, fps=10, seconds=1), None, "codec 'vp9'", "h264")


def test_refuses_a_header_that_lies(video):
    """A header counting more frames than the file holds: cut cleanly before packet 12 of 20 (fewer frames decode),
    or mid-packet (the decoder fails); either way the plan's frames are not all there."""
    import av

    for spec in (
        {"codec": "mjpeg", "width": 64, "height": 48, "fps": 10, "frames": 20},
        {"codec": "h264", "width": 64, "height": 48, "fps": 10, "frames": 20, "faststart": True},
    ):
        data = make_clip(**spec)
        with av.open(io.BytesIO(data)) as container:
            starts = [p.pos for p in container.demux(video=0) if p.size]
        assert video.probe(data[: starts[12]], FIELD).total_frames == 20
        _refused(video, data[: starts[12]], VideoOptions(num_frames=20), "fewer frames than its header gives (20)")
        _refused(video, data[: starts[12] + 40], VideoOptions(num_frames=20), "could not be decoded")


def test_refuses_bad_options(video, good):
    _refused(video, good, VideoOptions(fps=2.0, num_frames=4), "exclude each other")
    _refused(video, good, VideoOptions(num_frames=1), "num_frames=1 samples no frame", "temporal_patch_size 2")
    _refused(video, good, VideoOptions(num_frames=30), "asks for 30 frames; the video has 24")
    _refused(video, good, VideoOptions(fps=-1.0), "fps=-1.0 must be a positive number")
    _refused(video, good, VideoOptions(max_frames=0), "max_frames=0 must be a positive integer")
    _refused(video, good, VideoOptions(min_pixels=9000, max_pixels=8000), "min_pixels=9000 exceeds max_pixels=8000")


def test_webm_without_a_frame_count_counts_packets(video):
    """WebM headers carry no frame count (transformers' PyAV loader then divides by zero); the packets count."""
    data = make_clip(codec="vp9", width=64, height=64, fps=10, seconds=1)
    header = video.probe(data, FIELD)
    assert header.frames_counted and header.total_frames == 10 and header.duration_s == 1.0


def test_refuses_a_video_stream_without_frames(video):
    """A WebM cut before its first packet: a video stream in the header, no frame in the file."""
    import av

    data = make_clip(codec="vp9", width=64, height=64, fps=10, seconds=1)
    with av.open(io.BytesIO(data)) as container:
        first = next(p.pos for p in container.demux(video=0) if p.size)
    _refused(video, data[:first], None, "the video stream has no frame")


def test_refuses_hostile_headers_before_decoding(video):
    """The catalogue's hostile files (tests/support/hostile_video.py) refused on the header, naming the limit;
    FFmpeg's probing is bounded (``_open``), so none of them costs a frame buffer or a decoder per track."""
    from tests.support import hostile_video

    _refused(video, hostile_video.h264_claiming(16000, 16000), None, "16000x16000", "(--max-video-frame-pixels)")
    _refused(
        video, hostile_video.h264_claiming(16384, 16384), None, "could not be read (0x0", "(--max-video-frame-pixels)"
    )
    for data in (hostile_video.many_tracks(500, decoders=True), hostile_video.many_tracks(2500)):
        _refused(video, data, None, "more streams than the limit", "8 (--max-video-streams)")
    mkv = make_clip(codec="vp9", width=32, height=32, fps=10, frames=2, video_streams=12)  # Matroska: stops at 9
    _refused(video, mkv, None, "more than 8 streams", "8 (--max-video-streams)")
    _refused(video, hostile_video.other_codec("mpeg2video"), None, "codec 'mpeg2video' is not accepted")
    _refused(video, hostile_video.truncated(), None, "not a readable video container")
    png = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (32, 32)).save(png, "PNG")
    _refused(video, png.getvalue(), None, "the bytes are a PNG image: send it as an image part")


def test_refuses_what_only_decoding_finds(video):
    """Packets of noise behind an intact header; frames that change size mid-stream."""
    from tests.support import hostile_video

    assert video.probe(hostile_video.corrupt_packets(), FIELD).total_frames == 20
    _refused(video, hostile_video.corrupt_packets(), None, "could not be decoded")
    assert video.probe(hostile_video.frames_change_size(), FIELD).width == 64
    _refused(video, hostile_video.frames_change_size(), None, "frame 10 decodes to 96x64", "64x48")


def test_item_plan_checks_frames_and_grid_against_the_file(video):
    from tests.support import hostile_video

    data = hostile_video.good()  # 64 x 48, 20 frames: the plan samples 0, 5, 10, 15 into the grid (2, 4, 4)
    plan = video.plan(video.probe(data, FIELD), None, FIELD)
    assert plan.frame_indices == (0, 5, 10, 15) and plan.grid.tolist() == [[2, 4, 4]]
    assert video.item_plan(data, plan.frame_indices, plan.grid, FIELD).resized == plan.resized
    assert video.item_problem([0, 5, 10, 15], plan.grid, 8) is None
    assert "strictly increasing" in video.item_problem([0, 10, 5, 15], plan.grid, 8)
    assert "2 temporal patches" in video.item_problem([0, 5], torch.tensor([[2, 4, 4]]), 8)
    assert "takes 9" in video.item_problem([0, 5, 10, 15], plan.grid, 9)
    with pytest.raises(InvalidArgument, match="asks for frame 30; the video has 20 frames"):
        video.item_plan(data, [0, 5, 10, 30], plan.grid, FIELD)
    with pytest.raises(InvalidArgument, match=r"\(2, 2, 16\) resizes frames to 224x28"):
        video.item_plan(data, plan.frame_indices, torch.tensor([[2, 2, 16]]), FIELD)


def test_probe_options_keep_the_corpus_headers(video, clips):
    """The bounded probing (skip_frame for H.264/HEVC, max_pixels, max_streams) reads every corpus clip's header as
    FFmpeg's unbounded probing does (the plans compared with transformers' above come from these headers)."""
    import av

    _, corpus = clips
    for clip in corpus:
        with av.open(io.BytesIO(clip.data)) as container:
            s = container.streams.video[0]
            plain = (s.width, s.height, int(s.frames or 0), float(s.average_rate))
        header = video.probe(clip.data, FIELD)
        assert (header.width, header.height, header.fps) == (plain[0], plain[1], plain[3]), clip.name
        assert header.frames_counted or header.total_frames == plain[2], clip.name
