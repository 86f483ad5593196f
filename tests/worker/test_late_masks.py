"""Late token masks on an in-process rank (``StepControl.masks_follow``, ``LateTokenMasks``, ``prior_masks``), with the
step's forward on the compute thread and on the event loop's: rank 0
runs the step, answers keepalives while it waits for the masks, and draws under them (an announced request without a
mask draws unmasked); masks in the next control are taken while the step runs and that control is applied after the
answer, with the tokens a synchronous scheduler would get; a frame for another step, a mask for a request not announced, a second one, one of the wrong size, a
frame of a later step before the masks, masks no step waits for and masks that never come are protocol errors
naming the field, after which the rank keeps serving."""

from __future__ import annotations

import pytest

from mmcast.v1 import worker_pb2
from tests.support.worker_driver import MiniScheduler, serves_a_request
from worker_svc.inline_steps import InlineSteps, step_tokens
from worker_svc.step_errors import code
from worker_svc.token_mask import mask_nbytes

GREEDY = worker_pb2.WorkerSampling(temperature=0.0, top_p=1.0, return_logprobs=True)


class _EveryStepInline(InlineSteps):
    """Every step of running requests alone on the event loop's thread, measured or not."""

    def fits(self, control) -> bool:
        return step_tokens(control) is not None


@pytest.fixture(params=["compute", "event_loop"])
def env(worker_env_q2, request):
    """The rank, running its decode steps on the thread the parameter names (``worker_svc/inline_steps.py``)."""
    worker = worker_env_q2.rank.worker
    before = worker.inline, worker.loop_computes
    on_loop = request.param == "event_loop"  # the forward, and the sampling under the late masks
    worker.inline, worker.loop_computes = (_EveryStepInline(1.0) if on_loop else InlineSteps(0.0)), on_loop
    yield worker_env_q2
    worker.inline, worker.loop_computes = before


@pytest.fixture
def prompt(env):
    return env.prompt(["Count the stars in the sky, one by one."])


def frame(**kind) -> bytes:
    return worker_pb2.StepRequest(**kind).SerializeToString()


def keepalive(n: int) -> bytes:
    return frame(keepalive=worker_pb2.Keepalive(sent_unix_nanos=n))


def late(step_id: int, masks: dict[str, bytes]) -> bytes:
    msgs = [worker_pb2.TokenMask(request_id=rid, allowed=m) for rid, m in masks.items()]
    return frame(late_token_masks=worker_pb2.LateTokenMasks(step_id=step_id, masks=msgs))


