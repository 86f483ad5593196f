"""README.md's table of OpenAI request parameters is what scripts/openai_params_doc.py generates from the request
schema and the HTTP door's own answers, so a parameter served, refused or added cannot leave the table behind."""

from __future__ import annotations

import pytest

from scripts.openai_params_doc import README, render, statuses


@pytest.fixture(scope="module")
def table():
    return statuses()


def test_the_parameter_table_is_generated(table):
    current = README.read_text()
    fresh = render(current, table)
    if fresh != current:
        changed = [line for line in fresh.splitlines() if line not in current.splitlines()][:5]
        raise AssertionError(
            "README.md's OpenAI parameter table is stale: run `.venv/bin/python scripts/openai_params_doc.py` and "
            f"commit the result. First generated lines not in the file: {changed}"
        )


def test_the_table_sees_a_refusal_and_a_served_parameter(table):
    """The probe itself: a parameter the door refuses and one it serves come out as such (a probe that answered
    "served" for everything would pass the test above forever)."""
    assert table["suffix"]["/v1/completions"] == "refused" and table["tools"]["/v1/responses"] == "refused"
    assert table["temperature"]["/v1/responses"] == "served" and table["user"]["/v1/completions"] == "ignored"
