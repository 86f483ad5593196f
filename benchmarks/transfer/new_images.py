"""The ``new_images`` scenario: what an image the group has never seen costs, per payload encoding and encoder
placement (issue 15).

For every tensor-parallel size and every variant of ``VARIANTS`` (scheduler flags ``--payload-encoding`` and
``--encoder-placement``), a fresh local group in the ``lazy`` transfer mode is warmed (one request holding one new
image of each image set) and then sent requests holding 1, 4, 8 images it has never seen (fresh synthetic seeds; the
same seeds in every group, so every variant must return the same tokens). At TP1 the one rank owns every image, so
``encoded+replicated`` is the same configuration as ``encoded+sharded`` and runs at TP2 and above only. Per new image, for each (TP, variant, image set):

- bytes on the scheduler→ranks path: ``Usage.payload_bytes_broadcast`` and the scheduler's
  ``mmcast_broadcast_bytes_total{kind="payload"}`` delta (frame bytes, summed over ranks), beside the client's file;
- encoder runs over the group (``Usage.encoder_runs``, and ``mmcast_encoder_runs_total``);
- the encoder output the owner rank shared over the group's collective (``Usage.encoder_output_bytes_shared``, and
  the ranks' ``mmcast_worker_encoder_collective_bytes_total``) and the collective's seconds;
- CPU seconds of the scheduler process and of all ranks (``benchmarks.support.proc_memory.cpu_seconds`` around each
  request), and the frontend's own image CPU (``Usage.image_cpu_time``);
- the TTFT slope: least-squares client TTFT against the number of new images.

CPU and TTFT per new image are least-squares slopes against N (the request's fixed cost — tokenizing, decode
steps, the RPC — falls into the intercept); where a set has one N only they are totals divided by the images.
Bytes, runs and collective bytes carry no fixed part and are totals divided by the images. A field this build does
not report reads None ("–" in the tables), never 0.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Sequence

from benchmarks.support import stats

# variant -> scheduler flags. The first is the float32-pixels baseline (the only path before issue 15).
VARIANTS: dict[str, tuple[str, ...]] = {
    "pixels+replicated": ("--payload-encoding", "pixels", "--encoder-placement", "replicated"),
    "encoded+replicated": ("--payload-encoding", "encoded", "--encoder-placement", "replicated"),
    "encoded+sharded": ("--payload-encoding", "encoded", "--encoder-placement", "sharded"),
}
BASELINE, CANDIDATE = "pixels+replicated", "encoded+sharded"
TARGET_TP = 2  # the comparison is at TP=2
TARGETS = {  # baseline / candidate per new image, at least
    "bytes": 10.0,  # scheduler→ranks payload bytes, 448x448 JPEG
    "cpu": 5.0,  # scheduler CPU seconds
    "ttft": 1.5,  # TTFT slope
}
BYTES_TARGET_IMAGE = "448x448 jpeg"
SEED = 70_000  # far from the other scenarios' seeds (benchmarks.run.SEEDS)
_MAX_N = 50  # images per request a seed block holds


@dataclasses.dataclass(frozen=True)
class ImageSet:
    """Requests of ``ns`` new images of one size and format, each N ``repeats`` times."""

    size: tuple[int, int]  # (width, height)
    fmt: str  # "jpeg" | "png"
    ns: tuple[int, ...]  # new images per request
    repeats: int

    def __post_init__(self) -> None:
        if self.fmt not in ("jpeg", "png"):
            raise ValueError(f"ImageSet.fmt={self.fmt!r}; choose 'jpeg' or 'png'")
        if not self.ns or not all(1 <= n <= _MAX_N for n in self.ns):
            raise ValueError(f"ImageSet.ns={self.ns}: each N must be in [1, {_MAX_N}]")
        if self.repeats < 1:
            raise ValueError(f"ImageSet.repeats={self.repeats} must be >= 1")

    @property
    def label(self) -> str:
        return f"{self.size[0]}x{self.size[1]} {self.fmt}"


def seeds(set_index: int, repeat: int, n_index: int, n: int) -> list[int]:
    """The synthetic seeds of one request: distinct for every (set, repeat, N) — repeat 0 is the warm-up — and the
    same in every group."""
    base = SEED + 100_000 * set_index + 1_000 * repeat + _MAX_N * n_index
    return [base + i for i in range(n)]


def plan_requests(sets: Sequence[ImageSet]) -> Iterator[tuple[int, ImageSet, int, int, int]]:
    """(set index, set, repeat, N index, N) of every timed request, in run order: round by round, N ascending in
    odd rounds and descending in even ones (a drift of the machine's speed does not tilt the slope), the sets
    interleaved within a round."""
    rounds = max(s.repeats for s in sets)
    for r in range(1, rounds + 1):
        all_ns = sorted({n for s in sets for n in s.ns}, reverse=r % 2 == 0)
        for n in all_ns:
            for k, s in enumerate(sets):
                if r <= s.repeats and n in s.ns:
                    yield k, s, r, s.ns.index(n), n


def planned_requests(sets: Sequence[ImageSet]) -> int:
    """Requests one group makes (the warm-up included), for the progress bar."""
    return 1 + sum(1 for _ in plan_requests(sets))


def groups(tps: Sequence[int], variants: Sequence[str] = tuple(VARIANTS)) -> tuple[tuple[int, str], ...]:
    """(TP, variant) of every group to run; at TP1 placement means nothing (one rank), so only one encoded variant."""
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"new-image variant {v!r}; choose from {list(VARIANTS)}")
    return tuple((tp, v) for tp in tps for v in variants if not (tp == 1 and v == "encoded+replicated"))


def run_variant(
    model_dir: str,
    tp: int,
    variant: str,
    sets: Sequence[ImageSet],
    images,
    *,
    max_tokens: int,
    kv_blocks: int,
    on_record: Callable,
) -> dict:
    """One fresh group of ``variant`` at ``tp``: warm-up, then every request of ``plan_requests``; returns what the
    group cost to start."""
    from benchmarks.support.scenarios import Session, question, user
    from mmcast_local.supervisor import LocalGroup

    def paths(k: int, r: int, j: int, n: int) -> list[str]:
        return [images.path(seed, sets[k].size, sets[k].fmt) for seed in seeds(k, r, j, n)]

    for k, _, r, j, n in plan_requests(sets):  # rendered before the group starts: not timed, no CPU contention
        paths(k, r, j, n)
    t0 = time.monotonic()
    load = [round(x, 2) for x in os.getloadavg()]
    with LocalGroup(model_dir, tp=tp, transfer_mode="lazy", kv_blocks=kv_blocks,
                    scheduler_args=list(VARIANTS[variant])) as group:  # fmt: skip
        started = time.monotonic() - t0
        session = Session(group, tp, "lazy", max_tokens, on_record, variant=variant)
        try:
            files = [f for k in range(len(sets)) for f in paths(k, 0, 0, 1)]  # every size and format once
            session.run(
                [user(files, question(0))],
                scenario="new_images",
                kind="warm",
                n=len(files),
                index=0,
                image="+".join(s.label for s in sets),
                image_bytes=_size(files),
            )
            for k, s, r, j, n in plan_requests(sets):
                files = paths(k, r, j, n)
                session.run(
                    [user(files, question(r))],
                    scenario="new_images",
                    kind="image",
                    n=n,
                    index=r,
                    image=s.label,
                    image_bytes=_size(files),
                )
        finally:
            session.close()
    return {
        "scenario": "new_images",
        "tp": tp,
        "mode": "lazy",
        "variant": variant,
        "startup_seconds": started,
        "seconds": time.monotonic() - t0,
        "loadavg": load,
    }


def _size(files: Sequence[str]) -> int:
    return sum(os.path.getsize(f) for f in files)


# --- analysis (pure: records in, dicts out) ----------------------------------------------------------------------
def _sum_field(rows: Sequence[dict], where: str, key: str) -> float | None:
    """Sum of rows[where][key]; None if any row lacks it (a counter this build does not have)."""
    values = [r[where].get(key) for r in rows]
    return None if any(v is None for v in values) else float(sum(values))


def _per_image(rows: Sequence[dict], where: str, key: str, scale: float = 1.0) -> float | None:
    total = _sum_field(rows, where, key)
    images = sum(r["n"] for r in rows)
    return None if total is None or not images else total * scale / images


def _slope_or_mean(rows: Sequence[dict], value: Callable[[dict], float | None]) -> dict | None:
    """Per new image: the least-squares slope against N (with its 95 % CI) when there are two N or more, else the
    mean per image (``slope`` then holds that mean and ``n`` is 0)."""
    pts = [(r["n"], value(r)) for r in rows]
    if not pts or any(v is None for _, v in pts):
        return None
    if len({n for n, _ in pts}) >= 2 and len(pts) >= 3:
        return stats.fit_slope([n for n, _ in pts], [v for _, v in pts]).as_dict()
    per = sum(v for _, v in pts) / sum(n for n, _ in pts)
    return {"slope": per, "intercept": 0.0, "stderr": 0.0, "df": 0, "ci_low": per, "ci_high": per, "n": 0}


def _cpu_ms(key: str) -> Callable[[dict], float | None]:
    return lambda r: None if r["metrics"].get(key) is None else r["metrics"][key] * 1e3


def _floor(floors: Sequence[dict], transport: str, size: str, ranks: int) -> float | None:
    hit = [f for f in floors if (f["transport"], f["size"], f["ranks"]) == (transport, size, ranks)]
    return hit[0]["p50_ms"] if hit else None


def variant_rows(records: Sequence[dict], floors: Sequence[dict]) -> list[dict]:
    """One row per (TP, variant, image set) of the timed new-image requests."""
    timed = [r for r in records if r["scenario"] == "new_images" and r["kind"] == "image"]
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in timed:
        groups[(r["tp"], r["variant"], r["image"])].append(r)
    order = {v: i for i, v in enumerate(VARIANTS)}
    out = []
    for (tp, variant, image), rs in sorted(groups.items(), key=lambda g: (g[0][0], g[0][2], order.get(g[0][1], 99))):
        size = image.split()[0]
        out.append({
            "tp": tp, "variant": variant, "image": image, "requests": len(rs), "images": sum(r["n"] for r in rs),
            "ns": sorted({r["n"] for r in rs}),
            "file_bytes": sum(r["image_bytes"] for r in rs) / sum(r["n"] for r in rs),
            "payload_bytes_usage": _per_image(rs, "usage", "payload_bytes_broadcast"),
            "payload_bytes_wire": _per_image(rs, "metrics", "payload_bytes"),
            "payload_bytes_workers": _per_image(rs, "metrics", "worker_payload_bytes"),
            "images_sent": _per_image(rs, "usage", "images_sent"),
            "encoder_runs": _per_image(rs, "usage", "encoder_runs"),
            "encoder_runs_metric": _per_image(rs, "metrics", "encoder_runs"),
            "encoder_runs_ranks": _per_image(rs, "metrics", "worker_encoder_runs"),  # counted where they ran
            "collective_bytes": _per_image(rs, "usage", "encoder_output_bytes_shared"),
            "collective_bytes_metric": _per_image(rs, "metrics", "encoder_output_shared_bytes"),
            "collective_bytes_workers": _per_image(rs, "metrics", "worker_collective_bytes"),
            "collective_ms": _per_image(rs, "metrics", "worker_collective_seconds_sum", 1e3),
            "rank_preprocess_ms": _per_image(rs, "metrics", "worker_preprocess_seconds_sum", 1e3),
            "frontend_image_cpu_ms": _per_image(rs, "usage", "image_cpu_seconds", 1e3),
            "scheduler_cpu_ms": _slope_or_mean(rs, _cpu_ms("scheduler_cpu_seconds")),
            "rank_cpu_ms": _slope_or_mean(rs, _cpu_ms("rank_cpu_seconds")),
            "ttft_ms": _slope_or_mean(rs, lambda r: r["ttft_ms"]),
            "ttft_p50_by_n": {n: stats.median([r["ttft_ms"] for r in rs if r["n"] == n])
                              for n in sorted({r["n"] for r in rs})},
            # what moving the float32 pixel_values of one such image to tp rank processes costs at best (floors.py)
            "floor_grpc_ms": _floor(floors, "grpc", size, tp), "floor_tcp_ms": _floor(floors, "tcp", size, tp),
            "floor_shm_ms": _floor(floors, "shm", size, tp),
        })  # fmt: skip
    return out


def _ratio(base: float | None, cand: float | None) -> float | None:
    """base / cand; inf when the candidate is ≤ 0 and the baseline is positive (nothing measurable is left)."""
    if base is None or cand is None:
        return None
    if cand <= 0:
        return float("inf") if base > 0 else None
    return base / cand


def _slope(row: dict, key: str) -> float | None:
    return row[key]["slope"] if row[key] else None


def _fitted_ratio(base: dict, cand: dict, key: str) -> float | None:
    """base / cand of two per-image slopes; None unless both are fitted (a ratio of means would compare the
    requests' fixed costs too)."""
    if not (base[key] and cand[key] and base[key]["n"] and cand[key]["n"]):
        return None
    return _ratio(base[key]["slope"], cand[key]["slope"])


def comparisons(rows: Sequence[dict]) -> list[dict]:
    """CANDIDATE against BASELINE for every (TP, image set) that ran both: baseline / candidate per new image."""
    by = {(r["tp"], r["variant"], r["image"]): r for r in rows}
    out = []
    for (tp, variant, image), base in by.items():
        cand = by.get((tp, CANDIDATE, image))
        if variant != BASELINE or cand is None:
            continue
        out.append({
            "tp": tp, "image": image,
            "bytes": _ratio(base["payload_bytes_wire"], cand["payload_bytes_wire"]),
            "bytes_base": base["payload_bytes_wire"], "bytes_cand": cand["payload_bytes_wire"],
            "collective_bytes_base": base["collective_bytes"], "collective_bytes_cand": cand["collective_bytes"],
            "cpu": _fitted_ratio(base, cand, "scheduler_cpu_ms"),
            "cpu_base": _slope(base, "scheduler_cpu_ms"), "cpu_cand": _slope(cand, "scheduler_cpu_ms"),
            "ttft": _fitted_ratio(base, cand, "ttft_ms"),
            "ttft_base": _slope(base, "ttft_ms"), "ttft_cand": _slope(cand, "ttft_ms"),
            "encoder_runs_base": base["encoder_runs"], "encoder_runs_cand": cand["encoder_runs"],
        })  # fmt: skip
    return sorted(out, key=lambda c: (c["tp"], c["image"]))


def _x(v: float | None) -> str:
    if v is None:
        return "–"
    return "∞" if v == float("inf") else f"{v:.1f}×" if v >= 10 else f"{v:.2f}×"  # 1.46× must not read as 1.5×


def targets(comps: Sequence[dict]) -> list[dict]:
    """The issue-15 targets at TARGET_TP: status met / MISSED / not measured, with every image set's figure."""
    at = [c for c in comps if c["tp"] == TARGET_TP]
    out = []

    def row(name: str, goal: str, measured: str, ok: bool | None) -> dict:
        return {
            "name": name,
            "target": goal,
            "measured": measured,
            "status": {True: "met", False: "MISSED", None: "not measured"}[ok],
        }

    head = f"{CANDIDATE} vs {BASELINE}, TP{TARGET_TP}"
    byte_hit = [c for c in at if c["image"] == BYTES_TARGET_IMAGE and c["bytes"] is not None]
    others = "; ".join(f"{c['image']}: {_x(c['bytes'])}" for c in at if c["image"] != BYTES_TARGET_IMAGE)
    out.append(row(f"{head}: payload bytes per new image, scheduler→ranks ({BYTES_TARGET_IMAGE})",
                   f"≥ {TARGETS['bytes']:.0f}× lower",
                   "; ".join(f"{_x(c['bytes'])} ({_b(c['bytes_base'])} → {_b(c['bytes_cand'])}, collective "
                             f"{_b(c['collective_bytes_cand'])} beside)" for c in byte_hit) + (
                       f" [other sets: {others}]" if others else "") if byte_hit else "–",
                   all(c["bytes"] >= TARGETS["bytes"] for c in byte_hit) if byte_hit else None))  # fmt: skip
    for key, name, unit in (("cpu", "scheduler CPU per new image", "ms"), ("ttft", "TTFT slope per new image", "ms")):
        hits = [c for c in at if c[key] is not None]
        out.append(row(f"{head}: {name}", f"≥ {TARGETS[key]}× lower",
                       "; ".join(f"{c['image']}: {_x(c[key])} ({c[key + '_base']:.2f} → {c[key + '_cand']:.2f} "
                                 f"{unit})" for c in hits) or "–",
                       all(c[key] >= TARGETS[key] for c in hits) if hits else None))  # fmt: skip
    return out


def analyze(records: Sequence[dict], floors: Sequence[dict]) -> dict:
    rows = variant_rows(records, floors)
    comps = comparisons(rows)
    return {"rows": rows, "comparisons": comps, "targets": targets(comps) if rows else []}


# --- Markdown -----------------------------------------------------------------------------------------------------
def _b(n: float | None) -> str:
    if n is None:
        return "–"
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB" if n >= 1e3 else f"{n:.0f} B"


def _n(v: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if v is None else fmt.format(v)


def _s(s: dict | None) -> str:
    if s is None:
        return "–"
    return f"{s['slope']:.2f}" + (f" [{s['ci_low']:.2f}, {s['ci_high']:.2f}]" if s["n"] else " (mean)")


def markdown(analysis: dict) -> str:
    """Per-variant figures per new image, then the comparison against the baseline."""
    rows = analysis["rows"]
    if not rows:
        return ""
    lines = ["| TP | image | variant | file | payload → ranks (wire / Usage) | encoder runs | collective bytes | "
             "collective ms (incl. waits) | scheduler CPU ms [95 % CI] | frontend image CPU ms | rank CPU ms | TTFT slope ms "
             "[95 % CI] | pixels floor gRPC / shm ms |", "|" + "---|" * 13]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['tp']} | {r['image']} | {r['variant']} | {_b(r['file_bytes'])} | {_b(r['payload_bytes_wire'])} / "
            f"{_b(r['payload_bytes_usage'])} | {_n(r['encoder_runs'])} | {_b(r['collective_bytes'])} | "
            f"{_n(r['collective_ms'])} | {_s(r['scheduler_cpu_ms'])} | {_n(r['frontend_image_cpu_ms'])} | "
            f"{_s(r['rank_cpu_ms'])} | {_s(r['ttft_ms'])} | {_n(r['floor_grpc_ms'])} / {_n(r['floor_shm_ms'])} |"
        )
    comps = analysis["comparisons"]
    if comps:
        lines += ["", f"{CANDIDATE} against {BASELINE} (baseline ÷ candidate per new image; targets at TP"
                  f"{TARGET_TP}: bytes ≥ {TARGETS['bytes']:.0f}× for {BYTES_TARGET_IMAGE}, scheduler CPU ≥ "
                  f"{TARGETS['cpu']:.0f}×, TTFT slope ≥ {TARGETS['ttft']}×):", "",
                  "| TP | image | payload bytes | scheduler CPU | TTFT slope | encoder runs | collective bytes |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for c in comps:
            lines.append(
                f"| {c['tp']} | {c['image']} | {_x(c['bytes'])} | {_x(c['cpu'])} | {_x(c['ttft'])} | "
                f"{_n(c['encoder_runs_base'])} → {_n(c['encoder_runs_cand'])} | "
                f"{_b(c['collective_bytes_base'])} → {_b(c['collective_bytes_cand'])} |"
            )
    return "\n".join(lines)