def only(env, token: int) -> bytes:
    bits = bytearray(mask_nbytes(env.rank.worker.runner.vocab_size))
    bits[token // 8] |= 1 << (token % 8)
    return bytes(bits)


def prefilled(env, prompt, rids=("a", "b")):
    """A stream whose requests ``rids`` were prefilled (one token each): the next step is a decode step."""
    stream = env.rank.stream(env.model_dir)
    sched = MiniScheduler([stream])
    reqs = [sched.add(prompt, rid, max_new_tokens=8, sampling=GREEDY) for rid in rids]
    sched.step(reqs)
    return stream, sched, reqs


def decode(sched, reqs, follow=()) -> worker_pb2.StepControl:
    """The next decode step's control, announcing ``follow``; the driver's requests advance as if it ran."""
    _payloads, control, plan = sched.build_step(reqs)
    control.masks_follow.extend(follow)
    for req, end, _produces in plan:
        req.computed = end
    return control


def test_rank_0_answers_keepalives_while_it_waits_and_draws_under_the_late_masks(env, prompt):
    stream, sched, reqs = prefilled(env, prompt)
    ref = sched.step(reqs)[0].step_result  # the same decode step without any mask: the greedy tokens
    greedy = {t.request_id: t.token_id for t in ref.sampled}
    stream.close()

    stream, sched, reqs = prefilled(env, prompt)
    forced = (greedy["a"] + 1) % env.rank.worker.runner.vocab_size  # not the greedy token: the mask must act
    control = decode(sched, reqs, follow=["a", "b"])
    stream.send(frame(control=control))
    stream.send(keepalive(7))
    assert stream.recv().keepalive.sent_unix_nanos == 7  # answered while the step waits for its masks
    stream.send(late(control.step_id, {"a": only(env, forced)}))  # "b" announced, no mask: it draws unmasked
    result = stream.recv().step_result
    got = {t.request_id: t.token_id for t in result.sampled}
    assert result.step_id == control.step_id and got == {"a": forced, "b": greedy["b"]}
    for req in reqs:
        req.outputs.append(got[req.rid])
    sched.step(reqs)  # the stream goes on with the next step
    stream.close()


def test_masks_in_the_next_control_are_taken_and_that_control_applied_after_the_answer(env, prompt):
    forced = 9
    # the synchronous way: the mask in the step's own control, the next step told the token
    stream, sched, reqs = prefilled(env, prompt)
    control = decode(sched, reqs)
    control.token_masks.add(request_id="a", allowed=only(env, forced))
    stream.send(frame(control=control))
    first = {t.request_id: t.token_id for t in stream.recv().step_result.sampled}
    for req in reqs:
        req.outputs.append(first[req.rid])
    want = {t.request_id: t.token_id for t in sched.step(reqs)[0].step_result.sampled}
    stream.close()
    # async: step k+1 announces the mask, step k+2 (input: k+1's own tokens) carries it in prior_masks
    stream, sched, reqs = prefilled(env, prompt)
    k1 = decode(sched, reqs, follow=["a"])
    k2 = worker_pb2.StepControl(step_id=k1.step_id + 1)
    for req in reqs:
        blocks = sched.alloc(-(-(req.computed + 2) // 16) - len(req.block_ids))
        req.block_ids += blocks
        k2.running.add(
            request_id=req.rid, new_block_ids=blocks, num_computed_tokens=req.computed, num_scheduled_tokens=1,
            input_is_last_sampled=True,
        )  # fmt: skip
    k2.prior_masks.step_id = k1.step_id
    k2.prior_masks.masks.add(request_id="a", allowed=only(env, forced))
    stream.send(frame(control=k1))
    stream.send(frame(control=k2))
    r1, r2 = stream.recv().step_result, stream.recv().step_result
    assert (r1.step_id, r2.step_id) == (k1.step_id, k2.step_id)
    assert {t.request_id: t.token_id for t in r1.sampled} == first  # "a" forced, "b" greedy
    assert {t.request_id: t.token_id for t in r2.sampled} == want
    stream.close()


def _wrong_frames(env, control):
    """The frames each refusal case sends after ``control`` (which announced "a"), and the expected error."""
    sid = control.step_id
    mask = only(env, 5)
    return {
        "other-step": ([late(sid + 1, {"a": mask})], code.STATE_MISMATCH, f"late_token_masks.step_id={sid + 1}"),
        "not-announced": ([late(sid, {"b": mask})], code.STATE_MISMATCH, f"not in step {sid}'s masks_follow"),
        "twice": (
            [
                frame(
                    late_token_masks=worker_pb2.LateTokenMasks(
                        step_id=sid,
                        masks=[worker_pb2.TokenMask(request_id="a", allowed=mask)] * 2,
                    )
                )
            ],
            code.STATE_MISMATCH,
            "a second mask for request a",
        ),
        "size": ([late(sid, {"a": mask[:4]})], code.OUT_OF_RANGE, "late_token_masks.masks[0]: 4 bytes"),
        "later-frame": (
            [frame(control=worker_pb2.StepControl(step_id=sid + 1))],
            code.STATE_MISMATCH,
            f"a control frame came while step {sid} waits for its late token masks",
        ),
    }


@pytest.mark.parametrize("case", ["other-step", "not-announced", "twice", "size", "later-frame"])
def test_wrong_late_masks_are_protocol_errors_and_the_rank_keeps_serving(env, prompt, case):
    before = env.rank.metrics.protocol_errors.labels(code="STATE_MISMATCH")._value.get()
    stream, sched, reqs = prefilled(env, prompt)
    control = decode(sched, reqs, follow=["a"])
    frames, want, needle = _wrong_frames(env, control)[case]
    stream.send(frame(control=control))
    for f in frames:
        stream.send(f)
    reply = stream.recv()
    assert reply.WhichOneof("frame") == "error", reply
    assert (reply.error.code, reply.error.step_id) == (want, control.step_id) and needle in reply.error.message
    stream.close()
    if want == code.STATE_MISMATCH:
        assert env.rank.metrics.protocol_errors.labels(code="STATE_MISMATCH")._value.get() == before + 1
    serves_a_request(env, prompt)


@pytest.mark.parametrize("where", ["late_token_masks", "prior_masks"])
def test_late_masks_no_step_waits_for_are_refused(env, prompt, where):
    stream, sched, reqs = prefilled(env, prompt)
    masks = worker_pb2.LateTokenMasks(step_id=sched.step_id, masks=[worker_pb2.TokenMask(request_id="a")])
    if where == "late_token_masks":  # the step it names was answered, without masks_follow
        stream.send(frame(late_token_masks=masks))
    else:  # a control carrying them while no step runs
        stream.send(frame(control=worker_pb2.StepControl(step_id=sched.step_id + 1, prior_masks=masks)))
    error = stream.recv().error
    assert error.code == code.STATE_MISMATCH and error.step_id == sched.step_id
    assert f"{where} for step {sched.step_id}: no step of this stream waits for late masks" in error.message
    stream.close()
    serves_a_request(env, prompt)


def test_masks_follow_must_name_requests_the_step_samples(env, prompt):
    stream, sched, reqs = prefilled(env, prompt)
    for follow, needle in [(["ghost"], "masks_follow[0]: request ghost is not sampled"), (["a", "a"], "twice")]:
        control = decode(sched, reqs, follow=follow)
        stream.send(frame(control=control))
        error = stream.recv().error
        assert error.code == code.STATE_MISMATCH and needle in error.message, error.message
        stream.close()
        stream, sched, reqs = prefilled(env, prompt)
    stream.close()


def test_masks_that_never_come_fail_the_step_after_the_rank_s_bound(env, prompt):
    stream, sched, reqs = prefilled(env, prompt)
    env.rank.worker.active.session.late_mask_timeout = 0.3  # --late-mask-timeout-seconds of this stream
    control = decode(sched, reqs, follow=["a"])
    stream.send(frame(control=control))
    error = stream.recv(timeout=30).error
    assert error.code == code.STATE_MISMATCH and error.step_id == control.step_id
    assert "did not come within 0.3 s (--late-mask-timeout-seconds)" in error.message
    stream.close()
    serves_a_request(env, prompt)


def test_the_handshake_acknowledges_late_masks(env):
    stream = env.rank.stream(env.model_dir)
    assert stream.ack.handshake_ack.late_token_masks
    stream.close()
