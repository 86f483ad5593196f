"""The rank-engine report's arithmetic (benchmarks/rank/rank_engine_report.py): phase rates, the decode ratio, the
step time per attended token; and the job filter of its command line (benchmarks/rank/rank_engine.py)."""

from __future__ import annotations

import pytest

from benchmarks.rank import rank_engine, rank_engine_report


def _side(prefill_s, decode_tokens, decode_s, **extra):
    return {
        "prompt_tokens": 1600,
        "new_tokens": 160,
        "prefill_seconds": prefill_s,
        "decode_tokens": decode_tokens,
        "decode_seconds": decode_s,
        **extra,
    }


def test_rates_ratio_and_attended_token_cost_follow_the_measured_times():
    served = _side(4.0, 150, 3.0, rank_step_ms=200.0)
    plain = _side(5.0, 150, 6.0, step_ms=400.0)
    assert rank_engine_report.rate(served, "prefill") == 400.0 and rank_engine_report.rate(served, "decode") == 50.0
    assert rank_engine_report.rate(plain, "total") == pytest.approx(160 / 11.0)
    row = {
        "width": "2b",
        "job": "equal",
        "n": 16,
        "new_tokens": 10,
        "mean_prompt": 100.0,
        "attended": 1680.0,
        "served": served,
        "plain": plain,
        "requests_equal": 15,
    }
    text = rank_engine_report.tables({"rows": [row]})
    assert "| 2B | equal | 16 | 100 | 400 / 320 | 50.0 | 25.0 | **2.00×** |" in text
    assert "| 15/16 |" in text
    # 200 ms over 1680 attended tokens: 119.05 µs each; the static batch's 400 ms: 238.10 µs.
    assert "| 2B | 100 | 200.0 | 400.0 | 119.05 | 238.10 | 0.50 |" in text


def test_the_job_filter_refuses_a_name_the_plan_lacks(capsys):
    with pytest.raises(SystemExit) as info:
        rank_engine.main(["--quick", "--jobs", "equal:3"])
    assert info.value.code == 2 and "no job of the plan matches" in capsys.readouterr().err
