"""The README's Python examples and its demo run as printed, against the shared `serve-local --tp 2` group.

Each ```python block of README.md is executed with only its address rewritten to the group's, in a folder holding the
files it opens (small synthetic photos, short clips); the blocks run as they are, so an example that no longer
matches the SDK or the OpenAI door fails here. `make demo` is `mmcast demo` with a group of its own; here the same
command drives the shared group (`--target`) for two turns.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mmcast_client import Client, cli
from mmcast_local.synthetic_images import synthetic_jpeg
from tests.video_clips import make_clip

README = Path(__file__).resolve().parents[2] / "README.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


class Prints(list):
    """Stands in for ``print`` in an example's namespace: keeps each call's arguments."""

    def __call__(self, *args, **kwargs) -> None:
        self.append(args)


def block(containing: str) -> str:
    found = [b for b in PYTHON_BLOCK.findall(README.read_text()) if containing in b]
    assert len(found) == 1, f"README.md: expected one python block with {containing!r}, found {len(found)}"
    return found[0]


@pytest.fixture
def photos(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for seed, name in enumerate(("kitchen.jpg", "garden.jpg")):
        (tmp_path / name).write_bytes(synthetic_jpeg(seed, (96, 64)))
    return tmp_path


def test_the_sdk_example(serve_local_tp2, photos):
    code = block("from mmcast_client import Client")
    assert code.count('"localhost:50051"') == 1
    prints = Prints()
    exec(code.replace('"localhost:50051"', repr(serve_local_tp2.target)), {"print": prints})
    _, finish_reason, cached_tokens, ttft = prints[0]
    assert finish_reason in ("length", "stop") and isinstance(cached_tokens, int) and ttft > 0  # the group is shared
    assert len(prints) > 1 and all(isinstance(args[0], str) for args in prints[1:])  # the streamed second turn


def test_the_openai_example(serve_local_tp2, photos):
    code = block("import base64, hashlib, openai")
    assert code.count('"http://127.0.0.1:8000/v1"') == 1
    prints = Prints()
    exec(code.replace('"http://127.0.0.1:8000/v1"', repr(serve_local_tp2.openai_base_url)), {"print": prints})
    content, cached_tokens = prints[0]
    assert isinstance(content, str) and isinstance(cached_tokens, int)  # the group is shared: any prefix may hit
    assert len(prints) > 1  # the streamed answer about the same image, named by its uuid


def test_the_video_and_live_session_example(serve_local_tp2, photos):
    (photos / "clip.mp4").write_bytes(make_clip(seconds=1.0, fps=4))
    segments = [make_clip(seconds=1.0, fps=4, width=64 + 16 * k) for k in range(2)]
    prints = Prints()
    with Client(serve_local_tp2.target) as client:
        exec(block("live="), {"client": client, "stream": segments, "print": prints})
    assert [args[1] for args in prints] == [0, 0]  # two live turns, none evicted yet (keep_turns 3)


def test_the_demo_runs_its_conversation(serve_local_tp2, capsys):
    assert cli.main(["demo", "--target", serve_local_tp2.target, "--turns", "2", "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"\s+[12]\s+[12]\s+\d+", line)]
    assert "full would" in out and len(rows) == 2, out
