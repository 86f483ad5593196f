"""The HTTP door against the gRPC SDK on the same requests (issue 24):
``python -m benchmarks.http_api.http_overhead [--quick | --full | --test] [--out DIR]``; also part of ``benchmarks.run``.

One fresh local group (TP1, the defaults: ``lazy``, encoded payloads), warmed, serves four clients ("doors"):

- ``grpc-upload``: ``mmcast_client.Client``, images uploaded once and referenced by hash (the SDK's default);
- ``grpc-inline``: ``Client(upload_images=False)``, the encoded bytes in every request;
- ``http-data``: the ``openai`` package, streaming, every image as a ``data:image/...;base64,`` URL;
- ``http-uuid``: the same, but an image this door sent before goes as ``{"image_url": null, "uuid": "sha256:<hex>"}``.

Scenarios, interleaved request by request (every round sends each cell through every door, the doors' order rotating
from round to round) so that the machine's load of the moment falls on both doors alike:

- ``text``: a text-only prompt, the same words through every door;
- ``new_image``: one never-seen image per request (448x448 JPEG and PNG; the full plan adds 1280x720 JPEG);
- ``cached_conversation``: N images in the conversation (N = 1, 4, 8), the N - 1 earlier ones sent by this door
  before (so in the prefix cache), the newest never seen.

Every door has its own ``cache_salt`` and its own images, so no door is served from a cache another door filled: each
door's new image is new to the group, and each door's prefix is its own. Client-side TTFT is the time from building
the request (reading the files, base64 for HTTP, hashing for the SDK: what an application pays) to the first
non-empty content token, on the same clock for both doors. Greedy with ``ignore_eos``: the text-only rounds send the
same prompt through every door and must return the same text; for the image scenarios one extra request per cell
(the same images through every door, after the timed rounds) must too. A mismatch fails the run.

Besides, in process and without the server: what base64 costs per image (client: ``b64encode`` into a data: URL and
``json.dumps`` of the body; server: ``openai_schema.ChatCompletionBody.model_validate_json`` of that body, which is
the HTTP door's JSON parse, ``json.loads`` of it for comparison, ``base64.b64decode(validate=True)`` and the sha256
the door takes of inline images), per image size, in ms and as a share of the HTTP door's TTFT p50 on that image.
"""

from __future__ import annotations

import argparse
import base64
import collections
import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence

from benchmarks.http_api.http_overhead_analysis import (
    CELL_STRIDE,
    DOOR_STRIDE,
    DOORS,
    GRPC_INLINE,
    GRPC_UPLOAD,
    HTTP_UUID,
    JPEG_448,
    JPEG_720P,
    MIME,
    PNG_448,
    SCENARIO_DOORS,
    SEED,
    ImageKind,
    analyze,
    markdown,
)
from benchmarks.support import stats


@dataclasses.dataclass(frozen=True)
class Plan:
    repeats: int  # timed rounds
    ns: tuple[int, ...]  # images in the cached conversation, the newest new
    new_images: tuple[ImageKind, ...]  # kinds of the new-image scenario
    decode_images: tuple[ImageKind, ...]  # kinds of the in-process base64 table
    decode_repeats: int
    max_tokens: int = 4


PLANS = {
    "test": Plan(2, (2,), (JPEG_448,), (JPEG_448,), 5),  # tests/bench/test_http_overhead.py: that it runs
    "quick": Plan(12, (1, 4, 8), (JPEG_448, PNG_448), (JPEG_448, PNG_448, JPEG_720P), 100),
    "full": Plan(24, (1, 4, 8), (JPEG_448, PNG_448, JPEG_720P), (JPEG_448, PNG_448, JPEG_720P), 300),
}


def kind_label(kind: ImageKind) -> str:
    (w, h), fmt = kind
    return f"{w}x{h} {fmt}"


def planned_requests(plan: Plan) -> int:
    per_round = (
        len(SCENARIO_DOORS["text"])
        + len(plan.new_images) * len(SCENARIO_DOORS["new_image"])
        + len(plan.ns) * len(DOORS)
    )
    warm = 2 * len(DOORS) + len(plan.ns) * len(DOORS)
    equality = len(plan.new_images) * len(SCENARIO_DOORS["new_image"]) + 2 * len(plan.ns) * len(DOORS)
    return plan.repeats * per_round + warm + equality


