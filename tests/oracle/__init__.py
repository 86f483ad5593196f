"""transformers itself as the tests' reference for video, run in its own venv (``scripts/install-oracle-venv.sh``).

The product venv has no torchvision, which transformers' video processors import; the oracle venv has it (its
Python part, beside a CPU torch). ``oracle(request)`` runs ``tests/oracle/video_oracle.py`` there on one JSON request
and returns its JSON answer (the request format is that module's docstring). ``ensure_oracle_venv()`` installs the
venv once (the script skips a finished install by its stamp); the ``oracle_venv`` fixture of ``tests/conftest.py``
calls it and skips only when the install failed for want of the package index.

``MMCAST_ORACLE_VENV`` names another venv folder (default ``.venv-oracle`` at the repository root).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install-oracle-venv.sh"
ORACLE = pathlib.Path(__file__).with_name("video_oracle.py")
VENV_ENV = "MMCAST_ORACLE_VENV"

# pip's words when it cannot reach an index: the one failure that skips the tests instead of failing them.
_OFFLINE = (
    "Temporary failure in name resolution",
    "Failed to establish a new connection",
    "Network is unreachable",
    "No matching distribution found",
    "Could not find a version that satisfies",
    "connection error",
)


class OracleUnavailable(RuntimeError):
    """The oracle venv could not be installed for want of the package index."""


def venv_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get(VENV_ENV) or ROOT / ".venv-oracle")


def python() -> pathlib.Path:
    return venv_dir() / "bin" / "python"


def ensure_oracle_venv(timeout: float = 900) -> pathlib.Path:
    """Installs the oracle venv if it is not yet (about a minute from the local wheels); its Python.

    ``OracleUnavailable`` when pip could not reach a package index; ``RuntimeError`` with pip's output for any
    other failure."""
    done = subprocess.run(
        ["bash", str(SCRIPT), str(venv_dir())], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-4000:]
        if any(words.lower() in output.lower() for words in _OFFLINE):
            raise OracleUnavailable(f"the oracle venv needs the package index, which pip cannot reach:\n{output}")
        raise RuntimeError(f"scripts/install-oracle-venv.sh failed ({done.returncode}):\n{output}")
    return python()


def oracle(request: dict, timeout: float = 600) -> dict:
    """``tests/oracle/video_oracle.py``'s answer to ``request``, run in the oracle venv (install it first)."""
    done = subprocess.run(
        [str(python()), str(ORACLE)],
        input=json.dumps(request),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": "", "TOKENIZERS_PARALLELISM": "false"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"the video oracle failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def oracle_options(options: dict, processor_type: str) -> tuple[dict, dict]:
    """``(call options, attributes)`` for the oracle that express mmcast's ``VideoOptions`` fields ``options``
    as transformers takes them: ``num_frames`` with ``fps=None`` (a model's default fps would otherwise clash with
    it), ``min_pixels``/``max_pixels`` as ``size``, and ``max_frames`` as a call option for Qwen2-VL but as the
    video processor's attribute for Qwen3-VL (its ``sample_frames`` reads only that)."""
    call: dict = {}
    attributes: dict = {}
    if options.get("fps") is not None:
        call["fps"] = options["fps"]
    if options.get("num_frames") is not None:
        call["num_frames"] = options["num_frames"]
        call["fps"] = None
    if options.get("max_frames") is not None:
        (attributes if processor_type == "Qwen3VLVideoProcessor" else call)["max_frames"] = options["max_frames"]
    size = {}
    if options.get("min_pixels") is not None:
        size["shortest_edge"] = options["min_pixels"]
    if options.get("max_pixels") is not None:
        size["longest_edge"] = options["max_pixels"]
    if size:
        call["size"] = size
    return call, attributes
