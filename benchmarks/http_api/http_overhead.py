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

from benchmarks.support import stats

GRPC_UPLOAD, GRPC_INLINE, HTTP_DATA, HTTP_UUID = "grpc-upload", "grpc-inline", "http-data", "http-uuid"
DOORS = (GRPC_UPLOAD, GRPC_INLINE, HTTP_DATA, HTTP_UUID)
LABEL = {
    GRPC_UPLOAD: "SDK, upload once",
    GRPC_INLINE: "SDK, bytes inline",
    HTTP_DATA: "openai, data: URLs",
    HTTP_UUID: "openai, uuid refs",
}
SCENARIO_DOORS = {  # text has no images: one client per door; a new image has no earlier send to refer to
    "text": (GRPC_UPLOAD, HTTP_DATA),
    "new_image": (GRPC_UPLOAD, GRPC_INLINE, HTTP_DATA),
    "cached_conversation": DOORS,
}
# (HTTP door, gRPC door, like for like?) compared per scenario. Like for like: the same bytes travel on both doors
# (inline against data: URLs, hash reference against uuid); the others compare what an application gets by default.
PAIRS = {
    "text": ((HTTP_DATA, GRPC_UPLOAD, True),),
    "new_image": ((HTTP_DATA, GRPC_INLINE, True), (HTTP_DATA, GRPC_UPLOAD, False)),
    "cached_conversation": (
        (HTTP_DATA, GRPC_INLINE, True),
        (HTTP_UUID, GRPC_UPLOAD, True),
        (HTTP_DATA, GRPC_UPLOAD, False),
    ),
}
TARGET = 1.15  # HTTP TTFT p50 <= 1.15x the gRPC SDK's, like for like
SEED = 240_000  # far from the other benchmarks' seeds
_DOOR_STRIDE, _CELL_STRIDE = 100_000, 1_000
MIME = {"jpeg": "image/jpeg", "png": "image/png"}
ImageKind = tuple[tuple[int, int], str]  # ((width, height), "jpeg" | "png")
JPEG_448: ImageKind = ((448, 448), "jpeg")
PNG_448: ImageKind = ((448, 448), "png")
JPEG_720P: ImageKind = ((1280, 720), "jpeg")


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
    return SEED + _DOOR_STRIDE * (DOORS.index(door) + 1) + _CELL_STRIDE * cell + i


def measure(
    model_dir: str,
    images,
    plan: Plan,
    on_request: Callable[[dict], None] | None = None,
    log: Callable[[str], None] = lambda _m: None,
) -> dict:
    """Base64 costs in process, then one group: warm-up, the timed rounds, the equality requests."""
    from benchmarks.support.scenarios import assistant, filler, question, user
    from mmcast_local.supervisor import LocalGroup

    decode = decode_costs(images, plan.decode_images, plan.decode_repeats)  # before the group: no contention
    records: list[dict] = []
    text_head = filler(48) + " Answer in one word."

    def path(kind: ImageKind, seed: int) -> str:
        return images.path(seed, kind[0], kind[1])

    # Every request's messages, built (and its images rendered) before the group starts.
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
    from scheduler_svc.doors.openai_schema import ChatCompletionRequest

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
            "server_parse_ms": _median_ms(lambda b=body: ChatCompletionRequest.model_validate_json(b), repeats),
            "json_loads_ms": _median_ms(lambda b=body: json.loads(b), repeats),
            "b64decode_ms": _median_ms(lambda p=payload: base64.b64decode(p, validate=True), repeats),
            "sha256_ms": _median_ms(lambda d=data: hashlib.sha256(d).hexdigest(), repeats),
        })  # fmt: skip
    return rows


