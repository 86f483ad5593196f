"""Requests that end while the next step is already on the ranks, through the real ``openai`` package against the
suite's shared ``serve-local`` TP=2 group.

The step loop writes step k+1 to the ranks before step k's tokens reach the clients, so a request whose end is
found in step k (its length, a stop token, a stop string found while detokenizing) has its next step already
scheduled. Each of them must still get exactly its tokens: plain transformers' greedy answer (tests/support/oracle.py)
cut where the request ends, never the token of the step that was in flight. They run together beside a longer
request, so every one of them ends inside a busy pipeline (``tests/support/pipeline_ends.py``).
"""

from __future__ import annotations

import pytest

from tests.support.oracle import Oracle
from tests.support.pipeline_ends import check_ends_in_a_busy_pipeline, expected_answer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from common.processor import load_processor

    return load_processor(tiny_model_dir).tokenizer


def test_requests_ending_in_a_busy_pipeline_get_exactly_their_tokens(api, model_name, tiny_model_dir, tokenizer):
    check_ends_in_a_busy_pipeline(api, model_name, expected_answer(Oracle(tiny_model_dir)), tokenizer)
