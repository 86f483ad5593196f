"""The client distribution on its own: `pip install ./client` into a clean virtual environment (no system
site-packages, no PYTHONPATH, run outside the checkout), then that environment's `mmcast generate` against a real
local group started from the dev environment.

It needs the package index that pip is configured with (grpcio, protobuf, numpy, Pillow, grpcio-status and the
build backend come from there; pip's cache makes reruns quick). Without it the test fails: it is the proof that
the light client installs and runs alone.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

from mmcast_client import Client
from mmcast_local.synthetic_images import synthetic_jpeg

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Never in a client-only environment: the heavy libraries and every server-side package.
FORBIDDEN_MODULES = ("torch", "transformers", "accelerate", "common", "scheduler_svc", "worker_svc", "mmcast_local")
FORBIDDEN_DISTRIBUTIONS = {"mmcast", "torch", "transformers", "accelerate", "tokenizers", "prometheus-client",
                           "grpcio-health-checking", "grpcio-reflection"}  # fmt: skip
PROMPT = "Describe this picture in a few words."
MAX_TOKENS = 6


def _clean_env() -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH (the dev runs put the checkout there), no user site."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return env | {"PYTHONNOUSERSITE": "1"}


def _copy_client_project(dest: pathlib.Path) -> pathlib.Path:
    """client/ with its links, beside copies of the folders they point at, so the build writes nothing into the
    checkout and never reuses a stale build/ folder."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info")
    shutil.copytree(ROOT / "client", dest / "client", symlinks=True, ignore=ignore)
    for link in (dest / "client").iterdir():
        if link.is_symlink():
            target = (ROOT / "client" / os.readlink(link)).resolve()
            copy = dest / target.relative_to(ROOT)
            if not copy.exists():
                (shutil.copytree(target, copy, ignore=ignore) if target.is_dir() else shutil.copy2(target, copy))
    return dest / "client"


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> pathlib.Path:
    work = tmp_path_factory.mktemp("client-dist")
    project = _copy_client_project(work / "src")
    venv = work / "venv"
    # `-m venv` from the dev interpreter makes an environment of the base Python 3.11 without system site-packages;
    # the dev environment's pip installs into it (`--python`), which spares the clean one a bundled pip of its own
    # (ensurepip costs tens of seconds on a loaded machine). The build itself runs in pip's isolated build env.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=_clean_env(), cwd=work,
                   timeout=120)  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--disable-pip-version-check",
         str(project)],
        capture_output=True, text=True, env=_clean_env(), cwd=work, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, f"pip install ./client failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return venv


def run_in(venv: pathlib.Path, *argv: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], capture_output=True, text=True,
                          env=_clean_env(), cwd=cwd, timeout=300)  # fmt: skip


def test_only_the_client_and_its_dependencies_are_installed(client_venv, tmp_path):
    code = (
        "import importlib.metadata as md, importlib.util as u, json\n"
        "import mmcast_client, mmcast_client.cli, mmcast_client.aio, mmcast_client.testing\n"
        "from mmcast.v1 import generation_pb2\n"
        f"missing = [m for m in {FORBIDDEN_MODULES!r} if u.find_spec(m) is None]\n"
        "dists = sorted(d.metadata['Name'].lower().replace('_', '-') for d in md.distributions())\n"
        "print(json.dumps({'missing': missing, 'dists': dists, 'sdk': mmcast_client.__file__}))"
    )
    done = run_in(client_venv, "python", "-c", code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["missing"] == list(FORBIDDEN_MODULES), f"importable in a client-only venv: {seen}"
    assert "mmcast-client" in seen["dists"] and not FORBIDDEN_DISTRIBUTIONS & set(seen["dists"]), seen["dists"]
    assert seen["sdk"].startswith(str(client_venv)), "the SDK must come from the venv, not the checkout"


def test_the_mmcast_command_offers_generate_and_says_where_the_rest_comes_from(client_venv, tmp_path):
    done = run_in(client_venv, "mmcast", "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    commands = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("    ")}
    assert commands == {"generate"}, done.stdout
    assert "Installing the mmcast server distribution adds serve-local" in " ".join(done.stdout.split())
    version = run_in(client_venv, "mmcast", "--version", cwd=tmp_path)
    expected = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]["version"]
    assert version.returncode == 0 and version.stdout.split() == ["mmcast", expected], version
    refused = run_in(client_venv, "mmcast", "serve-local", "--model", "x", cwd=tmp_path)
    assert refused.returncode == 2 and "invalid choice: 'serve-local'" in refused.stderr


def test_mmcast_generate_from_the_client_venv_against_a_local_group(client_venv, serve_local_tp2, tmp_path):
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(synthetic_jpeg(4242, (448, 336)))
    done = run_in(client_venv, "mmcast", "generate", "--target", serve_local_tp2.target, "--image", str(photo),
                  "--max-tokens", str(MAX_TOKENS), "--ignore-eos", PROMPT, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    usage = dict(field.split("=", 1) for field in done.stderr.strip().splitlines()[-1].split()[1:])
    assert usage["completion_tokens"] == str(MAX_TOKENS) and usage["images"] == "1" and usage["finish"] == "length"
    # The same request through the dev environment's SDK: greedy, so the same text.
    messages = [{"role": "user", "content": [{"type": "image", "image": str(photo)}, {"type": "text", "text": PROMPT}]}]
    with Client(serve_local_tp2.target, timeout=300) as client:
        expected = client.generate(messages, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    assert expected.usage.completion_tokens == MAX_TOKENS
    assert done.stdout.removesuffix("\n") == expected.text
