"""The decisions of ``n`` > 1 (scheduler_svc/doors/openai_choices.py) without a server: each choice's request and seed,
and the usage OpenAI's way (prompt once, completion tokens summed, the largest prefix hit)."""

from __future__ import annotations

import dataclasses
import types

from scheduler_svc.doors.openai_choices import follower_request, usage
from scheduler_svc.engine.completion import CompletionRequest
from scheduler_svc.engine.request_input import SamplingSpec

SPEC = SamplingSpec(
    max_tokens=4, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=(), stop_token_ids=(), ignore_eos=False,
    logprobs=0, return_logprobs=False,
)  # fmt: skip


def _req(seed):
    return CompletionRequest(client_id="abc", tenant="t", sampling=dataclasses.replace(SPEC, seed=seed), received=0.0)


def test_followers_get_their_own_id_and_seed_plus_index():
    assert follower_request(_req(10), 2).client_id == "abc.2"
    assert follower_request(_req(10), 2).sampling.seed == 12
    assert follower_request(_req(2**64 - 1), 1).sampling.seed == 0  # modulo 2^64, as the ranks reduce seeds
    assert follower_request(_req(None), 3).sampling.seed is None  # unseeded: the server picks one per choice
    assert follower_request(_req(10), 1).prompt == _req(10).prompt and _req(10).client_id == "abc"


def test_usage_counts_the_prompt_once_and_every_choice_s_tokens():
    def done(prompt, completion, cached):
        summary = types.SimpleNamespace(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)
        return types.SimpleNamespace(result=types.SimpleNamespace(summary=summary))

    got = usage([done(40, 5, 0), done(40, 3, 32), done(40, 6, 32)])
    assert got == {
        "prompt_tokens": 40,
        "completion_tokens": 14,
        "total_tokens": 54,
        "prompt_tokens_details": {"cached_tokens": 32},
    }


def test_the_body_s_penalties_reach_the_shared_proto_and_odd_keys_are_refused():
    import pytest

    from mmcast.v1 import generation_pb2
    from scheduler_svc.doors import openai_sampling, openai_schema
    from scheduler_svc.doors.openai_errors import HttpError

    def body(**kw):
        return openai_schema.CompletionBody.model_validate({"model": "m", "prompt": "x", **kw})

    p = generation_pb2.SamplingParams()
    openai_sampling.penalties_into(
        body(
            presence_penalty=0.5, repetition_penalty=1.25, logit_bias={"7": -3, " 9": 2}, min_tokens=2, bad_words=["a"]
        ),
        p,
    )
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (0.5, 0.0, 1.25, 2)
    assert dict(p.logit_bias) == {7: -3.0, 9: 2.0} and list(p.bad_words) == ["a"]
    assert not generation_pb2.SamplingParams().HasField("repetition_penalty")
    for key in ("x", "1.5", "99999999999"):
        with pytest.raises(HttpError) as err:
            openai_sampling.penalties_into(body(logit_bias={key: 1}), generation_pb2.SamplingParams())
        assert err.value.param == "logit_bias" and "not a token id" in err.value.message
    with pytest.raises(HttpError) as err:
        openai_sampling.check_choices(body(n=9), 8)
    assert err.value.param == "n" and "--max-choices" in err.value.message
    with pytest.raises(HttpError) as err:
        openai_sampling.check_choices(body(n=2, best_of=3), 8)
    assert err.value.param == "best_of"
    openai_sampling.check_choices(body(n=3, best_of=3), 8)  # equal: served
