"""Video end to end: a real TP=2 group (serve-local: the scheduler and two `mmcast-worker` processes, the defaults —
encoded payload, sharded encoder placement, lazy transfer) serves a two-turn conversation about a synthetic h264
clip through the SDK and through the real `openai` package, compared with plain transformers fed the same file
through transformers' own processor, video processor included (tests/oracle: its own venv, where torchvision's
Python part loads; docs/ARCHITECTURE.md §3, invariant 3).

Qwen2-VL (temporal positions step by 1), Qwen2.5-VL (by ``second_per_grid_ts * tokens_per_second``) and Qwen3-VL
(a ``<t seconds>`` timestamp before each temporal patch, each patch its own position block, DeepStack). Turn 2
hits the prefix holding the clip: its file travels to no rank. The live-stream pattern (a new segment each turn,
the last two kept, the prompt rebuilt) sends and encodes each segment once, even after the window slides. A
negative control shows the comparison can fail.
"""

from __future__ import annotations

import base64

import openai
import pytest

from mmcast_client import Client
from tests.oracle import oracle, oracle_options
from tests.support.oracle import LOGPROB_TOLERANCE, mismatch, scrape
from tests.video_clips import make_clip

pytestmark = pytest.mark.slow

N = 6  # tokens per answer
GENERATE = dict(max_tokens=N, ignore_eos=True, logprobs=0, temperature=0.0)
FPS = 2.0
PROCESSOR = {
    "qwen2_vl": "Qwen2VLVideoProcessor",
    "qwen2_5_vl": "Qwen2VLVideoProcessor",
    "qwen3_vl": "Qwen3VLVideoProcessor",
}
MODELS = {"qwen2_5_vl": "tiny_model_25_dir", "qwen3_vl": "tiny_model_q3_dir"}


def clip(seed: int) -> bytes:
    """2 s of 160x112 h264 at 10 fps: sampled at 2 fps, 4 frames -> 2 temporal patches of 4x6 merged patches."""
    return make_clip(codec="h264", width=160, height=112, fps=10, seconds=2.0, seed=seed)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def group(family, request, oracle_venv):
    if family == "qwen2_vl":  # the suite's shared TP=2 group of the default model
        yield request.getfixturevalue("serve_local_tp2"), request.getfixturevalue("tiny_model_dir")
        return
    from mmcast_local.supervisor import LocalGroup

    model_dir = request.getfixturevalue(MODELS[family])
    with LocalGroup(model_dir, 2, "lazy", ready_timeout=180) as local:
        yield local, model_dir


def sdk_turn(video: bytes, question: str) -> dict:
    return {
        "role": "user",
        "content": [{"type": "video", "video": video, "fps": FPS}, {"type": "text", "text": question}],
    }


def hf(messages: list[dict]) -> list[dict]:
    """The conversation as transformers' chat template takes it: one ``{"type": "video"}`` per video."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        out.append({"role": m["role"], "content": [p if p["type"] == "text" else {"type": "video"} for p in content]})
    return out


def expected(model_dir, family, tmp_path, conversations: list[list[dict]]) -> list[tuple[list[int], list[float]]]:
    """The oracle's (tokens, log-probabilities) of each conversation, in one run of the oracle venv."""
    call, attributes = oracle_options({"fps": FPS}, PROCESSOR[family])
    cases = []
    for k, messages in enumerate(conversations):
        videos = []
        for i, m in enumerate(messages):
            for j, part in enumerate(m["content"] if isinstance(m["content"], list) else []):
                if part["type"] == "video":
                    path = tmp_path / f"conv{k}-m{i}-p{j}.mp4"
                    path.write_bytes(part["video"])
                    videos.append(str(path))
        cases.append({"messages": hf(messages), "videos": videos, "options": call, "attributes": attributes})
    answer = oracle({"mode": "generate", "model_dir": str(model_dir), "max_new_tokens": N, "cases": cases})
    out = []
    for result in answer["results"]:
        assert "error" not in result, result
        out.append((result["tokens"], result["logprobs"]))
    return out


