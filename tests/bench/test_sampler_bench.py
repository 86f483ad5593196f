"""The sampler benchmark (benchmarks/rank/sampler.py): every mix runs through both samplers, the greedy rows agree, the
table renders; a sampler whose greedy token differs fails the run. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks.rank import sampler as bench
from benchmarks.rank import sampler_per_row


def test_every_mix_runs_through_both_samplers_and_renders(tmp_path):
    bench.main(["--vocabs", "64", "--ns", "1,4", "--repeats", "1", "--out", str(tmp_path)])
    records = json.loads((tmp_path / "sampler.json").read_text())["records"]
    assert [(r["n"], r["mix"]) for r in records] == [(n, m) for n in (1, 4) for m in bench.MIXES]
    assert all(r["new_step_ms"] > 0 and r["old_step_ms"] > 0 for r in records)
    assert (tmp_path / "sampler.md").read_text().count("\n") == 2 + len(records)


def test_a_greedy_token_that_differs_fails_the_run(monkeypatch):
    real = sampler_per_row.sample_batch

    def off_by_one(logits, params, *args, **kwargs):
        return [
            type(s)((s.token_id + 1) % logits.shape[1], s.logprob, s.top_logprobs)
            for s in real(logits, params, *args, **kwargs)
        ]

    monkeypatch.setattr(sampler_per_row, "sample_batch", off_by_one)
    with pytest.raises(AssertionError, match="greedy tokens differ"):
        bench.measure([64], [2], 1)