# --- the doors ----------------------------------------------------------------------------------------------------
class Doors:
    """The four clients of one group. ``send`` times one request: messages in the SDK's shape (``scenarios.user``:
    image items are file paths), converted for the HTTP doors inside the timed region."""

    def __init__(self, group, max_tokens: int) -> None:
        import openai

        from mmcast_client.client import Client

        self.max_tokens = max_tokens
        self.pids = group.pids
        self.sdk = {
            GRPC_UPLOAD: Client(group.target, timeout=600),
            GRPC_INLINE: Client(group.target, timeout=600, upload_images=False),
        }
        self.openai = openai.OpenAI(base_url=group.openai_base_url, api_key="unused", max_retries=0, timeout=600)
        self.model = self.openai.models.list().data[0].id
        self.held: set[str] = set()  # paths http-uuid sent as data: URLs in an admitted request
        self._sha: dict[str, str] = {}  # path -> sha256 hex: a client remembers what it sent

    def close(self) -> None:
        for c in self.sdk.values():
            c.close()
        self.openai.close()

    def send(self, door: str, messages: list[dict]) -> dict:
        from benchmarks.support.proc_memory import cpu_seconds

        pid = self.pids().get("scheduler")
        cpu0 = cpu_seconds(pid) if pid else None
        out = self._sdk(door, messages) if door in self.sdk else self._http(door, messages)
        cpu1 = cpu_seconds(pid) if pid else None
        out["scheduler_cpu_ms"] = (cpu1 - cpu0) * 1e3 if cpu0 is not None and cpu1 is not None else None
        return out

    def _sdk(self, door: str, messages: list[dict]) -> dict:
        t0 = time.perf_counter()
        first, parts = None, []
        with self.sdk[door].generate(
            messages, max_tokens=self.max_tokens, ignore_eos=True, cache_salt=door, stream=True
        ) as s:
            for delta in s:
                if first is None and delta.text:
                    first = time.perf_counter()
                parts.append(delta.text)
        end = time.perf_counter()
        u = s.result.usage
        return {
            "ttft_ms": ((first or end) - t0) * 1e3,
            "total_ms": (end - t0) * 1e3,
            "text": "".join(parts),
            "completion_tokens": u.completion_tokens,
            "prompt_tokens": u.prompt_tokens,
            "cached_tokens": u.cached_tokens,
        }

    def _http(self, door: str, messages: list[dict]) -> dict:
        t0 = time.perf_counter()
        body, sent = self._openai_messages(door, messages)
        first, parts, usage = None, [], None
        stream = self.openai.chat.completions.create(
            model=self.model,
            messages=body,
            max_tokens=self.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "cache_salt": door},
        )
        with stream:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if first is None:
                        first = time.perf_counter()
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
        end = time.perf_counter()
        self.held.update(sent)
        cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
        return {
            "ttft_ms": ((first or end) - t0) * 1e3,
            "total_ms": (end - t0) * 1e3,
            "text": "".join(parts),
            "completion_tokens": usage.completion_tokens if usage else 0,
            "prompt_tokens": usage.prompt_tokens if usage else 0,
            "cached_tokens": cached,
        }

    def _openai_messages(self, door: str, messages: list[dict]) -> tuple[list[dict], list[str]]:
        out, sent = [], []
        for m in messages:
            if isinstance(m["content"], str):
                out.append(m)
                continue
            parts = []
            for item in m["content"]:
                if item["type"] == "text":
                    parts.append(item)
                    continue
                path = item["image"]
                if door == HTTP_UUID and path in self.held:
                    parts.append({"type": "image_url", "image_url": None, "uuid": "sha256:" + self._sha[path]})
                    continue
                with open(path, "rb") as f:
                    data = f.read()
                parts.append({"type": "image_url", "image_url": {"url": data_url(data, _fmt(path))}})
                if door == HTTP_UUID:
                    self._sha[path] = hashlib.sha256(data).hexdigest()
                    sent.append(path)
            out.append({"role": m["role"], "content": parts})
        return out, sent


def data_url(data: bytes, fmt: str) -> str:
    return f"data:{MIME[fmt]};base64," + base64.b64encode(data).decode("ascii")


def _fmt(path: str) -> str:
    return "png" if path.endswith(".png") else "jpeg"


# --- the run ------------------------------------------------------------------------------------------------------
def _seed(door: str, cell: int, i: int) -> int:
    return SEED + DOOR_STRIDE * (DOORS.index(door) + 1) + CELL_STRIDE * cell + i


