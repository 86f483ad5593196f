"""The HTTP door against the gRPC SDK (http_overhead.py): the doors compared, and the analysis of a run's records
into TTFT ratios, the equality check, the targets and the Markdown table. Pure: records in, dicts and text out."""

from __future__ import annotations

import collections
from collections.abc import Sequence

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
DOOR_STRIDE, CELL_STRIDE = 100_000, 1_000
MIME = {"jpeg": "image/jpeg", "png": "image/png"}
ImageKind = tuple[tuple[int, int], str]  # ((width, height), "jpeg" | "png")
JPEG_448: ImageKind = ((448, 448), "jpeg")
PNG_448: ImageKind = ((448, 448), "png")
JPEG_720P: ImageKind = ((1280, 720), "jpeg")


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