def test_two_turns_sdk_and_openai(group, family, tmp_path):
    local, model_dir = group
    video = clip(1)
    first = [sdk_turn(video, "What happens in this clip?")]
    with Client(local.target, timeout=300) as client:
        r1 = client.generate(first, **GENERATE)
        second = [*first, {"role": "assistant", "content": r1.text}, {"role": "user", "content": "And at the end?"}]
        r2 = client.generate(second, **GENERATE)
    control = [sdk_turn(clip(2), "What happens in this clip?")]
    want1, want2, other = expected(model_dir, family, tmp_path, [first, second, control])
    assert mismatch(r1, want1) is None, f"turn 1: {mismatch(r1, want1)}"
    assert mismatch(r2, want2) is None, f"turn 2: {mismatch(r2, want2)}"
    assert mismatch(r1, other) is not None, "negative control: another clip's answer passed"
    # turn 1: the file once, to its owner rank, one encoder run whose rows reach the other rank on the collective
    assert (r1.usage.videos, r1.usage.images_sent, r1.usage.encoder_runs) == (1, 1, 1), r1.usage
    assert 0 < r1.usage.payload_bytes_broadcast < 2 * len(video) + 1024, r1.usage
    # turn 2: the clip inside the prefix hit costs no payload byte and no encoder run
    assert r2.usage.cached_tokens > 0 and r2.usage.payload_bytes_broadcast == 0, r2.usage
    assert r2.usage.encoder_runs == 0 and r2.usage.images_stripped == 2, r2.usage

    # the same turn 1 through the openai package: video_url as a data: URL, vLLM's mm_processor_kwargs for the fps
    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    with openai.OpenAI(base_url=local.openai_base_url, api_key="unused", max_retries=0, timeout=300) as api:
        model = api.models.list().data[0].id
        reply = api.chat.completions.create(
            model=model,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "video_url", "video_url": {"url": url}},
                        {"type": "text", "text": "What happens in this clip?"},
                    ],
                }
            ],
            max_tokens=N,
            temperature=0.0,
            logprobs=True,
            extra_body={"ignore_eos": True, "mm_processor_kwargs": {"fps": FPS}},
        )
    served = [t.logprob for t in reply.choices[0].logprobs.content]
    worst = max(abs(a - b) for a, b in zip(served, want1[1], strict=True))
    assert worst < LOGPROB_TOLERANCE, f"openai: log-probabilities differ by up to {worst:.2e}"
    assert reply.usage.prompt_tokens == r1.usage.prompt_tokens, reply.usage
    assert reply.usage.prompt_tokens_details.cached_tokens > 0, reply.usage  # the SDK's turn 1 left the prefix


def test_live_stream_sends_and_encodes_each_segment_once(group, family):
    """Exact mode: turn k sends segments k-2 and k-1 (the window of two) and the question; once the window slides
    the prefix changes, yet only the new segment travels and is encoded."""
    local, _ = group
    url = local.metrics_urls["scheduler"]
    sent_before = scrape(url, "mmcast_mm_items_total", disposition="sent", modality="video")
    segments = [make_clip(codec="h264", width=112, height=84, fps=4, seconds=1.0, seed=40 + k) for k in range(4)]
    with Client(local.target, timeout=300) as client:
        for k in range(1, len(segments) + 1):
            kept = segments[max(0, k - 2) : k]
            content = [{"type": "video", "video": s, "fps": FPS} for s in kept]
            messages = [{"role": "user", "content": [*content, {"type": "text", "text": "What is new?"}]}]
            r = client.generate(messages, **GENERATE)
            new = segments[k - 1]
            assert r.usage.videos == len(kept), (k, r.usage)
            assert r.usage.encoder_runs == 1, (k, r.usage)  # the new segment only, by its owner rank
            assert r.usage.images_sent == 1, (k, r.usage)  # its file, once, to the owner
            assert len(new) <= r.usage.payload_bytes_broadcast <= len(new) + 1024, (k, r.usage)
    # the item metrics say they were videos: one delivery per segment (its owner rank)
    assert scrape(url, "mmcast_mm_items_total", disposition="sent", modality="video") - sent_before == len(segments)


