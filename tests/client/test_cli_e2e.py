"""End to end: a real scheduler and real worker ranks started by LocalGroup (the code behind `mmcast serve-local`),
driven through the SDK, compared with the same checkpoint run whole in plain transformers.

Every served answer forces a fixed number of tokens (ignore_eos) and its log-probabilities must match the oracle's
within 1e-3; a negative control (one image swapped) shows that the comparison would catch a wrong feature.
"""

from __future__ import annotations

import hashlib
import threading

import pytest

from mmcast_client import Client, NotFound
from mmcast_local.supervisor import LocalGroup
from mmcast_local.synthetic_images import synthetic_jpeg
from tests.support.oracle import GENERATE, LOGPROB_TOLERANCE, Oracle, assert_matches, scrape, user_turn, wait_until

pytestmark = pytest.mark.slow

IMAGE_SIZE = (448, 336)  # 16 x 12 merged patches = 192 image tokens: real processing, small enough for CI
# Long enough that each image ends a few blocks before its turn does, so the next turn's prefix hit covers it.
QUESTIONS = (
    "Look carefully at this landscape and describe the sky, the hills, the colours and anything unusual in it.",
    "Compare this new picture with the previous one: which has more clouds, where is the sun, what changed?",
    "Now consider all of the pictures so far together and tell me which one feels the warmest and why.",
)


# -- helpers ------------------------------------------------------------------------------------------------------
def image(seed: int) -> bytes:
    return synthetic_jpeg(1000 + seed, IMAGE_SIZE)


def worker_payload_bytes(group: LocalGroup) -> float:
    return sum(
        scrape(group.metrics_urls[f"rank{r}"], "mmcast_worker_received_bytes_total", kind="payload")
        for r in range(group.tp)
    )


def scheduler_payload_bytes(group: LocalGroup) -> float:
    return scrape(group.metrics_urls["scheduler"], "mmcast_broadcast_bytes_total", kind="payload")


# -- fixtures -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def oracle(tiny_model_dir) -> Oracle:
    return Oracle(tiny_model_dir)


@pytest.fixture(scope="module")
def group(serve_local_tp2):
    return serve_local_tp2


# -- the growing conversation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["full", "strip", "lazy"])
@pytest.mark.parametrize("tp", [1, 2])
def test_growing_conversation_matches_the_oracle(tiny_model_dir, oracle, tp, mode):
    images = [image(i) for i in range(3)]
    with LocalGroup(tiny_model_dir, tp, mode, ready_timeout=180) as g, Client(g.target, timeout=300) as client:
        history: list[dict] = []
        results, worker_bytes, scheduler_bytes = [], [], []
        for turn in range(3):
            history.append(user_turn(images[turn], QUESTIONS[turn]))
            before = worker_payload_bytes(g), scheduler_payload_bytes(g)
            result = client.generate(history, **GENERATE)
            worker_bytes.append(worker_payload_bytes(g) - before[0])
            scheduler_bytes.append(scheduler_payload_bytes(g) - before[1])
            assert_matches(result, oracle(history), f"TP={tp} {mode} turn {turn + 1}")
            results.append(result)
            history.append({"role": "assistant", "content": result.text})

        # Negative control: the last turn with the first image swapped gives other log-probabilities.
        swapped = [dict(m) for m in history[:-1]]
        swapped[0] = user_turn(image(99), QUESTIONS[0])
        _, control = oracle(swapped)
        served = [lp.logprob for lp in results[-1].logprobs]
        assert max(abs(a - b) for a, b in zip(served, control, strict=True)) > LOGPROB_TOLERANCE

        cached = [r.usage.cached_tokens for r in results]
        assert cached[0] < cached[1] < cached[2], cached
        broadcast = [r.usage.payload_bytes_broadcast for r in results]
        # The workers received exactly the payload frame bytes the scheduler wrote (invariant 5); the usage counts
        # the tensor bytes inside those frames (frame headers excluded).
        assert worker_bytes == scheduler_bytes, (worker_bytes, scheduler_bytes)
        for wire, tensors in zip(worker_bytes, broadcast, strict=True):
            assert tensors <= wire <= tensors * 1.001 + 4096, (worker_bytes, broadcast)
        # The defaults (encoded payloads, sharded encoders): a new image is one delivery to one rank of exactly the
        # client's file, and one encoder run for the whole group; its output reaches the other ranks (TP=2) over
        # the group's collective.
        for turn, r in enumerate(results):
            assert r.usage.images == turn + 1
            assert r.usage.encoder_runs == 1, r.usage  # the new image only: earlier ones are prefix-covered
            assert (r.usage.encoder_output_bytes_shared > 0) == (tp > 1), r.usage
            if mode == "full":
                assert broadcast[turn] == sum(map(len, images[: turn + 1]))  # every image of the context again
                assert r.usage.images_sent == turn + 1
            else:
                # the images of earlier turns are prefix-covered: only the new one travels
                assert broadcast[turn] == len(images[turn]), broadcast
                assert r.usage.images_sent == 1, r.usage
                assert r.usage.images_stripped + r.usage.images_rank_cached == turn * tp