def _requests(images, plan: Plan) -> tuple[dict, list, list, list]:
    """Every request's messages, built (and its images rendered) before the group starts: the conversations'
    earlier turns, the timed rounds' cells, and the equality requests of the new-image and conversation scenarios."""
    from benchmarks.support.scenarios import assistant, filler, question, user

    text_head = filler(48) + " Answer in one word."

    def path(kind: ImageKind, seed: int) -> str:
        return images.path(seed, kind[0], kind[1])

    new_cells = list(enumerate(plan.new_images))
    heads = {(door, j): [user([path(JPEG_448, _seed(door, 100 + j, i)) for i in range(n - 1)],
                              f"Here are {n - 1} pictures."), assistant()]
             for j, n in enumerate(plan.ns) for door in DOORS}  # fmt: skip
    timed: list[list[tuple[str, str, int, str, list[dict]]]] = []  # per round: (scenario, image, n, door, messages)
    for r in range(1, plan.repeats + 1):
        cells = [("text", "", 0, d, [user([], f"{text_head} {question(r)}")]) for d in SCENARIO_DOORS["text"]]
        for k, kind in new_cells:
            cells += [
                ("new_image", kind_label(kind), 1, d, [user([path(kind, _seed(d, k, r))], question(r))])
                for d in SCENARIO_DOORS["new_image"]
            ]
        for j, n in enumerate(plan.ns):
            cells += [
                (
                    "cached_conversation",
                    kind_label(JPEG_448),
                    n,
                    d,
                    [*heads[(d, j)], user([path(JPEG_448, _seed(d, 100 + j, 500 + r))], question(r))],
                )
                for d in DOORS
            ]
        timed.append(cells)
    eq_seed = SEED + 90_000
    equal_new = [(kind, [user([path(kind, eq_seed + k)], question(99))]) for k, kind in new_cells]
    equal_conv = [(n, [user([path(JPEG_448, eq_seed + 100 * (j + 1) + i) for i in range(n - 1)],
                            f"Here are {n - 1} pictures."), assistant()],
                   path(JPEG_448, eq_seed + 100 * (j + 1) + 99)) for j, n in enumerate(plan.ns)]  # fmt: skip
    return heads, timed, equal_new, equal_conv


def _send_all(send, images, plan: Plan, heads: dict, timed: list, equal_new: list, equal_conv: list, log) -> None:
    """The warm-up, the timed rounds (each cell's doors back to back, their order rotating) and the equality
    requests, through ``send(door, messages, **meta)``."""
    from benchmarks.support.scenarios import question, user

    def path(kind: ImageKind, seed: int) -> str:
        return images.path(seed, kind[0], kind[1])

    for door in DOORS:  # connections, channels, the tokenizer's and the encoder's first calls
        send(door, [user([], "Warm up.")], scenario="warmup", image="", n=0, index=0)
        send(
            door,
            [user([path(JPEG_448, _seed(door, 99, 0))], "Warm up.")],
            scenario="warmup",
            image="",
            n=1,
            index=0,
        )
    for (door, j), head in heads.items():  # the conversations' earlier images into the prefix cache
        send(door, [*head, user([], question(0))], scenario="warmup", image="", n=plan.ns[j] - 1, index=0)
    log("http overhead: warmed; timed rounds")
    for r, cells in enumerate(timed, start=1):
        groups: dict[tuple, list] = collections.defaultdict(list)
        for c in cells:
            groups[c[:3]].append(c)
        for cell in groups.values():  # the doors of one cell back to back, their order rotating
            shift = r % len(cell)
            for scenario, image, n, door, messages in cell[shift:] + cell[:shift]:
                send(door, messages, scenario=scenario, image=image, n=n, index=r)
    for kind, messages in equal_new:  # the same request through every door, after the timed ones
        for door in SCENARIO_DOORS["new_image"]:
            send(door, messages, scenario="new_image", image=kind_label(kind), n=1, index=-1)
    for n, head, newest in equal_conv:
        for door in DOORS:
            send(door, [*head, user([], question(0))], scenario="warmup", image="", n=n - 1, index=-1)
            send(
                door,
                [*head, user([newest], question(98))],
                scenario="cached_conversation",
                image=kind_label(JPEG_448),
                n=n,
                index=-1,
            )


