"""Bad inputs to the OpenAI-compatible HTTP API, against the catalogue group (tests/security/conftest.py: bearer
tokens, small limits, image URLs allowed only for hosts whose addresses the SSRF rules refuse).

Every case must get its 4xx with a body in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``)
naming the field, while a concurrent well-formed streaming request completes unchanged; afterwards nothing is left
behind (no request running or queued, no block held) and no process restarted.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import threading
from collections.abc import Callable

import httpx
import pytest

from common.tiny_model import SPECIAL_TOKEN_IDS
from tests.support import hostile_video
from tests.support import security_catalogue as cat
from tests.support.security_support import scrape, wait_for

pytestmark = pytest.mark.slow

GAUGES = ("mmcast_requests_running", "mmcast_requests_waiting", "mmcast_kv_blocks_used")
MODEL = "tiny-model"  # the catalogue model folder's name: set by the fixture below


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat(*parts, **extra) -> dict:
    content = [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


GOOD = image_part(data_url(cat.GOOD_IMAGE))


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    status: int
    body: Callable[[], object] | None = None  # a JSON value, or bytes sent as they are
    param: str | None = None  # the error's param, when the refusal is about a field
    mentions: tuple[str, ...] = ()  # words the message must contain
    path: str = "/v1/chat/completions"
    method: str = "POST"
    headers: Callable[[str, str], dict] | None = None  # (tenant token, other token) -> headers; default: tenant's
    retry_after: bool = False


def _bearer(token: str) -> dict:
    return {"authorization": f"Bearer {token}"}


CASES = [
    # authentication and routing
    Case("no-token", 401, lambda: chat("hi"), headers=lambda t, o: {}, mentions=("authorization",)),
    Case("wrong-token", 401, lambda: chat("hi"), headers=lambda t, o: _bearer("not-a-token"), mentions=("token",)),
    Case("models-no-token", 401, path="/v1/models", method="GET", headers=lambda t, o: {}),
    Case("unknown-route", 404, lambda: chat("hi"), path="/v1/embeddings"),
    Case("wrong-method", 405, path="/v1/chat/completions", method="GET"),
    # the body
    Case("malformed-json", 400, lambda: b'{"model": "x", "messages": [', mentions=("JSON",)),
    Case("not-an-object", 400, lambda: b"[1, 2, 3]"),
    Case("empty-body", 400, lambda: b""),
    Case("body-over-limit", 413, lambda: json.dumps(chat("x" * (1 << 20))).encode(), mentions=("--max-request-bytes",)),
    Case("unknown-model", 404, lambda: {**chat("hi"), "model": "gpt-4o"}, param="model", mentions=("gpt-4o",)),
    Case("missing-messages", 400, lambda: {"model": MODEL}, param="messages"),
    Case("empty-messages", 400, lambda: {**chat("hi"), "messages": []}, param="messages"),
    Case(
        "function-role",
        400,
        lambda: {**chat("hi"), "messages": [{"role": "function", "content": "x"}]},
        param="messages[0].role",
    ),
    Case(
        "unknown-part-type",
        400,
        lambda: chat({"type": "input_audio", "input_audio": {}}),
        param="messages[0].content[0]",
    ),
    # sampling parameters
    Case("n-over-max-choices", 400, lambda: chat("hi", n=1000), param="n"),
    Case("negative-max-tokens", 400, lambda: chat("hi", max_tokens=-1), param="max_tokens"),
    Case(
        "max-tokens-over-limit",
        400,
        lambda: chat("hi", max_tokens=100_000),
        param="max_tokens",
        mentions=("--max-tokens-limit",),
    ),
    Case(
        "max-completion-tokens-over-context",
        400,
        lambda: {**chat("hi"), "max_completion_tokens": 500, "messages": [{"role": "user", "content": "hi " * 600}]},
        param="messages",
    ),
    Case("temperature-3", 400, lambda: chat("hi", temperature=3.0), param="temperature"),
    Case("top-p-0", 400, lambda: chat("hi", top_p=0.0), param="top_p"),
    Case(
        "top-logprobs-over-limit",
        400,
        lambda: chat("hi", logprobs=True, top_logprobs=10),
        param="top_logprobs",
        mentions=("--max-logprobs",),
    ),
    Case("top-logprobs-without-logprobs", 400, lambda: chat("hi", top_logprobs=2), param="top_logprobs"),
    Case("frequency-penalty-over-2", 400, lambda: chat("hi", frequency_penalty=2.5), param="frequency_penalty"),
    Case("logit-bias-outside-vocabulary", 400, lambda: chat("hi", logit_bias={"99999": 1}), param="logit_bias[99999]"),
    Case(
        "tool-choice-unknown-function",
        400,
        lambda: chat(
            "hi",
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        param="tool_choice.function.name",
    ),
    Case(
        "n-with-tools",
        400,
        lambda: chat("hi", n=2, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        param="n",
    ),
    Case(
        "grammar-too-large",
        400,
        lambda: chat("hi", guided_regex="a" * 70_000),
        param="guided_regex",
        mentions=("--max-grammar-bytes",),
    ),
    Case("stop-too-many", 400, lambda: chat("hi", stop=[f"s{i}" for i in range(20)]), param="stop"),
    Case(
        "bad-request-id",
        400,
        lambda: chat("hi"),
        param="x-request-id",
        headers=lambda t, o: {**_bearer(t), "x-request-id": "bad id with spaces"},
    ),
    Case("placeholder-in-text", 400, lambda: chat("look <|image_pad|> here"), param="messages[0].content[0].text"),
    # /v1/completions prompt lists, token-id prompts and echo; a refused prompt cancels those admitted before it
    Case(
        "prompt-list-too-long",
        400,
        lambda: {"model": MODEL, "prompt": ["x"] * 33, "max_tokens": 1},
        param="prompt",
        mentions=("33", "32", "--max-prompts-per-request"),
        path="/v1/completions",
    ),
    Case(
        "prompt-list-one-refused",
        400,
        lambda: {"model": MODEL, "prompt": ["hi", "y " * 5000], "max_tokens": 1},
        param="prompt[1]",
        mentions=("prompt[1]", "--max-prompt-bytes"),
        path="/v1/completions",
    ),
    Case(
        "token-prompt-placeholder",
        400,
        lambda: {"model": MODEL, "prompt": [5, SPECIAL_TOKEN_IDS["<|image_pad|>"]], "max_tokens": 1},
        param="prompt[1]",
        mentions=("placeholder",),
        path="/v1/completions",
    ),
    Case(
        "echo-with-logprobs",
        400,
        lambda: {"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 1},
        param="echo",
        path="/v1/completions",
    ),
    # caller-chosen media uuids and /v1/responses
    Case(
        "uuid-bad-charset",
        400,
        lambda: chat({"type": "image_url", "image_url": None, "uuid": "has space"}, "hi"),
        param="messages[0].content[0].uuid",
        mentions=("letters, digits",),
    ),
    Case(
        "uuid-never-registered",
        404,
        lambda: chat({"type": "image_url", "image_url": None, "uuid": "never-sent"}, "hi"),
        param="messages[0].content[0].uuid",
        mentions=("never-sent",),
    ),
    Case(
        "responses-unknown-previous",
        404,
        lambda: {"model": MODEL, "input": "hi", "previous_response_id": "resp_nope", "max_output_tokens": 2},
        param="previous_response_id",
        mentions=("resp_nope", "--response-store-entries"),
        path="/v1/responses",
    ),
    Case(
        "responses-tools",
        400,
        lambda: {"model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "f"}]},
        param="tools",
        path="/v1/responses",
    ),
    # images
    Case(
        "not-base64",
        400,
        lambda: chat(image_part("data:image/png," + "x" * 20)),
        param="messages[0].content[0].image_url.url",
        mentions=("base64",),
    ),
    Case(
        "bad-base64",
        400,
        lambda: chat(image_part("data:image/png;base64,@@@@****")),
        param="messages[0].content[0].image_url.url",
    ),
    Case(
        "wrong-mime",
        400,
        lambda: chat(image_part(data_url(cat.GOOD_IMAGE, "text/plain"))),
        param="messages[0].content[0].image_url.url",
        mentions=("text/plain",),
    ),
    Case(
        "not-an-image",
        400,
        lambda: chat(image_part(data_url(b"hello, not a picture" * 10))),
        param="messages[0].content[0].image_url",
    ),
    Case(
        "image-over-limit",
        413,
        lambda: chat(image_part(data_url(b"\x89PNG" + b"\0" * 300_000))),
        param="messages[0].content[0].image_url.url",
        mentions=("--max-upload-bytes",),
    ),
    Case(
        "too-many-images",
        400,
        lambda: chat(*[GOOD] * 5),
        param="messages[0].content[4].image_url",
        mentions=("--max-images-per-request",),
    ),
    Case(
        "decompression-bomb",
        400,
        lambda: chat(image_part(data_url(cat.png_header_only(20000, 20000)))),
        param="messages[0].content[0].image_url",
        mentions=("--max-image-pixels",),
    ),
    Case(
        "null-image-without-uuid",
        400,
        lambda: chat({"type": "image_url", "image_url": None}),
        param="messages[0].content[0].image_url",
    ),
    Case(
        "bad-uuid",
        400,
        lambda: chat({"type": "image_url", "image_url": None, "uuid": "sha256:not-hex"}),
        param="messages[0].content[0].uuid",
        mentions=("64 lowercase hex",),
    ),
    Case(
        "uuid-not-matching",
        400,
        lambda: chat({**GOOD, "uuid": "sha256:" + "0" * 64}),
        param="messages[0].content[0].uuid",
    ),
    Case(
        "unknown-uuid",
        404,
        lambda: chat(
            {"type": "image_url", "image_url": None, "uuid": "sha256:" + hashlib.sha256(b"never").hexdigest()}
        ),
        param="messages[0].content[0].uuid",
    ),
    Case(
        "other-tenants-uuid",
        404,
        lambda: chat(
            {"type": "image_url", "image_url": None, "uuid": "sha256:" + hashlib.sha256(cat.GOOD_IMAGE).hexdigest()}
        ),
        param="messages[0].content[0].uuid",
        headers=lambda t, o: _bearer(o),
    ),
    # videos
    Case(
        "video-url-holding-png",
        400,
        lambda: chat(video_part(data_url(cat.png(32, 32), "video/mp4"))),
        param="messages[0].content[0].video_url",
        mentions=("not a readable video container", "PNG image", "image part"),
    ),
    Case(
        "video-url-image-mime",
        400,
        lambda: chat(video_part(data_url(hostile_video.good(), "image/png"))),
        param="messages[0].content[0].video_url.url",
        mentions=("image/png", "video/"),
    ),
    Case(
        "video-url-16k-header",
        400,
        lambda: chat(video_part(data_url(hostile_video.h264_claiming(16000, 16000), "video/mp4"))),
        param="messages[0].content[0].video_url",
        mentions=("16000x16000", "--max-video-frame-pixels"),
    ),
    Case(
        "video-url-over-limit",
        413,
        lambda: chat(video_part(data_url(bytes(300_000), "video/mp4"))),
        param="messages[0].content[0].video_url.url",
        mentions=("--max-upload-bytes",),
    ),
    Case(
        "video-fps-and-num-frames",
        400,
        lambda: chat(
            video_part(data_url(hostile_video.good(), "video/mp4")), mm_processor_kwargs={"fps": 2, "num_frames": 4}
        ),
        param="mm_processor_kwargs.num_frames",
        mentions=("exclusive",),
    ),
    Case(
        "video-num-frames-over-limit",
        400,
        lambda: chat(video_part(data_url(hostile_video.good(), "video/mp4")), mm_processor_kwargs={"num_frames": 1000}),
        param="messages[0].content[0].video_url",
        mentions=("--max-video-frames",),
    ),
    # image URLs: SSRF targets, each host allowed by name so that the address rules are what refuses it
    Case(
        "ssrf-loopback-name",
        400,
        lambda: chat(image_part("http://localhost:9/x.png")),
        param="messages[0].content[0].image_url.url",
        mentions=("loopback",),
    ),
    Case(
        "ssrf-loopback-ip",
        400,
        lambda: chat(image_part("http://127.0.0.1:9/x.png")),
        param="messages[0].content[0].image_url.url",
    ),
    Case(
        "ssrf-metadata",
        400,
        lambda: chat(image_part("http://169.254.169.254/latest/meta-data/")),
        param="messages[0].content[0].image_url.url",
        mentions=("169.254.169.254",),
    ),
    Case(
        "ssrf-private",
        400,
        lambda: chat(image_part("http://10.0.0.1/x.png")),
        param="messages[0].content[0].image_url.url",
    ),
    Case(
        "url-domain-not-allowed",
        400,
        lambda: chat(image_part("https://example.com/cat.png")),
        param="messages[0].content[0].image_url.url",
        mentions=("--allowed-media-domains",),
    ),
    Case(
        "file-url-off",
        400,
        lambda: chat(image_part("file:///etc/passwd")),
        param="messages[0].content[0].image_url.url",
        mentions=("--allowed-local-media-path",),
    ),
    Case(
        "ftp-url",
        400,
        lambda: chat(image_part("ftp://example.com/x.png")),
        param="messages[0].content[0].image_url.url",
    ),
]


@pytest.fixture(scope="module")
def ctx(catalogue_group, catalogue_secrets, tiny_model_dir):
    global MODEL
    MODEL = tiny_model_dir.name
    group, _ = catalogue_group
    _, token, _, other = catalogue_secrets
    with httpx.Client(base_url=group.openai_base_url.removesuffix("/v1"), timeout=60) as http:
        good = http.post("/v1/chat/completions", json=chat(GOOD, "What is in the picture?"), headers=_bearer(token))
        assert good.status_code == 200, good.text  # the tenant has now sent GOOD_IMAGE inline; the other has not
        yield group, http, token, other


def good_stream(http: httpx.Client, token: str) -> dict:
    """A well-formed streaming request: its text and finish reason."""
    body = chat(GOOD, "What is in the picture?", stream=True, ignore_eos=True, temperature=0.0)
    text, finish = [], []
    with http.stream("POST", "/v1/chat/completions", json=body, headers=_bearer(token)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice.get("delta", {}).get("content") or "")
                finish.append(choice["finish_reason"])
    return {"text": "".join(text), "finish": [f for f in finish if f]}


@pytest.fixture(scope="module")
def expected(ctx):
    _, http, token, _ = ctx
    return good_stream(http, token)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_http_case(case, ctx, expected):
    group, http, token, other = ctx
    metrics = group.metrics_urls["scheduler"]
    before = {k: scrape(metrics)[k] for k in GAUGES}
    concurrent: dict = {}
    worker = threading.Thread(target=lambda: concurrent.update(good_stream(http, token)), daemon=True)
    worker.start()
    headers = case.headers(token, other) if case.headers else _bearer(token)
    body = case.body() if case.body else None
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    r = http.request(case.method, case.path, headers=headers, **kwargs)
    worker.join(60)
    assert concurrent == expected, f"{case.id}: the concurrent request changed: {concurrent}"
    assert r.status_code == case.status, f"{case.id}: {r.status_code} {r.text[:300]}"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"] and error["type"] and " at 0x" not in error["message"], error
    if case.param is not None:
        assert error["param"] == case.param, f"{case.id}: {error}"
    for word in case.mentions:
        assert word in error["message"], f"{case.id}: the message does not name {word!r}: {error['message']}"
    wait_for(lambda: {k: scrape(metrics)[k] for k in GAUGES} == before, 5, f"{case.id}: gauges back to {before}")
    assert group.restarts == 0 and group.failure is None


def test_health_is_open_and_models_need_the_token(ctx):
    _, http, token, _ = ctx
    assert http.get("/health").status_code == 200  # no token: probes have none
    r = http.get("/v1/models", headers=_bearer(token))
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL


def test_no_server_errors(ctx):
    """After the catalogue: no HTTP answer was a 5xx (an uncaught exception)."""
    group, *_ = ctx
    bad = {
        k: v
        for k, v in scrape(group.metrics_urls["scheduler"]).items()
        if k.startswith("mmcast_http_requests_total") and 'status="5' in k and v
    }
    assert not bad, bad


def test_metrics_on_the_http_port_need_the_token(ctx):
    """``/metrics`` on the API port (as vLLM serves it) is behind the API's own authentication."""
    _, http, token, _ = ctx
    refused = http.get("/metrics")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthenticated"
    served = http.get("/metrics", headers=_bearer(token))
    assert served.status_code == 200 and "mmcast_http_requests_total{" in served.text


def test_caller_chosen_ids_are_per_tenant(ctx):
    """A media uuid and a response id of one tenant name nothing for another (the same 404 as never sent)."""
    _, http, token, other = ctx
    named = {**GOOD, "uuid": "tenant-photo"}
    assert http.post("/v1/chat/completions", json=chat(named, "hi"), headers=_bearer(token)).status_code == 200
    by_uuid = chat({"type": "image_url", "image_url": None, "uuid": "tenant-photo"}, "hi")
    assert http.post("/v1/chat/completions", json=by_uuid, headers=_bearer(token)).status_code == 200
    refused = http.post("/v1/chat/completions", json=by_uuid, headers=_bearer(other))
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "messages[0].content[0].uuid"

    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    first = http.post("/v1/responses", json=body, headers=_bearer(token)).json()
    later = {**body, "previous_response_id": first["id"]}
    assert http.post("/v1/responses", json=later, headers=_bearer(token)).status_code == 200
    refused = http.post("/v1/responses", json=later, headers=_bearer(other))
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "previous_response_id"
