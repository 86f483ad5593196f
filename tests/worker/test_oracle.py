"""Served tokens equal plain transformers ``generate`` on the same checkpoint (tokens exact, log-probabilities within
1e-3) for every tiny variant (Qwen2-VL, Qwen2.5-VL, Qwen3-VL with M-RoPE; LLaVA with 1-D positions), driving an in-process rank over real Step streams: no prefix hit, a hit whose covered
images travel stripped, an image straddling the computed boundary, chunked prefill across an image, two requests
with different hits in one batch; and a negative control proving the comparison can fail."""

from __future__ import annotations

import pytest

from mmcast.v1 import worker_pb2
from tests.support.worker_driver import MiniScheduler, noise_image, oracle, with_pixels_replaced

TOL = 1e-3


def assert_matches(req, reference) -> None:
    tokens, logprobs = reference
    assert req.outputs == tokens
    diffs = [abs(a - b) for a, b in zip(req.logprobs, logprobs, strict=True)]
    assert max(diffs) <= TOL, diffs


# (offset, length) of the two images of ``two_image_prompt``, by family. Qwen-VL: image 1 112x84 -> grid (1, 6, 8)
# -> 12 tokens at [28, 40); image 2 56x56 -> 4 tokens at [49, 53). LLaVA: every image is cropped to 42x42 -> 9 tokens.
TWO_IMAGE_SPANS = {"llava": [(28, 9), (46, 9)]}
QWEN_SPANS = [(28, 12), (49, 4)]


def two_image_prompt(env, seed=0, text="What is in this picture and"):
    return env.prompt([noise_image(seed + 1, 112, 84), text, noise_image(seed + 2, 56, 56), "that one?"])


@pytest.fixture
def sched(worker_env):
    stream = worker_env.rank.stream(worker_env.model_dir)
    yield MiniScheduler([stream], uses_mrope=worker_env.rank.worker.runner.uses_mrope)
    stream.close()


def test_no_prefix_hit(worker_env, sched):
    prompt = two_image_prompt(worker_env)
    family = worker_env.rank.worker.runner.family.name
    spans = [(f.mm_position.offset, f.mm_position.length) for f in prompt.features]
    assert spans == TWO_IMAGE_SPANS.get(family, QWEN_SPANS)
    req = sched.add(prompt, "a")
    sched.run([req])
    assert_matches(req, oracle(worker_env.model, prompt))


def test_prefix_hit_covering_stripped_images_sends_no_payload(worker_env, sched):
    # both images end before token 48: a 3-block hit covers them
    prompt = worker_env.prompt([noise_image(7, 112, 84), noise_image(8, 56, 56), "Describe both images in detail."])
    assert max(f.mm_position.end for f in prompt.features) <= 48 < len(prompt.token_ids)
    first = sched.add(prompt, "fill")
    sched.run([first])  # fills the KV blocks
    sched.evict_everything()  # the rank now holds neither payloads nor encoder outputs
    payload_bytes = sched.sent["payload"]
    second = sched.add(prompt, "hit", hit_from=first, hit_blocks=3)
    sched.run([second])
    assert sched.sent["payload"] == payload_bytes, "a covered image's payload was sent"
    assert set(sched.stripped_ids) == {f.identifier for f in prompt.features}
    # What a covered item carries to the rank: M-RoPE families keep exactly their grids (positions of every later
    # token need them); a family with 1-D positions sends no field at all, only identifier and placeholder range.
    kept = [sorted(field.name for field in msg.fields) for msg in sched.stripped_msgs]
    if worker_env.rank.worker.runner.uses_mrope:
        assert kept == [["image_grid_thw"]] * 2
    else:
        assert kept == [[]] * 2
    reference = oracle(worker_env.model, prompt)
    assert_matches(first, reference)
    assert_matches(second, reference)


