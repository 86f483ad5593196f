"""README.md stays a page a newcomer reads to the end, and every command in it is one that something runs.

The commands are the lines of its shell blocks (```bash): each is listed in ``RUN_BY`` with the file that runs it
(CI's entry point or a test) and a string of that file that shows it does; a README command not listed there, or a
listed one the README dropped, fails. Besides, every `mmcast` command line of a shell block parses with the real
command line, every `mmcast` command named inline is a real sub-command with real options, and every `make` target
named anywhere in the README exists in the Makefile. The README's Python blocks run against a served group in
tests/service/test_readme_examples.py.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from mmcast_client import cli

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 320

# README shell command -> (the file that runs it, a string of that file showing it does).
RUN_BY = {
    "make demo": ("tests/service/test_readme_examples.py", '["demo", "--target"'),
    "make test": (".ci/run", "make test"),
    "mmcast make-tiny-model ./tiny": ("tests/client/test_cli_help.py", '"mmcast_client.cli", "make-tiny-model"'),
    "mmcast serve-local --model ./tiny --tp 2 --port 50051": (
        "tests/client/test_cli_local_group.py",
        '"mmcast_client.cli", "serve-local", "--model"',
    ),
    'mmcast generate --target localhost:50051 --image a.jpg --image b.png --max-tokens 32 "Compare the two pictures."': (
        "tests/client/test_distribution.py",
        '"mmcast", "generate", "--target"',
    ),
    "grpcurl -plaintext localhost:50051 list": ("tests/service/test_service_e2e_fake_ranks.py", '"list"]'),
    'grpcurl -plaintext -d \'{"service":"mmcast.v1.GenerationService"}\' localhost:50051 grpc.health.v1.Health/Check': (
        "tests/service/test_service_e2e_fake_ranks.py",
        '"grpc.health.v1.Health/Check"',
    ),
}
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`((?:mmcast|make) [^`]+)`")


def shell_commands(text: str) -> list[str]:
    """Each command of the shell blocks, its trailing comment dropped and continued lines joined."""
    commands = []
    for block in SHELL_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            command = " ".join(re.sub(r"\s#.*$", "", line).split())
            if command:
                commands.append(command)
    return commands


def subcommand_options() -> dict[str, set[str]]:
    parser = cli.build_parser(cli.discover_commands())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(p._option_string_actions) for name, p in sub.choices.items()}


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def test_the_readme_fits_a_newcomer_s_reading():
    lines = README.read_text().count("\n")
    assert lines <= MAX_LINES, (
        f"README.md has {lines} lines, more than {MAX_LINES}: move detail into docs/ (figures: docs/PERFORMANCE.md) "
        "and link to it"
    )


def test_every_readme_command_is_run_by_ci_or_a_test():
    commands = shell_commands(README.read_text())
    assert "make demo" in commands and "make test" in commands  # the scan reads the blocks
    unlisted = [c for c in commands if c not in RUN_BY]
    assert not unlisted, f"README commands nothing runs (run one in a test and add it to RUN_BY): {unlisted}"
    stale = [c for c in RUN_BY if c not in commands]
    assert not stale, f"RUN_BY lists commands the README no longer shows: {stale}"


@pytest.mark.parametrize("command", list(RUN_BY))
def test_the_file_named_runs_the_command(command):
    path, needle = RUN_BY[command]
    assert needle in (ROOT / path).read_text(), f"{path} no longer contains {needle!r}, so it may not run {command!r}"


def test_mmcast_commands_of_the_shell_blocks_parse():
    for command in shell_commands(README.read_text()):
        if command.startswith("mmcast "):
            cli.parse(shlex.split(command)[1:])  # argparse exits on a bad sub-command or option


def test_inline_commands_name_real_sub_commands_options_and_make_targets():
    options, targets, wrong = subcommand_options(), make_targets(), []
    for span in INLINE.findall(README.read_text()):
        words = span.split()
        if words[0] == "make":
            wrong += [f"{span}: no make target {w}" for w in words[1:] if w not in targets]
        elif words[1] not in options:
            wrong.append(f"{span}: no mmcast sub-command {words[1]}")
        else:
            flags = [w.split("=")[0] for w in words[2:] if w.startswith("--")]
            wrong += [f"{span}: {words[1]} has no option {f}" for f in flags if f not in options[words[1]]]
    assert not wrong, "\n".join(wrong)


def test_the_command_scan_reads_comments_and_continuations():
    text = "```bash\nmake demo   # a comment\nmmcast generate \\\n  --max-tokens 3 x\n```\n"
    assert shell_commands(text) == ["make demo", "mmcast generate --max-tokens 3 x"]
