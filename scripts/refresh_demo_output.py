"""Runs ``mmcast demo`` and puts its output into the README, so the figures shown are a real run's.

    .venv/bin/python scripts/refresh_demo_output.py                # run the demo (1-2 minutes), rewrite the README
    .venv/bin/python scripts/refresh_demo_output.py --from FILE    # take the output of a run saved in FILE

The demo (``mmcast_local/demo.py``) builds the tiny model (here into a temporary folder), starts a local group with the default
settings and holds its growing conversation; its standard output replaces what stands between the
``<!-- demo-output:begin -->`` / ``<!-- demo-output:end -->`` markers of README.md, with a line saying when and
where it ran. The prose around the markers is kept: read the new figures and check that it still describes them.
Output that does not have the demo's shape (``LINE_SHAPES``; ``tests/docs/test_demo_output.py`` checks the README
with the same patterns) is refused, and the README is left alone.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- demo-output:begin -->", "<!-- demo-output:end -->"
_SIZE = r"\d+(?:\.\d)? (?:B|KiB|MiB|GiB)"
# The demo's output, line by line (the figures vary from run to run, the shape does not).
READY = re.compile(
    r"^local group ready in \d+\.\d s: scheduler \S+:\d+, TP=\d+, transfer mode (full|strip|lazy), "
    r"model \S+$"
)
HEADER = re.compile(r"^turn images prompt tok cached tok +TTFT +broadcast +full would +saved$")
ROW = re.compile(rf"^ *(\d+) +(\d+) +\d+ +\d+ +\d+ms +{_SIZE} +{_SIZE} +(\d+%|-)$")
TOTAL = re.compile(rf"^payload broadcast over (\d+) turns: {_SIZE} \(the full transfer mode: {_SIZE}\)$")
ANSWER = re.compile(r"^answer of turn (\d+): .*$")
LINE_SHAPES = (READY, HEADER, ROW, TOTAL, ANSWER)


def shape_errors(lines: list[str]) -> list[str]:
    """What keeps ``lines`` from being the demo's output: the ready line, the header, one row per turn (numbered
    from 1), the totals and the last answer. Empty when they are."""
    if len(lines) < 5:
        return [f"{len(lines)} lines; the demo prints at least 5"]
    errors = []
    ready, header, *rows, total, answer = lines
    for line, pattern, what in (
        (ready, READY, "ready line"),
        (header, HEADER, "table header"),
        (total, TOTAL, "totals line"),
        (answer, ANSWER, "answer line"),
    ):
        if not pattern.match(line):
            errors.append(f"{what} {line!r} does not match {pattern.pattern!r}")
    for n, row in enumerate(rows, 1):
        m = ROW.match(row)
        if not m:
            errors.append(f"row {n} {row!r} does not match {ROW.pattern!r}")
        elif int(m.group(1)) != n or int(m.group(2)) != n:
            errors.append(f"row {n} {row!r}: turn {n} has {n} image(s)")
    m = TOTAL.match(total)
    if m and int(m.group(1)) != len(rows):
        errors.append(f"the totals line counts {m.group(1)} turns; the table has {len(rows)}")
    return errors


def run_demo() -> str:
    """``mmcast demo``'s standard output, run with this checkout's code (first on PYTHONPATH, for the processes the
    demo starts too, whatever checkout the environment's console scripts were installed from)."""
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    print("running mmcast demo (1-2 minutes) ...", file=sys.stderr)
    # A model folder of its own: the default one (~/.cache/mmcast) may hold the tiny model of another checkout.
    with tempfile.TemporaryDirectory(prefix="mmcast-demo-") as folder:
        command = [
            sys.executable,
            "-c",
            "import sys; from mmcast_client.cli import main; sys.exit(main())",
            "demo",
            "--model-dir",
            str(Path(folder) / "tiny-qwen2-vl"),
        ]
        proc = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"mmcast demo exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return proc.stdout


def block(output: str) -> str:
    """The README's region: where the run was made, then the output as a code block (the home folder as ``~``)."""
    home = str(Path.home())
    lines = [line.rstrip().replace(home, "~") for line in output.strip().splitlines()]
    errors = shape_errors(lines)
    if errors:
        raise SystemExit("not the demo's output, README.md left alone:\n" + "\n".join(errors))
    stamp = (
        f"_A real run ({os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}), written here by `scripts/refresh_demo_output.py`:_"
    )
    return stamp + "\n\n```\n" + "\n".join(lines) + "\n```"


def demo_lines(readme: str) -> list[str]:
    """The lines of the code block between the README's markers."""
    region = readme.partition(BEGIN)[2].partition(END)[0]
    code = region.partition("```\n")[2].rpartition("\n```")[0]
    return code.splitlines()


def main(argv: list[str]) -> int:
    if argv and (argv[0] != "--from" or len(argv) != 2):
        print(__doc__, file=sys.stderr)
        return 2
    output = Path(argv[1]).read_text() if argv else run_demo()
    readme = README.read_text()
    head, found, rest = readme.partition(BEGIN)
    _, found_end, tail = rest.partition(END)
    if not found or not found_end:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} markers")
    README.write_text(f"{head}{BEGIN}\n{block(output)}\n{END}{tail}")
    print("README.md: demo output refreshed; check the prose around it against the new figures", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
