"""The README shows a real run of `mmcast demo`: its output stands between the markers that
scripts/refresh_demo_output.py rewrites, and has the demo's shape (the figures are a run's own and are not checked)."""

from __future__ import annotations

from scripts.refresh_demo_output import BEGIN, END, README, demo_lines, shape_errors

FIX = "run `.venv/bin/python scripts/refresh_demo_output.py` (it runs the demo) and commit the README"


def test_readme_has_the_demo_markers_once():
    readme = README.read_text()
    assert readme.count(BEGIN) == 1 and readme.count(END) == 1, f"README.md needs one {BEGIN} and one {END}: {FIX}"
    assert readme.index(BEGIN) < readme.index(END)
    assert readme.index("## The demo") < readme.index(BEGIN), "the demo's output belongs under '## The demo'"


def test_readme_demo_output_has_the_demos_shape():
    lines = demo_lines(README.read_text())
    errors = shape_errors(lines)
    assert not errors, "README.md's demo block is not the demo's output:\n" + "\n".join(errors) + f"\n{FIX}"


def test_the_shapes_match_what_the_demo_prints():
    """The patterns follow mmcast_local/demo.py's own formatting (a row made by format_row, the header it prints)."""
    from types import SimpleNamespace

    from mmcast_local.demo import HEADER, format_row
    from mmcast_local.progress import human_bytes

    usage = SimpleNamespace(
        images=3,
        prompt_tokens=3744,
        cached_tokens=2480,
        payload_bytes_broadcast=134_451,
        payload_bytes_full=883_814,
        payload_bytes_saved=749_363,
    )
    row = format_row(3, SimpleNamespace(usage=usage, ttft_seconds=0.762))
    lines = [
        "local group ready in 24.9 s: scheduler 127.0.0.1:31991, TP=2, transfer mode lazy, model ~/.cache/m",
        HEADER,
        format_row(1, SimpleNamespace(usage=SimpleNamespace(**{**vars(usage), "images": 1}), ttft_seconds=1.5)),
        format_row(2, SimpleNamespace(usage=SimpleNamespace(**{**vars(usage), "images": 2}), ttft_seconds=0.5)),
        row,
        f"payload broadcast over 3 turns: {human_bytes(1_234_567)} (the full transfer mode: {human_bytes(10 << 30)})",
        "answer of turn 3: ' roof'",
    ]
    assert shape_errors(lines) == []
