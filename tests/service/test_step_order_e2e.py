"""Requests that end while the next step is already on the ranks, through the real ``openai`` package, with
``--async-scheduling false`` (the suite's shared groups run the default, async scheduling, which
test_async_scheduling_e2e.py checks the same way).

The step loop writes step k+1 to the ranks before step k's tokens reach the clients, so a request whose end is
found in step k (its length, a stop token, a stop string found while detokenizing) has its next step already
scheduled. Each of them must still get exactly its tokens: plain transformers' greedy answer (tests/support/oracle.py)
cut where the request ends, never the token of the step that was in flight. They run together beside a longer
request, so every one of them ends inside a busy pipeline (``tests/support/pipeline_ends.py``).
"""

from __future__ import annotations

import openai
import pytest

from mmcast_local.supervisor import LocalGroup
from tests.support.oracle import Oracle, scrape
from tests.support.pipeline_ends import check_ends_in_a_busy_pipeline, expected_answer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from common.processor import load_processor

    return load_processor(tiny_model_dir).tokenizer


@pytest.fixture(scope="module")
def group(tiny_model_dir):
    with LocalGroup(tiny_model_dir, 1, "lazy", scheduler_args=["--async-scheduling", "false"], ready_timeout=240) as g:
        yield g


def test_requests_ending_in_a_busy_pipeline_get_exactly_their_tokens(group, tiny_model_dir, tokenizer):
    with openai.OpenAI(base_url=group.openai_base_url, api_key="unused", max_retries=0, timeout=120) as api:
        model = api.models.list().data[0].id
        check_ends_in_a_busy_pipeline(api, model, expected_answer(Oracle(tiny_model_dir)), tokenizer)
    # Every step waited for the previous one's answer.
    assert scrape(group.metrics_urls["scheduler"], "mmcast_steps_planned_ahead_total") == 0
