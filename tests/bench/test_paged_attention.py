"""The paged-attention benchmark (benchmarks/rank/paged_attention.py): its quick plan runs, checks both tables' outputs
against plain attention, and renders; a baseline tree is loaded beside this one. No timing is asserted."""

from __future__ import annotations

import os

import pytest

from benchmarks.rank import paged_attention as bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_plan_checks_both_tables_and_renders_side_by_side(monkeypatch):
    monkeypatch.setattr(bench, "WIDTHS", {"head64": (4, 2, 16)})  # small heads keep the test quick
    records = bench.measure(quick=True, baseline_tree=ROOT, log=lambda *_: None)
    assert {(r["tree"], r["table"]) for r in records} == {
        (t, k) for t in ("this", "baseline") for k in ("contiguous", "fragmented")
    }
    assert {r["runs"] for r in records if r["table"] == "contiguous"} == {1}
    assert min(r["runs"] for r in records if r["table"] == "fragmented") > 1
    text = bench.table(records)
    assert text.count("\n") == 1 + 4 and "baseline fragmented / contiguous" in text


def test_a_wrong_attention_fails_the_run(monkeypatch):
    monkeypatch.setattr(bench, "WIDTHS", {"head64": (4, 2, 16)})
    real = bench.load(None)

    class Broken:
        plan_step = staticmethod(real.plan_step)

        @staticmethod
        def _attend(q, k, v, span, scaling):
            return real._attend(q, k, v, span, scaling * 1.5)

    monkeypatch.setattr(bench, "load", lambda tree: Broken if tree else real)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        bench.measure(quick=True, baseline_tree="x", log=lambda *_: None)