def test_image_straddling_the_computed_boundary(worker_env, sched):
    prompt = two_image_prompt(worker_env, seed=10)
    first = sched.add(prompt, "fill")
    sched.run([first])
    sched.evict_everything()
    sent_before = len(sched.sent_payload_ids)
    second = sched.add(prompt, "straddle", hit_from=first, hit_blocks=2)  # 32 computed; image 1 is [28, 40)
    sched.run([second])
    # image 1 is encoded whole again (its tail rows are used), so its payload travels; image 2 too
    assert sched.sent_payload_ids[sent_before:] == [f.identifier for f in prompt.features]
    assert sched.stripped_ids == []
    assert_matches(second, oracle(worker_env.model, prompt))


def test_chunked_prefill_across_an_image(worker_env, sched):
    prompt = two_image_prompt(worker_env, seed=20)
    req = sched.add(prompt, "chunked", chunk=10)  # windows [20, 30) and [30, 40) split image 1
    sched.run([req])
    prefill_steps = -(-len(prompt.token_ids) // 10)
    assert len(sched.results) == prefill_steps + 7 + 1  # prefill, 7 decode steps, the finish
    assert_matches(req, oracle(worker_env.model, prompt))


def test_two_requests_batched_with_different_hits(worker_env, sched, monkeypatch):
    runner = worker_env.rank.worker.runner
    batches = []  # per forward: the window length of every request in it
    original = runner.forward
    monkeypatch.setattr(
        runner, "forward", lambda items: batches.append([len(i.token_ids) for i in items]) or original(items)
    )
    shared = two_image_prompt(worker_env, seed=30)
    other = two_image_prompt(worker_env, seed=40, text="Compare the colours of this picture and")
    first = sched.add(shared, "fill")
    sched.run([first])
    batches.clear()
    a = sched.add(shared, "hit2", hit_from=first, hit_blocks=2)
    b = sched.add(other, "cold", chunk=24)
    sched.run([a, b])  # one forward per step: prefill chunks beside decode tokens, then decodes of unequal contexts
    batches = [lengths for lengths in batches if lengths]  # the finishing step computes nothing
    assert [len(b) for b in batches[:4]] == [2, 2, 2, 2]  # both requests' windows in each step's one forward
    assert any(1 in lengths and max(lengths) > 1 for lengths in batches)  # a decode token packed with a prefill chunk
    assert_matches(a, oracle(worker_env.model, shared))
    assert_matches(b, oracle(worker_env.model, other))


def test_negative_control_changed_pixels_change_logprobs(worker_env, sched):
    prompt = two_image_prompt(worker_env, seed=50)
    changed = with_pixels_replaced(prompt, 0, seed=99)
    req = sched.add(changed, "changed")
    sched.run([req])
    _, logprobs = oracle(worker_env.model, prompt)
    assert max(abs(a - b) for a, b in zip(req.logprobs, logprobs, strict=True)) > TOL


def test_resumed_request_continues_identically(worker_env, sched):
    """Preempted after 16 tokens, resumed as a new request (outputs appended to its prompt, a prefix hit that
    reaches into them): greedy tokens still equal the oracle, and seeded sampling repeats its draws."""
    prompt = two_image_prompt(worker_env, seed=60)
    reference = oracle(worker_env.model, prompt, max_new_tokens=20)
    for sampling in (None, worker_pb2.WorkerSampling(temperature=1.0, top_p=0.95, seed=11, return_logprobs=True)):
        whole = sched.add(prompt, f"whole-{bool(sampling)}", max_new_tokens=20, sampling=sampling)
        sched.run([whole])
        first = sched.add(prompt, f"first-{bool(sampling)}", max_new_tokens=16, sampling=sampling)
        sched.run([first])  # then preempted: the ranks drop it
        sched.evict_everything()
        hit = (len(prompt.token_ids) + 15) // 16  # full blocks of the 66 + 15 computed tokens: into the outputs
        assert hit * 16 > len(prompt.token_ids)
        resumed = sched.add(
            prompt,
            f"resumed-{bool(sampling)}",
            max_new_tokens=20,
            sampling=sampling,
            outputs=first.outputs,
            hit_from=first,
            hit_blocks=hit,
        )
        sched.run([resumed])
        assert resumed.outputs == whole.outputs
        assert first.outputs == whole.outputs[:16]
        if sampling is None:
            assert_matches(whole, reference)
            assert resumed.outputs == reference[0]
            diffs = [abs(a - b) for a, b in zip(resumed.logprobs, reference[1][16:], strict=True)]
            assert max(diffs) <= TOL


def test_encoder_rows_the_rank_keeps_carry_no_autograd_graph(worker_env, sched, monkeypatch):
    # Rows kept in the encoder cache with a grad_fn would pin the vision tower's saved activations until eviction:
    # at Qwen2-VL-2B's widths ~1.5 GB per 1280x720 image (benchmarks/rank/rank_memory.py measures the rank's peak).
    runner = worker_env.rank.worker.runner
    kept = []
    encode = runner.encode
    monkeypatch.setattr(runner, "encode", lambda feature: kept.append(encode(feature)) or kept[-1])
    prompt = two_image_prompt(worker_env, seed=40)
    req = sched.add(prompt, "graph")
    sched.run([req])
    assert len(kept) == 2
    assert all(rows.grad_fn is None and not rows.requires_grad for rows in kept)
    assert not [name for name, p in runner.model.named_parameters() if p.requires_grad]
    assert_matches(req, oracle(worker_env.model, prompt))


def test_deepstack_levels_reach_the_decoder(worker_env_for):
    """Qwen3-VL: the rank's encoder rows carry both DeepStack levels and the decoder adds them (the oracle match
    above depends on it): served without them, the same request leaves the oracle's log-probabilities."""
    env = worker_env_for("qwen3_vl")
    runner = env.rank.worker.runner
    assert (runner.hidden, runner.row_width) == (128, 3 * 128)
    stream = env.rank.stream(env.model_dir)
    sched = MiniScheduler([stream])
    prompt = two_image_prompt(env, seed=70)
    reference = oracle(env.model, prompt)
    served = sched.add(prompt, "deepstack")
    sched.run([served])
    assert_matches(served, reference)
    sched.evict_everything()
    family = runner.family
    original = family.text_model_kwargs
    try:
        family.text_model_kwargs = lambda *args: {}  # the merged rows still replace the placeholders
        without = sched.add(prompt, "no-deepstack")
        sched.run([without])
    finally:
        family.text_model_kwargs = original
        stream.close()
    assert max(abs(a - b) for a, b in zip(without.logprobs, reference[1], strict=True)) > TOL


@pytest.fixture
def sched_q2(worker_env_q2):
    stream = worker_env_q2.rank.stream(worker_env_q2.model_dir)
    yield MiniScheduler([stream], uses_mrope=True)
    stream.close()


def test_resumed_request_is_penalized_as_before(worker_env_q2, sched_q2):
    """Penalties count a resumed request's regenerated tokens as output (NewRequest.num_output_tokens): preempted
    after 10 tokens and resumed, it continues with the tokens the uninterrupted request produced."""
    env, sched = worker_env_q2, sched_q2
    prompt = two_image_prompt(env, seed=70)
    sampling = worker_pb2.WorkerSampling(
        temperature=0.0,
        top_p=1.0,
        return_logprobs=True,
        presence_penalty=0.5,
        frequency_penalty=1.5,
        repetition_penalty=1.3,
        logit_bias_token_ids=[5],
        logit_bias_values=[-3.0],
    )
    whole = sched.add(prompt, "pen-whole", max_new_tokens=16, sampling=sampling)
    sched.run([whole])
    assert whole.outputs != oracle(env.model, prompt, max_new_tokens=16)[0], "the penalties must change the answer"
    first = sched.add(prompt, "pen-first", max_new_tokens=10, sampling=sampling)
    sched.run([first])
    sched.evict_everything()
    resumed = sched.add(prompt, "pen-resumed", max_new_tokens=16, sampling=sampling, outputs=first.outputs)
    sched.run([resumed])
    assert resumed.outputs == whole.outputs
