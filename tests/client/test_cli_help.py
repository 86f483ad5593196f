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


def test_console_script_help_without_torch():
    # `mmcast --help` and `mmcast generate --help` must not import torch (fast start, SDK-only installs).
    code = (
        "import sys\nfrom mmcast_client import cli\n"
        "try:\n    cli.main(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'OK')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("OK")


def test_serve_local_passes_arguments_after_double_dash_to_the_scheduler(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "cmd_serve_local", lambda args: seen.update(vars(args)) or 0)
    assert cli.main(["serve-local", "--model", "m", "--tp", "2", "--", "--max-num-seqs", "4"]) == 0
    assert seen["extra"] == ["--max-num-seqs", "4"] and seen["tp"] == 2 and seen["transfer_mode"] == "lazy"


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
