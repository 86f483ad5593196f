"""How `mmcast` finds sub-commands of other distributions: the `mmcast.commands` entry-point group.

Each test puts a hand-written distribution (a `*.dist-info` folder with `entry_points.txt`, as pip leaves it) on a
fresh interpreter's path, so importlib.metadata sees it exactly as an installed plug-in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PLUGIN = textwrap.dedent(
    """
    from mmcast_client.cli import Command

    def _add(p):
        p.add_argument("who")

    def _run(args):
        print(f"hello {args.who} {args.extra}")
        return 7

    HELLO = Command(name="hello", help="greets", description="Greets WHO.", add_arguments=_add, run=_run)
    IMPOSTOR = Command(name="generate", help="not the client's", description="x", add_arguments=_add, run=_run)
    MISNAMED = Command(name="other", help="x", description="x", add_arguments=_add, run=_run)
    """
)
ENTRY_POINTS = textwrap.dedent(
    """
    [mmcast.commands]
    hello = hello_plugin:HELLO
    generate = hello_plugin:IMPOSTOR
    misnamed = hello_plugin:MISNAMED
    missing = no_such_module_here:COMMAND
    """
)


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin")
    (root / "hello_plugin.py").write_text(PLUGIN)
    info = root / "hello_plugin-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-plugin\nVersion: 1.2\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return root


def mmcast(plugin_path, *argv: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(plugin_path), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "mmcast_client.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=path),
    )


def test_a_plugin_command_runs_with_its_own_flags_and_exit_status(plugin_path):
    done = mmcast(plugin_path, "hello", "world")
    assert done.returncode == 7, done.stderr
    assert done.stdout.strip() == "hello world []"


def test_help_lists_plugin_commands_and_marks_the_broken_ones(plugin_path):
    done = mmcast(plugin_path, "--help")
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("    ")}
    assert lines["hello"].split(None, 1)[1] == "greets"
    assert "stream one answer" in lines["generate"]  # the client's own generate is never replaced
    assert "unavailable (ModuleNotFoundError" in lines["missing"]
    assert "unavailable (TypeError" in lines["misnamed"]


def test_a_command_that_fails_to_load_names_its_distribution_and_the_cause(plugin_path):
    done = mmcast(plugin_path, "missing", "--any", "flags")
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "error: mmcast missing (from hello-plugin 1.2) could not be loaded: ModuleNotFoundError: "
        "No module named 'no_such_module_here'"
    )
    done = mmcast(plugin_path, "misnamed")
    assert done.returncode == 1
    assert "is not an mmcast_client.cli.Command named 'misnamed'" in done.stderr


def test_a_broken_plugin_leaves_generate_working(plugin_path):
    done = mmcast(plugin_path, "generate", "--help")
    assert done.returncode == 0 and "--max-tokens" in done.stdout, done.stderr
