"""The decisions of ``n`` > 1 (scheduler_svc/openai_choices.py) without a server: each choice's request and seed,
and the usage OpenAI's way (prompt once, completion tokens summed, the largest prefix hit)."""

from __future__ import annotations

import dataclasses
import types

from scheduler_svc.completion import CompletionRequest
from scheduler_svc.openai_choices import follower_request, usage
from scheduler_svc.request_parsing import SamplingSpec

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
