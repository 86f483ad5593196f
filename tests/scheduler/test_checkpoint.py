"""Model folders as checkpoints ship them, and what the scheduler does with one that cannot serve
(common/processor.py, scheduler_svc/main.py), and the status of a request the server fails (scheduler_svc/doors/servicer.py).

- A chat template in any file transformers reads serves prompts tokenized with that template. The reference is
  the template text the test wrote, rendered by the tokenizer's own ``apply_chat_template`` and each image pad
  expanded to the processor's patch count, as the processor does (``AutoProcessor`` itself needs torchvision here);
  each layout holds a template with its own system prompt, so taking a template from the wrong file shows.
- A folder with no chat template or no image processor stops ``mmcast-scheduler`` (a real process) at start with
  exit status 2 and one line naming the folder and what is missing.
- An unexpected exception in a request gives INTERNAL with the request id, never UNKNOWN with a class name.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import grpc
import pytest
from PIL import Image

from common.process import EXIT_STARTUP_FAILURE
from common.tiny_model import CHAT_TEMPLATE
from mmcast.v1 import generation_pb2 as g
from mmcast.v1 import generation_pb2_grpc as gg
from mmcast.v1 import worker_pb2
from tests.support.service_harness import FakeGroupScheduler

DEFAULT_SYSTEM = "You are a helpful assistant."


def template(system: str) -> str:
    assert DEFAULT_SYSTEM in CHAT_TEMPLATE
    return CHAT_TEMPLATE.replace(DEFAULT_SYSTEM, system)


T_JSON, T_JINJA, T_TOKENIZER = (
    template(f"You answer from {name}.")
    for name in ("chat_template.json", "chat_template.jinja", "tokenizer_config.json")
)


def _write(folder, name: str, text: str) -> None:
    if name == "chat_template.json":
        (folder / name).write_text(json.dumps({"chat_template": text}))
    elif name == "tokenizer_config.json":
        config = json.loads((folder / name).read_text())
        config["chat_template"] = text
        (folder / name).write_text(json.dumps(config))
    else:
        (folder / name).write_text(text)


def checkpoint(base, tmp_path, name: str, files: dict[str, str], drop: tuple[str, ...] = ()):
    """A copy of the tiny model folder whose chat template lives only in ``files`` (file name -> template)."""
    folder = tmp_path / name
    shutil.copytree(base, folder)
    (folder / "chat_template.jinja").unlink()
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    for file_name, text in files.items():
        _write(folder, file_name, text)
    for file_name in drop:
        (folder / file_name).unlink()
    return folder


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (120, 40, 200)).save(out, format="PNG")
    return out.getvalue()


IMAGE = png(84, 56)
QUESTION = "what colour is it?"


def reference_prompt(base, chat_template: str) -> list[int]:
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    image_processor = AutoImageProcessor.from_pretrained(base)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = tokenizer.apply_chat_template(
        messages, chat_template=chat_template, tokenize=False, add_generation_prompt=True
    )
    grid = image_processor(images=[Image.open(io.BytesIO(IMAGE))], return_tensors="pt")["image_grid_thw"][0]
    pads = int(grid.prod()) // image_processor.merge_size**2
    assert text.count("<|image_pad|>") == 1
    return tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * pads))["input_ids"]


def request(request_id: str, max_tokens: int = 2) -> g.GenerateRequest:
    content = [g.ContentPart(image=g.ImageInput(data=IMAGE)), g.ContentPart(text=QUESTION)]
    return g.GenerateRequest(
        request_id=request_id,
        messages=[g.ChatMessage(role=g.ROLE_USER, content=content)],
        sampling=g.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def generate(stub, req) -> g.GenerateFinal:
    final = None
    for response in stub.Generate(req, timeout=60):
        if response.HasField("final"):
            final = response.final
    return final


def prompt_sent(rank, request_id: str) -> list[int]:
    """The prompt token ids of ``request_id`` as the rank received them on its Step stream."""
    for raw in rank.frames:
        frame = worker_pb2.StepRequest.FromString(raw)
        if frame.WhichOneof("frame") == "control":
            for new in frame.control.new_requests:
                if new.request_id == request_id:
                    return list(new.prompt_token_ids)
    raise AssertionError(f"no new request {request_id} reached the rank")


LAYOUTS = {
    "chat_template.json": ({"chat_template.json": T_JSON}, T_JSON),
    "chat_template.jinja": ({"chat_template.jinja": T_JINJA}, T_JINJA),
    "tokenizer_config.json": ({"tokenizer_config.json": T_TOKENIZER}, T_TOKENIZER),
    # The processor's file wins over the tokenizer's, as AutoProcessor decides.
    "chat_template.json and tokenizer_config.json": (
        {"chat_template.json": T_JSON, "tokenizer_config.json": T_TOKENIZER},
        T_JSON,
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_template_in_any_file_transformers_reads_serves_its_prompts(tiny_model_dir, tmp_path, layout):
    files, expected = LAYOUTS[layout]
    folder = checkpoint(tiny_model_dir, tmp_path, "model", files)
    want = reference_prompt(tiny_model_dir, expected)
    others = {tuple(reference_prompt(tiny_model_dir, t)) for t in (T_JSON, T_JINJA, T_TOKENIZER) if t != expected}
    assert tuple(want) not in others  # a template from another file would be seen
    h = FakeGroupScheduler(folder, n_ranks=1).start()
    try:
        with grpc.insecure_channel(h.target) as channel:
            final = generate(gg.GenerationServiceStub(channel), request("templated"))
        assert final.usage.prompt_tokens == len(want)
        assert prompt_sent(h.ranks[0], "templated") == want, layout
    finally:
        h.stop()


def test_a_folder_that_cannot_serve_stops_the_scheduler_at_start_with_one_line(tiny_model_dir, tmp_path):
    folders = {
        "chat template": checkpoint(tiny_model_dir, tmp_path, "no-template", {}),
        "image processor": checkpoint(
            tiny_model_dir,
            tmp_path,
            "no-image-processor",
            {"chat_template.jinja": T_JINJA},
            drop=("preprocessor_config.json",),
        ),
    }
    procs = {  # both at once: most of each start is importing torch and transformers
        missing: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "scheduler_svc.main",
                "--model",
                str(folder),
                "--workers",
                "127.0.0.1:9",
                "--listen",
                "127.0.0.1:0",
                "--metrics-port",
                "0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        for missing, folder in folders.items()
    }
    for missing, proc in procs.items():
        try:
            _, stderr = proc.communicate(timeout=180)
        finally:
            proc.kill()
        folder = folders[missing]
        assert proc.returncode == EXIT_STARTUP_FAILURE, stderr[-3000:]
        lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
        failures = [line for line in lines if line["level"] in ("critical", "error")]
        assert len(failures) == 1, failures
        message = failures[0]["msg"]
        assert f"model folder {folder} has no {missing}" in message, message
        assert "\n" not in message and "exc" not in failures[0] and "Traceback" not in stderr, stderr[-3000:]
        assert "scheduler listening" not in stderr


@pytest.fixture
def harness(tiny_model_dir):
    h = FakeGroupScheduler(tiny_model_dir, n_ranks=1).start()
    yield h
    h.stop()


def _handled(h, method: str, code: str) -> float:
    """grpc_server_handled_total of one method and code, summed over its one RPC type."""
    return sum(
        sample.value
        for metric in h.server.metrics.registry.collect()
        if metric.name == "grpc_server_handled"
        for sample in metric.samples
        if sample.name == "grpc_server_handled_total"
        and sample.labels["grpc_method"] == method
        and sample.labels["grpc_code"] == code
    )


def _assert_internal(info, request_id: str) -> None:
    error = info.value
    assert error.code() == grpc.StatusCode.INTERNAL, (error.code(), error.details())
    assert f"request_id={request_id}" in error.details(), error.details()
    for leak in ("class", "RuntimeError", "bug text"):
        assert leak not in error.details(), error.details()


def test_an_unexpected_exception_is_internal_with_the_request_id(harness, monkeypatch):
    from scheduler_svc.engine import completion

    h = harness

    def broken(*args, **kwargs):
        raise RuntimeError("the bug text")

    with grpc.insecure_channel(h.target) as channel:
        stub = gg.GenerationServiceStub(channel)
        with monkeypatch.context() as patch:  # before admission: in the frontend
            patch.setattr(h.server.frontend, "process", broken)
            with pytest.raises(grpc.RpcError) as info:
                generate(stub, request("planted-1"))
        _assert_internal(info, "planted-1")

        class BrokenText:  # after admission: while streaming tokens
            def __init__(self, *args):
                pass

            add = flush = broken

        with monkeypatch.context() as patch:
            patch.setattr(completion, "Detokenizer", BrokenText)  # the request path both APIs share
            with pytest.raises(grpc.RpcError) as info:
                generate(stub, request("planted-2"))
        _assert_internal(info, "planted-2")
        assert h.call(lambda: dict(h.server.engine.handles)) == {}  # nothing left holding blocks

        with monkeypatch.context() as patch:
            patch.setattr(h.server.frontend, "check_image_header", broken)
            with pytest.raises(grpc.RpcError) as info:
                stub.UploadImage(iter([g.UploadImageRequest(data=IMAGE)]), timeout=30)
        _assert_internal(info, info.value.details().split("request_id=")[1].split(")")[0])
        assert "request_id=upload-" in info.value.details()

        with monkeypatch.context() as patch:
            patch.setattr(h.server.servicer, "server_info", broken)
            with pytest.raises(grpc.RpcError) as info:
                stub.GetServerInfo(g.GetServerInfoRequest(), timeout=30)
        assert info.value.code() == grpc.StatusCode.INTERNAL and "request_id=info-" in info.value.details()

        assert generate(stub, request("after")).usage.completion_tokens == 2  # the service keeps serving
    assert _handled(h, "Generate", "Internal") == 2 and _handled(h, "Generate", "Unknown") == 0
    assert _handled(h, "UploadImage", "Internal") == 1 and _handled(h, "GetServerInfo", "Internal") == 1


def test_an_unexpected_exception_in_the_http_api_is_500_with_the_request_id(tiny_model_dir, monkeypatch):
    """The OpenAI-compatible door answers a server bug as the gRPC one does: a 500 naming the request id (the log
    holds the traceback under it), no exception text, nothing left holding blocks, the service still serving."""
    import httpx

    from mmcast_local.child_processes import free_ports
    from scheduler_svc.engine import completion

    (port,) = free_ports(1)
    h = FakeGroupScheduler(tiny_model_dir, n_ranks=1, http_port=port).start()
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {"model": tiny_model_dir.name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}

        def broken(*args, **kwargs):
            raise RuntimeError("the bug text")

        class BrokenText:
            def __init__(self, *args):
                pass

            add = flush = broken

        with httpx.Client(timeout=30) as http:
            for where, patch_it in (
                ("frontend", lambda p: p.setattr(h.server.frontend, "process", broken)),
                ("stream", lambda p: p.setattr(completion, "Detokenizer", BrokenText)),
            ):
                for stream in (False, True):
                    with monkeypatch.context() as patch:
                        patch_it(patch)
                        r = http.post(url, json={**body, "stream": stream}, headers={"x-request-id": f"bug-{where}"})
                    assert r.status_code == 500, (where, stream, r.text)
                    error = r.json()["error"]
                    assert "request_id=bug-" in error["message"] and error["type"] == "server_error", error
                    for leak in ("RuntimeError", "bug text", "Traceback"):
                        assert leak not in r.text, r.text

            class BreaksLater(completion.Detokenizer):  # fails after the first chunk went out
                def add(self, ids):
                    if self.ids:
                        raise RuntimeError("the bug text")
                    return super().add(ids)

            with monkeypatch.context() as patch:
                patch.setattr(completion, "Detokenizer", BreaksLater)
                r = http.post(
                    url,
                    json={**body, "max_tokens": 4, "ignore_eos": True, "stream": True},
                    headers={"x-request-id": "bug-later"},
                )
            events = [e for e in r.text.split("\n\n") if e]
            assert r.status_code == 200 and events[-1] == "data: [DONE]", r.text
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert "request_id=bug-later" in error["message"] and "bug text" not in r.text, error
            assert h.call(lambda: dict(h.server.engine.handles)) == {}  # nothing left holding blocks
            ok = http.post(url, json=body)
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        h.stop()