# --- analysis (pure: records in, dicts out) -------------------------------------------------------------------------
def analyze(records: Sequence[dict], decode: Sequence[dict]) -> dict:
    cells: dict[tuple, dict[str, dict[int, dict]]] = collections.defaultdict(lambda: collections.defaultdict(dict))
    for r in records:
        if r["scenario"] != "warmup" and r["index"] > 0:
            cells[(r["scenario"], r["image"], r["n"])][r["door"]][r["index"]] = r
    rows, ratios = [], []
    for key in sorted(cells, key=lambda k: (list(SCENARIO_DOORS).index(k[0]), k[1], k[2])):
        by_door = cells[key]
        row = {"scenario": key[0], "image": key[1], "n": key[2], "doors": {}}
        for door, recs in by_door.items():
            ttft = [recs[i]["ttft_ms"] for i in sorted(recs)]
            cpu = [recs[i]["scheduler_cpu_ms"] for i in sorted(recs) if recs[i]["scheduler_cpu_ms"] is not None]
            row["doors"][door] = {"ttft": stats.summary(ttft), "scheduler_cpu_ms_p50": stats.median(cpu) if cpu else None,
                                  "cached_tokens": stats.median([recs[i]["cached_tokens"] for i in recs]),
                                  "prompt_tokens": stats.median([recs[i]["prompt_tokens"] for i in recs])}  # fmt: skip
        rows.append(row)
        for http, grpc, like in PAIRS[key[0]]:
            if http not in by_door or grpc not in by_door:
                continue
            both = sorted(set(by_door[http]) & set(by_door[grpc]))  # paired by round
            if len(both) < 2:
                continue
            num = [by_door[http][i]["ttft_ms"] for i in both]
            den = [by_door[grpc][i]["ttft_ms"] for i in both]
            ratio, lo, hi = stats.paired_ratio_ci(num, den)
            ratios.append(
                {
                    "scenario": key[0],
                    "image": key[1],
                    "n": key[2],
                    "http": http,
                    "grpc": grpc,
                    "like_for_like": like,
                    "ratio": ratio,
                    "ci_low": lo,
                    "ci_high": hi,
                    "pairs": len(both),
                    "http_p50": stats.median(num),
                    "grpc_p50": stats.median(den),
                    "ratio_p90": stats.percentile(num, 90) / stats.percentile(den, 90),
                }
            )
    return {
        "rows": rows,
        "ratios": ratios,
        "targets": targets(ratios),
        "equality": equality(records),
        "decode_share": decode_share(decode, rows),
    }


def equality(records: Sequence[dict]) -> dict:
    """Greedy, ignore_eos: the same request through every door returns the same text and token count. Checked on the
    text rounds (one prompt for every door) and on the image scenarios' equality requests (index -1)."""
    groups: dict[tuple, dict[str, tuple]] = collections.defaultdict(dict)
    for r in records:
        if (r["scenario"] == "text" and r["index"] > 0) or (r["scenario"] != "warmup" and r["index"] == -1):
            groups[(r["scenario"], r["image"], r["n"], r["index"])][r["door"]] = (r["text"], r["completion_tokens"])
    mismatches = [
        {"key": list(k), "answers": {d: list(v) for d, v in doors.items()}}
        for k, doors in groups.items()
        if len(set(doors.values())) > 1
    ]
    checked = sum(len(d) > 1 for d in groups.values())
    return {"checked": checked, "mismatches": mismatches, "ok": checked > 0 and not mismatches}


def _cell_name(scenario: str, image: str, n: int) -> str:
    if scenario == "text":
        return "text only"
    if scenario == "new_image":
        return f"one new {image}"
    return f"conversation, {n} × {image} ({n - 1} cached)"


def targets(ratios: Sequence[dict]) -> list[dict]:
    """Per scenario cell: every like-for-like HTTP ÷ gRPC TTFT p50 at most TARGET."""
    out = []
    by_cell: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in ratios:
        if r["like_for_like"]:
            by_cell[(r["scenario"], r["image"], r["n"])].append(r)
    for (scenario, image, n), rs in by_cell.items():
        measured = "; ".join(
            f"{r['http']} ÷ {r['grpc']} {r['ratio']:.2f}× [{r['ci_low']:.2f}, {r['ci_high']:.2f}] "
            f"({r['http_p50']:.1f} / {r['grpc_p50']:.1f} ms)"
            for r in rs
        )
        out.append(
            {
                "name": f"HTTP TTFT p50 ≤ {TARGET}× gRPC SDK: {_cell_name(scenario, image, n)}",
                "target": f"≤ {TARGET}×",
                "measured": measured,
                "status": "met" if all(r["ratio"] <= TARGET for r in rs) else "MISSED",
            }
        )
    return out


