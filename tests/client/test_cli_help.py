"""The `mmcast` command line: every sub-command documents itself, and make-tiny-model builds a model folder."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from mmcast_client import cli

SUBCOMMANDS = ("make-tiny-model", "serve-local", "generate", "demo")


@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in SUBCOMMANDS)])
def test_help_exits_zero(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 0
    assert "usage: mmcast" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"]])
def test_console_script_help_without_torch(argv):
    # `mmcast --help` loads every installed sub-command (the server's through entry points) and `mmcast generate`
    # runs on SDK-only installs: neither may import torch or a service package (fast start).
    code = (
        f"import sys\nfrom mmcast_client import cli\ntry:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass\n"
        "heavy = ('torch', 'transformers', 'common', 'scheduler_svc', 'worker_svc')\n"
        "print(','.join(m for m in heavy if m in sys.modules) or 'OK')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("OK"), out.stdout


def test_serve_local_passes_arguments_after_double_dash_to_the_scheduler():
    command, args = cli.parse(["serve-local", "--model", "m", "--tp", "2", "--", "--max-num-seqs", "4"])
    assert command.name == "serve-local"
    assert args.extra == ["--max-num-seqs", "4"] and args.tp == 2 and args.transfer_mode == "lazy"


def test_generate_keeps_double_dash_as_argparse_s_end_of_options():
    command, args = cli.parse(["generate", "--max-tokens", "3", "--", "--a prompt that starts with dashes"])
    assert command.name == "generate" and args.prompt == "--a prompt that starts with dashes" and args.extra == []


def test_version_is_the_client_distribution_s(capsys):
    import tomllib

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    version = tomllib.loads((pathlib.Path(cli.__file__).parents[1] / "client" / "pyproject.toml").read_text())
    assert capsys.readouterr().out.strip() == f"mmcast {version['project']['version']}"


def test_generate_requires_a_prompt(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate"])
    assert info.value.code == 2


@pytest.mark.slow
def test_make_tiny_model_builds_a_loadable_folder(tmp_path):
    out = tmp_path / "tiny"
    proc = subprocess.run(
        [sys.executable, "-m", "mmcast_client.cli", "make-tiny-model", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert pathlib.Path(proc.stdout.strip()) == out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2_vl"
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    # a second run finds the folder complete and leaves it alone
    again = subprocess.run([sys.executable, "-m", "mmcast_client.cli", "make-tiny-model", str(out)], timeout=300)
    assert again.returncode == 0