def measure(
    model_dir: str,
    images,
    plan: Plan,
    on_request: Callable[[dict], None] | None = None,
    log: Callable[[str], None] = lambda _m: None,
) -> dict:
    """Base64 costs in process, then one group: warm-up, the timed rounds, the equality requests."""
    from mmcast_local.supervisor import LocalGroup

    decode = decode_costs(images, plan.decode_images, plan.decode_repeats)  # before the group: no contention
    records: list[dict] = []
    heads, timed, equal_new, equal_conv = _requests(images, plan)

    load = [round(x, 2) for x in os.getloadavg()]
    t0 = time.monotonic()
    with LocalGroup(model_dir, tp=1) as group:
        started = time.monotonic() - t0
        doors = Doors(group, plan.max_tokens)
        try:

            def send(door: str, messages: list[dict], **meta) -> dict:
                rec = {**meta, "door": door, **doors.send(door, messages)}
                records.append(rec)
                if on_request:
                    on_request(rec)
                return rec

            _send_all(send, images, plan, heads, timed, equal_new, equal_conv, log)
        finally:
            doors.close()
    return {
        "plan": dataclasses.asdict(plan),
        "records": records,
        "decode": decode,
        "startup_seconds": started,
        "seconds": time.monotonic() - t0,
        "loadavg_before": load,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        **analyze(records, decode),
    }


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return stats.median(times)


def decode_costs(images, kinds: Sequence[ImageKind], repeats: int) -> list[dict]:
    """Per image kind, the median ms of each base64 step, in this process (no server, no contention from it)."""
    from scheduler_svc.doors.openai_schema import ChatCompletionBody

    rows = []
    for kind in kinds:
        with open(images.path(SEED + 80_000, kind[0], kind[1]), "rb") as f:
            data = f.read()
        url = data_url(data, kind[1])
        payload = url[url.index(",") + 1 :]
        body_obj = {
            "model": "m",
            "max_tokens": 4,
            "stream": True,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "What is in the picture?"},
                    ],
                }
            ],
        }
        body = json.dumps(body_obj).encode()
        rows.append({
            "image": kind_label(kind), "file_bytes": len(data), "base64_chars": len(payload), "body_bytes": len(body),
            "client_encode_ms": _median_ms(lambda d=data, k=kind: data_url(d, k[1]), repeats),
            "client_json_ms": _median_ms(lambda o=body_obj: json.dumps(o).encode(), repeats),
            "server_parse_ms": _median_ms(lambda b=body: ChatCompletionBody.model_validate_json(b), repeats),
            "json_loads_ms": _median_ms(lambda b=body: json.loads(b), repeats),
            "b64decode_ms": _median_ms(lambda p=payload: base64.b64decode(p, validate=True), repeats),
            "sha256_ms": _median_ms(lambda d=data: hashlib.sha256(d).hexdigest(), repeats),
        })  # fmt: skip
    return rows


def write(out_dir: str, result: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    md = markdown(result)
    with open(os.path.join(out_dir, "http_overhead.md"), "w") as f:
        f.write("# The HTTP door against the gRPC SDK (issue 24)\n\n" + md + "\n")
    with open(os.path.join(out_dir, "http_overhead.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return md


def main(argv: list[str] | None = None) -> int:
    from benchmarks.support.scenarios import Images
    from common.tiny_model import ensure_tiny_model

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.http_api.http_overhead", description=__doc__.split("\n\n")[0]
    )
    which = parser.add_mutually_exclusive_group()
    for name in PLANS:
        which.add_argument(f"--{name}", dest="plan", action="store_const", const=name, help=f"the {name} plan")
    parser.add_argument("--out", help="folder for http_overhead.md/.json (default benchmarks/results/<ts>-http)")
    parser.add_argument("--model-dir", help="tiny model folder (built if missing; default benchmarks/results/.model)")
    args = parser.parse_args(argv)
    root = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "results"
    )
    out = args.out or os.path.join(root, f"{time.strftime('%Y%m%d-%H%M%S')}-http")
    model_dir = str(
        ensure_tiny_model(args.model_dir or os.path.join(root, ".model", "qwen2_vl"), replace_stale=not args.model_dir)
    )
    images = Images(os.path.join(root, ".images"), (448, 448))
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    result = measure(model_dir, images, PLANS[args.plan or "quick"], log=log)
    print(write(out, result))
    return 0 if result["equality"]["ok"] else 1


if __name__ == "__main__":
    from common.process import ensure_allocator_env

    ensure_allocator_env()
    sys.exit(main())