def test_live_session_of_video_segments(group, family, tmp_path):
    """Live mode: each turn sends only its new segment; past keep_turns the oldest turn leaves the KV while the kept
    ones keep their KV and positions. Every turn equals transformers alone (tests/oracle ``live``: the session's
    tokens from the model's own processor and chat template, positions from ``get_rope_index`` over each turn's new
    tokens continuing the session's, transformers' KV cache with the evicted rows cut out); the same turns without
    an eviction (keep_turns 4) answer otherwise after the first eviction, so the comparison can fail."""
    local, model_dir = group
    segments = [make_clip(codec="h264", width=112, height=84, fps=4, seconds=1.0, seed=60 + k) for k in range(4)]
    questions = ["What do you see?", "What is new?", "And now?", "Anything else?"]
    served = []
    with Client(local.target, timeout=300) as client:
        for k, (segment, question) in enumerate(zip(segments, questions, strict=True)):
            content = [{"type": "video", "video": segment, "fps": FPS}, {"type": "text", "text": question}]
            r = client.generate(
                [{"role": "user", "content": content}],
                **GENERATE,
                session_id=f"live-{family}",
                live={"keep_turns": 2, "close": k == len(segments) - 1},
            )
            served.append(r)
            # only the new segment travels (its file, once, to its owner rank) and is encoded
            assert (r.usage.videos, r.usage.images_sent, r.usage.encoder_runs) == (1, 1, 1), (k, r.usage)
            assert len(segment) <= r.usage.payload_bytes_broadcast <= len(segment) + 1024, (k, r.usage)
            assert r.live["evicted_turns"] == (1 if k >= 2 else 0), (k, r.live)
            if k:
                assert 0 < r.usage.cached_tokens < r.usage.prompt_tokens, (k, r.usage)
    call, attributes = oracle_options({"fps": FPS}, PROCESSOR[family])
    turns = []
    for k, segment in enumerate(segments):
        path = tmp_path / f"segment{k}.mp4"
        path.write_bytes(segment)
        turns.append({"video": str(path), "question": questions[k]})
    cases = [
        {"keep_turns": keep, "turns": turns, "options": call, "attributes": attributes} for keep in (2, len(turns))
    ]
    answer = oracle({"mode": "live", "model_dir": str(model_dir), "max_new_tokens": N, "cases": cases})
    want, unevicted = (result["turns"] for result in answer["results"])
    for k, (r, w) in enumerate(zip(served, want, strict=True)):
        assert mismatch(r, (w["tokens"], w["logprobs"])) is None, (
            f"turn {k}: {mismatch(r, (w['tokens'], w['logprobs']))}"
        )
        assert (r.usage.prompt_tokens, r.live["next_position"]) == (w["prompt_tokens"], w["next_position"]), k
    # negative control: the turn after the first eviction, had nothing been evicted
    assert mismatch(served[2], (unevicted[2]["tokens"], unevicted[2]["logprobs"])) is not None


@pytest.fixture(scope="module")
def q25_ranks(oracle_venv, tiny_model_25_dir, tmp_path_factory):
    """Two bare Qwen2.5-VL ranks for schedulers of other settings than serve-local's defaults."""
    from tests.support.rank_group import Group

    group = Group(tiny_model_25_dir, tmp_path_factory.mktemp("video-ranks"), world_size=2, timeout_s=60.0)
    yield group
    group.stop()


@pytest.mark.parametrize(
    "settings",
    [
        {},  # encoded, sharded, lazy
        {"payload_encoding": "pixels", "encoder_placement": "replicated", "transfer_mode": "strip"},
    ],
    ids=["encoded-lazy", "pixels-strip"],
)
def test_chunked_prefill_across_a_long_video(q25_ranks, tiny_model_25_dir, tmp_path, settings):
    """A 4 s clip sampled to 8 frames (4 temporal patches, 96 placeholders) under a 64-token step budget: the prefill crosses
    the video's span over several steps (its encoder work in the first of them, the rows used as each window needs
    them); the answer equals transformers'. Turn 2 covers the video: its payload never travels again."""
    from tests.support.service_harness import scheduler_client

    video = make_clip(codec="h264", width=160, height=112, fps=8, seconds=4.0, seed=7)
    first = [sdk_turn(video, "Describe the clip.")]
    with scheduler_client(q25_ranks.ports, tiny_model_25_dir, max_num_batched_tokens=64, **settings) as client:
        r1 = client.generate(first, **GENERATE)
        second = [*first, {"role": "assistant", "content": r1.text}, {"role": "user", "content": "Why?"}]
        r2 = client.generate(second, **GENERATE)
    want1, want2 = expected(tiny_model_25_dir, "qwen2_5_vl", tmp_path, [first, second])
    assert mismatch(r1, want1) is None, f"turn 1: {mismatch(r1, want1)}"
    assert mismatch(r2, want2) is None, f"turn 2: {mismatch(r2, want2)}"
    assert r1.usage.prompt_tokens > 2 * 64, r1.usage  # the prompt spans three steps, the video two
    assert r2.usage.cached_tokens > 96 and r2.usage.payload_bytes_broadcast == 0, r2.usage