# -- images ---------------------------------------------------------------------------------------------------------
def test_same_image_twice_in_one_prompt(group, oracle):
    img = image(10)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": img},
                {"type": "text", "text": "and the same picture again:"},
                {"type": "image", "image": img},
                {"type": "text", "text": "are they the same?"},
            ],
        }
    ]
    with Client(group.target, timeout=300) as client:
        result = client.generate(messages, **GENERATE)
    assert result.usage.images == 2
    assert_matches(result, oracle(messages), "same image twice")


def test_image_referenced_by_hash_after_upload(group, oracle):
    img = image(11)
    with Client(group.target, timeout=300) as client:
        ref = client.upload_image(img)
        assert ref == "sha256:" + hashlib.sha256(img).hexdigest()
        result = client.generate([user_turn(ref, "What is this?")], **GENERATE)
    assert_matches(result, oracle([user_turn(img, "What is this?")]), "uploaded image by hash")


def test_unknown_hash_is_not_found_and_the_sdk_resends_transparently(group, oracle, monkeypatch):
    with Client(group.target, timeout=300) as client:
        with pytest.raises(NotFound) as info:
            client.generate([user_turn("sha256:" + "0" * 64, "What is this?")], **GENERATE)
        assert "0" * 64 in info.value.message
        # A stale local record: the client believes the server holds an image it never received.
        img = image(12)
        client.images.mark_held(hashlib.sha256(img).hexdigest())
        uploads = []
        original = client._upload
        monkeypatch.setattr(client, "_upload", lambda sha, *rest: (uploads.append(sha), original(sha, *rest)))
        result = client.generate([user_turn(img, "What is this?")], **GENERATE)
        # The retry carried the image inline (no upload RPC, which could reach another replica); the next request
        # of the conversation uploads it again, since the client no longer counts it as held.
        assert uploads == []
        assert_matches(result, oracle([user_turn(img, "What is this?")]), "resent inline after NOT_FOUND")
        history = [user_turn(img, "What is this?"), {"role": "assistant", "content": result.text},
                   {"role": "user", "content": "And the colours?"}]  # fmt: skip
        again = client.generate(history, **GENERATE)
    assert uploads == [hashlib.sha256(img).hexdigest()]
    assert_matches(again, oracle(history), "the next turn, uploaded again")


# -- streaming, cancellation, concurrency -------------------------------------------------------------------------
def test_streaming_equals_non_streaming(group, oracle):
    messages = [user_turn(image(13), "Describe it.")]
    with Client(group.target, timeout=300) as client:
        whole = client.generate(messages, **GENERATE)
        stream = client.generate(messages, stream=True, **GENERATE)
        deltas = list(stream)
    streamed = stream.result
    assert [t for d in deltas for t in d.token_ids] == list(whole.token_ids) == list(streamed.token_ids)
    assert "".join(d.text for d in deltas) == whole.text == streamed.text
    assert [lp.logprob for lp in streamed.logprobs] == pytest.approx([lp.logprob for lp in whole.logprobs], abs=1e-5)
    assert streamed.finish_reason == whole.finish_reason == "length"
    assert_matches(whole, oracle(messages), "non-streaming")


def test_cancellation_mid_stream_frees_the_request(group):
    url = group.metrics_urls["scheduler"]
    with Client(group.target, timeout=300) as client:
        stream = client.generate(
            [user_turn(image(14), "Talk for a long time.")], max_tokens=500, ignore_eos=True, stream=True
        )
        next(stream)
        next(stream)
        stream.cancel()
        assert list(stream) == [] and stream.result is None

        def idle() -> bool:
            return scrape(url, "mmcast_requests_running") == 0 and scrape(url, "mmcast_requests_waiting") == 0

        assert wait_until(idle, 15), "the cancelled request is still running or waiting"
        # and the service keeps serving
        assert client.generate("still there?", max_tokens=2).finish_reason in ("length", "stop")


