"""Fixtures of the OpenAI-door tests: the real ``openai`` client on the suite's shared TP=2 serve-local group."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def api(serve_local_tp2):
    with openai.OpenAI(base_url=serve_local_tp2.openai_base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(api):
    return api.models.list().data[0].id