def decode_share(decode: Sequence[dict], rows: Sequence[dict]) -> list[dict]:
    """Each base64 row beside the HTTP door's TTFT p50 on a new image of that kind (when the run timed one)."""
    ttft = {
        r["image"]: r["doors"][HTTP_DATA]["ttft"]["p50"]
        for r in rows
        if r["scenario"] == "new_image" and HTTP_DATA in r["doors"]
    }
    out = []
    for d in decode:
        client = d["client_encode_ms"] + d["client_json_ms"]
        server = d["server_parse_ms"] + d["b64decode_ms"] + d["sha256_ms"]
        t = ttft.get(d["image"])
        out.append(
            {
                **d,
                "client_ms": client,
                "server_ms": server,
                "http_ttft_p50_ms": t,
                "client_share": client / t if t else None,
                "server_share": server / t if t else None,
            }
        )
    return out


# --- Markdown -----------------------------------------------------------------------------------------------------
def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.2f} %" if v < 0.01 else f"{100 * v:.1f} %"


def markdown(result: dict) -> str:
    lines = [
        "Client-side TTFT (request built → first content token), ms, p50 / p90 over "
        f"{result['plan']['repeats']} interleaved rounds; scheduler CPU ms per request (p50) in brackets.",
        "",
        "| scenario | " + " | ".join(LABEL[d] for d in DOORS) + " |",
        "|---|" + "---|" * len(DOORS),
    ]
    for row in result["rows"]:
        cells = []
        for d in DOORS:
            v = row["doors"].get(d)
            cpu = v and v["scheduler_cpu_ms_p50"]
            cells.append(
                "–"
                if v is None
                else f"{v['ttft']['p50']:.1f} / {v['ttft']['p90']:.1f}" + (f" [{cpu:.1f}]" if cpu is not None else "")
            )
        lines.append(f"| {_cell_name(row['scenario'], row['image'], row['n'])} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "HTTP ÷ gRPC TTFT (ratio of p50s, 95 % bootstrap interval over paired rounds; p90 ratio beside). "
        "Like for like: the same bytes on both doors (data: URLs against inline bytes, uuid against hash "
        "references).",
        "",
        "| scenario | HTTP door | gRPC door | like for like | p50 ratio [95 % CI] | p90 ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["ratios"]:
        lines.append(
            f"| {_cell_name(r['scenario'], r['image'], r['n'])} | {LABEL[r['http']]} | {LABEL[r['grpc']]} | "
            f"{'yes' if r['like_for_like'] else 'no'} | {r['ratio']:.2f}× [{r['ci_low']:.2f}, "
            f"{r['ci_high']:.2f}] | {r['ratio_p90']:.2f}× |"
        )
    lines += ["", "| target | goal | measured | status |", "|---|---|---|---|"]
    lines += [f"| {t['name']} | {t['target']} | {t['measured']} | {t['status']} |" for t in result["targets"]]
    lines += [
        "",
        "Base64 per image, in process (median ms; client: `b64encode` into the data: URL + `json.dumps` of "
        "the body; server: the door's pydantic parse of the body (`json.loads` beside it), "
        "`b64decode(validate=True)`, sha256), and as a share of the HTTP door's TTFT p50 on one new image of "
        "that kind (– where the plan timed none).",
        "",
        "| image | file | base64 | client encode + JSON | server parse (json.loads) | b64decode | sha256 | "
        "server total | share of TTFT: client / server |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d in result["decode_share"]:
        lines.append(
            f"| {d['image']} | {d['file_bytes'] / 1e3:.1f} kB | {d['base64_chars'] / 1e3:.1f} kB | "
            f"{d['client_encode_ms']:.3f} + {d['client_json_ms']:.3f} | {d['server_parse_ms']:.3f} "
            f"({d['json_loads_ms']:.3f}) | {d['b64decode_ms']:.3f} | {d['sha256_ms']:.3f} | "
            f"{d['server_ms']:.3f} | {_pct(d['client_share'])} / {_pct(d['server_share'])} |"
        )
    eq = result["equality"]
    lines += [
        "",
        f"Equal answers across doors: {'yes' if eq['ok'] else 'NO'} ({eq['checked']} requests sent through "
        f"every door; {len(eq['mismatches'])} mismatches). Load average before / after: "
        f"{result['loadavg_before']} / {result['loadavg_after']}.",
    ]
    return "\n".join(lines)


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
