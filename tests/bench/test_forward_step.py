"""The forward-step benchmark (benchmarks/rank/forward_step.py) on the tiny model with short steps: every variant
runs every step, this tree's backends agree with a baseline checkout (this one) on the logits, a broken attention
shows in the figures, and the table renders. No timing is asserted."""

from __future__ import annotations

import os

from benchmarks.rank import forward_step as bench
from worker_svc import attention_backends

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Halved(attention_backends.CpuBackend):
    def attend(self, plan, layer, query, scaling):
        return super().attend(plan, layer, query, scaling * 0.5)


def _short(monkeypatch):
    for name, value in (("PREFILL", 40), ("PREFIX", 16), ("DECODES", 4), ("CONTEXT", 48)):
        monkeypatch.setattr(bench, name, value)


def test_every_variant_runs_every_step_and_agrees(tiny_model_dir, monkeypatch):
    _short(monkeypatch)
    variants = {"baseline": bench.BaselineBackend(ROOT), "cpu": "cpu", "sdpa": "sdpa", "halved": Halved()}
    records = bench.measure(str(tiny_model_dir), variants, repeats=1, log=lambda *_: None)
    assert [(r["step"], r["variant"]) for r in records] == [
        (step, v) for step in ("prefill 40", "prefill 40 after 16", "decode N=4 @48") for v in variants
    ]
    for r in records:
        if r["variant"] == "halved":  # a wrong attention must not read as equal
            assert r["max_logit_diff"] > 1e-3
        else:
            assert r["max_logit_diff"] < 1e-4 and r["greedy_equal"] and r["ms"] > 0
    text = bench.table(records)
    assert text.count("\n") == 1 + len(records) and "| decode N=4 @48 | sdpa |" in text