def test_concurrent_clients_get_their_oracle_answers(group, oracle):
    images = [image(20 + i) for i in range(3)]

    def messages_for(k: int) -> list[dict]:
        a, b = images[k % 3], images[(k + 1) % 3]
        return [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": a},
                    {"type": "image", "image": b},
                    {"type": "text", "text": f"Compare the two pictures ({k % 3})."},
                ],
            }
        ]

    expected = {k: oracle(messages_for(k)) for k in range(3)}
    failures: list[str] = []
    results: list = []

    def client_thread(t: int) -> None:
        try:
            with Client(group.target, timeout=300) as client:
                for j in range(3):
                    k = (t + j) % 3
                    result = client.generate(messages_for(k), **GENERATE)
                    assert_matches(result, expected[k], f"thread {t} request {j}")
                    results.append(result)
        except Exception as e:  # noqa: BLE001 - collected and reported below
            failures.append(f"thread {t}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client_thread, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert failures == [] and len(results) == 24


# -- sampling extremes never take the group down (docs/SECURITY.md "Sampling limits") ------------------------------
SAMPLING_PROMPT = [{"role": "user", "content": "Describe a lighthouse on a stormy night in three sentences."}]
GREEDY_EXTREMES = [  # below the greedy epsilon, or a nucleus of one token: the oracle's greedy answer
    dict(temperature=1e-40),
    dict(temperature=1e-30),
    dict(temperature=1e-45, seed=2**64 - 1),
    dict(temperature=-0.0),
    dict(temperature=1.0, top_p=1e-45),
    dict(temperature=2.0, top_p=1e-45, seed=0, logprobs=20),
    dict(temperature=1e-40, top_p=1e-45, logprobs=20),
    dict(temperature=2.0, top_k=1, seed=3, logprobs=20),  # top-k of one: greedy, with the model's log-probabilities
    dict(temperature=2.0, top_k=1, top_p=1e-45, seed=4),
]
SAMPLED_EXTREMES = [  # real draws: not comparable with greedy, but complete, finite and reproducible per seed
    dict(temperature=2.0, top_p=1 - 1e-7, seed=2**64 - 1, logprobs=20),
    dict(temperature=1e-5, top_p=1.0, seed=1),
    dict(temperature=2.0, top_p=1.4e-45 * 2, seed=12345),
    dict(temperature=2.0, top_k=40, top_p=0.9, seed=99, logprobs=5),
]


def test_sampling_extremes_never_restart_the_group(group, oracle):
    from mmcast_client import Internal, InvalidArgument

    generation, pids, restarts = group.generation, group.pids(), group.restarts
    recoveries = scrape(group.metrics_urls["scheduler"], "mmcast_worker_group_recoveries_total")
    expected = oracle(SAMPLING_PROMPT)
    jobs = [("greedy", k, {**GENERATE, **x}) for k, x in enumerate(GREEDY_EXTREMES)]
    jobs += [("sampled", k, {**GENERATE, **x}) for k, x in enumerate(SAMPLED_EXTREMES)]
    jobs += [("sampled-again", k, {**GENERATE, **x}) for k, x in enumerate(SAMPLED_EXTREMES)]
    results: dict = {}

    def run(kind, k, params):
        with Client(group.target, timeout=300) as client:
            try:
                results[kind, k] = client.generate(SAMPLING_PROMPT, **params)
            except Internal as exc:  # a per-request error is allowed; the group going down is not
                results[kind, k] = exc

    threads = [threading.Thread(target=run, args=job) for job in jobs]  # concurrent: they share steps
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)

    assert len(results) == len(jobs)
    # The group stayed up throughout (per-request errors included): no restart, no recovery.
    assert (group.generation, group.pids(), group.restarts) == (generation, pids, restarts)
    assert scrape(group.metrics_urls["scheduler"], "mmcast_worker_group_recoveries_total") == recoveries
    for (kind, k), result in results.items():
        if isinstance(result, Internal):
            assert result.message, (kind, k)
            continue
        if kind == "greedy":
            assert_matches(result, expected, f"greedy extreme {GREEDY_EXTREMES[k]}")
        else:
            assert len(result.token_ids) == GENERATE["max_tokens"] and result.finish_reason == "length"
            assert all(lp.logprob == lp.logprob and lp.logprob <= 0 for lp in result.logprobs), (kind, k)
            again = results["sampled-again", k]
            assert isinstance(again, Internal) or again.token_ids == result.token_ids, SAMPLED_EXTREMES[k]
    failed = {job: str(r) for job, r in results.items() if isinstance(r, Internal)}
    assert failed == {}  # allowed by the rule above, but none is expected of the sampler
    with Client(group.target, timeout=60) as client:
        for top_p in (0.0, -0.0):
            with pytest.raises(InvalidArgument, match="top_p"):
                client.generate(SAMPLING_PROMPT, **{**GENERATE, "temperature": 1.0, "top_p": top_p})
        config = oracle.model.config
        vocab = getattr(config, "text_config", config).vocab_size  # what the scheduler's frontend reads
        with pytest.raises(InvalidArgument, match=rf"sampling.top_k={vocab + 1} exceeds the model's vocabulary of "
                           rf"{vocab} tokens") as refused:
            client.generate(SAMPLING_PROMPT, **{**GENERATE, "temperature": 1.0, "top_k": vocab + 1})
        assert [f for f, _ in refused.value.field_violations] == ["sampling.top_k"]
        assert_matches(client.generate(SAMPLING_PROMPT, **GENERATE), expected, "a normal request right after")
    assert (group.generation, group.pids(), group.restarts) == (generation, pids, restarts)
    assert scrape(group.metrics_urls["scheduler"], "mmcast_worker_group_recoveries_total") == recoveries
