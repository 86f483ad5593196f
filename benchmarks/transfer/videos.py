"""The video scenarios of ``benchmarks/run.py``: the headline experiment of issue 7 for video inputs.

A video is a media item like an image (the same prefix-cache, strip, lazy and rank-cache machinery), so the
question is the images': what does a *cached* clip still cost per request, and what does each transfer mode send?
The scenarios run inside the transfer-mode groups of ``run.run_config`` (the same group, the same ``Session``, the
same scraped counters as the image scenarios: ``full``, ``strip`` and ``lazy`` side by side in one run, on the
frontend's ``pixels`` payload with the encoder replicated, the heaviest payload a mode can save), through the SDK,
each clip a file on disk (``{"type": "video", "video": path, "fps": 2.0}``: hashed and uploaded once):

- ``video_cached``: N = 1, 2, 4, 8 distinct clips (``VideoPlan.seconds`` s each, sampled at ``sample_fps``) in one
  conversation's first user turn, sent once to warm the caches; then the same turn, the fixed answer and a new
  question, timed ``repeats`` times, the order of N alternating by round (a drift of the machine's speed does not
  tilt the slope). Figures: client TTFT p50 per N, the least-squares TTFT slope against N over every timed request
  (ms per cached clip, 95 % CI), and the payload bytes per request (scheduler→ranks frames, summed over ranks).
- ``video_new``: one never-seen clip and a question per request (fresh seeds, the same in every group): the TTFT a
  new clip costs (container probe, decode of the sampled frames, preprocessing, payload, encoder, prefill).
- ``video_stream``: the live-stream conversation. Turn t brings segment t of one panning camera
  (``mmcast_local.synthetic_video.stream_segment``: consecutive MP4 files of ``seconds`` each) and the prompt is
  rebuilt as one user turn holding the last ``window`` segments and a question. Once the window has filled, every
  turn drops the oldest segment, so the prompt's prefix differs from the first segment on: what each mode sends and
  encodes per turn then is the live stream's steady state. Figures over the turns after the window filled (turn >
  ``window``): TTFT p50, payload bytes, encoder runs (``Usage.encoder_runs``) and payload deliveries
  (``Usage.images_sent``, which counts videos too) per turn, and deliveries per distinct segment per rank over the
  whole stream.

Payload bytes are the scheduler's ``mmcast_broadcast_bytes_total{kind="payload"}`` delta around the request (the
wire frames, summed over ranks; cross-checked against the ranks' received bytes by ``report.byte_crosscheck``).
Every request is also checked for equal tokens across the modes (``report.mode_equality``). ``analyze`` is pure
(records in, dicts out); ``markdown`` and ``plot`` render it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Sequence

from benchmarks.support import stats

SEEDS = {"cached": 80_000, "new": 81_000, "stream": 82_000}
SCENARIOS = ("video_cached", "video_new", "video_stream")


@dataclasses.dataclass(frozen=True)
class VideoPlan:
    ns: tuple[int, ...] = (1, 2, 4, 8)  # distinct cached clips in the prefix
    repeats: int = 3  # timed follow-up questions per N
    new_repeats: int = 3  # requests of one never-seen clip
    stream_turns: int = 7  # live-stream turns, one new segment each
    window: int = 3  # segments the live stream keeps
    modes: tuple[str, ...] = ("full", "strip", "lazy")  # the transfer-mode groups that run the video scenarios
    tps: tuple[int, ...] = (1, 2)
    seconds: float = 2.0  # of every clip and segment
    clip_fps: int = 8  # frames per second of the files
    sample_fps: float = 2.0  # frames the request asks the video processor to sample per second
    size: tuple[int, int] = (320, 180)  # (width, height) of a frame

    def __post_init__(self) -> None:
        if not self.ns or min(self.ns) < 1 or self.repeats < 1 or self.window < 1 or self.stream_turns < 1:
            raise ValueError(f"VideoPlan: N >= 1, repeats >= 1, window >= 1 and turns >= 1 ({self})")

    def runs(self, tp: int, mode: str) -> bool:
        return tp in self.tps and mode in self.modes

    @property
    def label(self) -> str:
        w, h = self.size
        return f"{w}x{h} {self.seconds:g}s@{self.clip_fps}fps mp4, sampled {self.sample_fps:g} fps"


class Clips:
    """Synthetic MP4 clips and stream segments as files (a path lets the SDK hash and upload each once, as a real
    application's would); rendered once and kept for later runs."""

    def __init__(self, directory: str, plan: VideoPlan) -> None:
        self.directory = directory
        self.plan = plan
        os.makedirs(directory, exist_ok=True)

    def path(self, seed: int, index: int = 0) -> str:
        """Segment ``index`` of stream ``seed`` (index 0 is a whole clip)."""
        from mmcast_local.synthetic_video import stream_segment

        p = self.plan
        w, h = p.size
        path = os.path.join(self.directory, f"clip-{w}x{h}-{p.seconds:g}s-{p.clip_fps}fps-{seed}-{index}.mp4")
        if not os.path.exists(path):
            data = stream_segment(seed, index, seconds=p.seconds, fps=p.clip_fps, size=p.size)
            tmp = f"{path}.{os.getpid()}.tmp"  # concurrent runs may share the folder
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return path


def cached_seeds(n_index: int, n: int) -> list[int]:
    return [SEEDS["cached"] + 100 * n_index + i for i in range(n)]


def prepare(clips: Clips) -> None:
    """Renders every file the scenarios send, before any group starts (not timed, no CPU contention)."""
    p = clips.plan
    for k, n in enumerate(p.ns):
        for seed in cached_seeds(k, n):
            clips.path(seed)
    for r in range(1, p.new_repeats + 1):
        clips.path(SEEDS["new"] + r)
    for t in range(p.stream_turns):
        clips.path(SEEDS["stream"], t)


def planned_requests(plan: VideoPlan) -> int:
    """Requests one group makes for the video scenarios (warm-ups included), for the progress bar."""
    return len(plan.ns) * (1 + plan.repeats) + plan.new_repeats + plan.stream_turns


def video_user(paths: Sequence[str], text: str, fps: float) -> dict:
    return {
        "role": "user",
        "content": [{"type": "video", "video": p, "fps": fps} for p in paths] + [{"type": "text", "text": text}],
    }


def _bytes(paths: Sequence[str]) -> int:
    return sum(os.path.getsize(p) for p in paths)


def run_scenarios(session, clips: Clips) -> None:
    """The three scenarios on one group's ``benchmarks.support.scenarios.Session`` (SDK client, upload once)."""
    from benchmarks.support.scenarios import assistant, question, user

    p = clips.plan
    label = p.label

    def run(paths, messages, scenario, kind, n, index):
        session.run(messages, scenario=scenario, kind=kind, n=n, index=index, image=label, image_bytes=_bytes(paths))

    heads = {}
    for k, n in enumerate(p.ns):
        paths = [clips.path(s) for s in cached_seeds(k, n)]
        heads[n] = (paths, [video_user(paths, f"Here are {n} clips.", p.sample_fps), assistant()])
        run(paths, [*heads[n][1], user([], question(0))], "video_cached", "warm", n, 0)
    for r in range(1, p.repeats + 1):
        for n in p.ns if r % 2 else list(reversed(p.ns)):
            paths, head = heads[n]
            run(paths, [*head, user([], question(r))], "video_cached", "video", n, r)
    for r in range(1, p.new_repeats + 1):
        paths = [clips.path(SEEDS["new"] + r)]
        run(paths, [video_user(paths, question(r), p.sample_fps)], "video_new", "video", 1, r)
    segments = [clips.path(SEEDS["stream"], t) for t in range(p.stream_turns)]
    for t in range(p.stream_turns):
        kept = segments[max(0, t - p.window + 1) : t + 1]
        run(kept, [video_user(kept, question(t), p.sample_fps)], "video_stream", "video", len(kept), t)


# --- analysis (pure: records in, dicts out) ----------------------------------------------------------------------
_MODE_ORDER = {"full": 0, "strip": 1, "lazy": 2}


def _group(records: Sequence[dict], *keys: str) -> dict[tuple, list[dict]]:
    """Records by ``keys``, in order (transfer modes as full, strip, lazy)."""
    out: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in records:
        out[tuple(r[k] for k in keys)].append(r)

    def order(item: tuple) -> tuple:
        return tuple((_MODE_ORDER.get(v, 9), v) if k == "mode" else (0, v) for k, v in zip(keys, item[0], strict=True))

    return dict(sorted(out.items(), key=order))


def _median(rows: Sequence[dict], where: str, key: str) -> float | None:
    """Median of rows[where][key]; None when a row lacks it (a counter this build does not have) or there are none."""
    values = [r[where].get(key) for r in rows]
    return None if not values or any(v is None for v in values) else stats.median(values)


def _slope(rows: Sequence[dict]) -> dict | None:
    if len({r["n"] for r in rows}) < 2 or len(rows) < 3:
        return None
    return stats.fit_slope([r["n"] for r in rows], [r["ttft_ms"] for r in rows]).as_dict()


def _per_clip_cpu(rows: Sequence[dict]) -> float | None:
    values = [r["usage"].get("image_cpu_seconds") for r in rows]
    if not values or any(v is None for v in values):
        return None
    return stats.median([v * 1e3 / r["n"] for v, r in zip(values, rows, strict=True)])


def cached_rows(records: Sequence[dict]) -> list[dict]:
    """One row per (TP, mode, client) of the timed ``video_cached`` requests."""
    timed = [r for r in records if r["scenario"] == "video_cached" and r["kind"] == "video"]
    out = []
    for (tp, mode, client), rs in _group(timed, "tp", "mode", "client").items():
        by_n = _group(rs, "n")
        out.append({
            "tp": tp, "mode": mode, "client": client, "requests": len(rs), "ns": [n for (n,) in by_n],
            "ttft_p50_by_n": {n: stats.median([r["ttft_ms"] for r in g]) for (n,), g in by_n.items()},
            "slope": _slope(rs),
            "payload_bytes_by_n": {n: _median(g, "metrics", "payload_bytes") for (n,), g in by_n.items()},
            "payload_bytes_usage_by_n": {n: _median(g, "usage", "payload_bytes_broadcast") for (n,), g in by_n.items()},
            "encoder_runs_by_n": {n: _median(g, "usage", "encoder_runs") for (n,), g in by_n.items()},
            "prompt_tokens_by_n": {n: g[0]["usage"]["prompt_tokens"] for (n,), g in by_n.items()},
            "cached_tokens_by_n": {n: _median(g, "usage", "cached_tokens") for (n,), g in by_n.items()},
            "videos_by_n": {n: g[0]["usage"].get("videos") for (n,), g in by_n.items()},
            # the scheduler's CPU on the request's media (Usage.image_cpu_seconds) per cached clip, at the largest N
            "frontend_cpu_ms_per_clip": _per_clip_cpu(by_n[max(by_n)]) if by_n else None,
        })  # fmt: skip
    return out


def new_rows(records: Sequence[dict]) -> list[dict]:
    """One row per (TP, mode, client) of the ``video_new`` requests (one never-seen clip each)."""
    rows = [r for r in records if r["scenario"] == "video_new" and r["kind"] == "video"]
    out = []
    for (tp, mode, client), rs in _group(rows, "tp", "mode", "client").items():
        out.append({
            "tp": tp, "mode": mode, "client": client, "requests": len(rs),
            "ttft_p50_ms": stats.median([r["ttft_ms"] for r in rs]),
            "file_bytes": stats.median([r["image_bytes"] for r in rs]),
            "payload_bytes": _median(rs, "metrics", "payload_bytes"),
            "encoder_runs": _median(rs, "usage", "encoder_runs"),
            "prompt_tokens": rs[0]["usage"]["prompt_tokens"],
        })  # fmt: skip
    return out


def stream_rows(records: Sequence[dict], window: int | None = None) -> list[dict]:
    """One row per (TP, mode, client) of the ``video_stream`` turns; the steady-state figures are over the turns
    after the window filled (0-based index >= window: each drops the oldest segment); ``window`` defaults to the
    most segments any turn held."""
    turns = [r for r in records if r["scenario"] == "video_stream"]
    out = []
    for (tp, mode, client), rs in _group(turns, "tp", "mode", "client").items():
        rs = sorted(rs, key=lambda r: r["index"])
        w = window or max(r["n"] for r in rs)
        steady = [r for r in rs if r["index"] >= w]
        sent = [r["usage"].get("images_sent") for r in rs]
        out.append({
            "tp": tp, "mode": mode, "client": client, "turns": len(rs), "window": w, "steady_turns": len(steady),
            "ttft_ms": [r["ttft_ms"] for r in rs],
            "payload_bytes": [r["metrics"]["payload_bytes"] for r in rs],
            "encoder_runs": [r["usage"].get("encoder_runs") for r in rs],
            "images_sent": sent,
            "segment_file_bytes": stats.median([r["image_bytes"] / r["n"] for r in rs]),
            "ttft_p50_after_window_ms": stats.median([r["ttft_ms"] for r in steady]) if steady else None,
            "payload_bytes_per_turn": _median(steady, "metrics", "payload_bytes"),
            "encoder_runs_per_turn": _median(steady, "usage", "encoder_runs"),
            "deliveries_per_turn": _median(steady, "usage", "images_sent"),
            # one new segment per turn: every delivery beyond one per segment per rank is a resend
            "deliveries_per_segment_rank": None if any(s is None for s in sent) else sum(sent) / (len(rs) * tp),
        })  # fmt: skip
    return out


def _target(name: str, goal: str, measured: str, ok: bool | None) -> dict:
    return {"name": name, "target": goal, "measured": measured,
            "status": {True: "met", False: "MISSED", None: "not measured"}[ok]}  # fmt: skip


def targets(analysis: dict) -> list[dict]:
    """Issue 7's cached-payload target, for videos; and the live stream's one delivery per segment in lazy."""
    out = []
    cached = [r for r in analysis["cached"] if r["mode"] in ("strip", "lazy")]
    worst = [b for r in cached for b in r["payload_bytes_by_n"].values()]
    if cached:
        out.append(_target("strip/lazy: payload bytes of fully cached videos", "0 B",
                           f"max {max(worst):.0f} B per request over {len(cached)} configurations",
                           max(worst) == 0))  # fmt: skip
    lazy = [r for r in analysis["stream"] if r["mode"] == "lazy" and r["deliveries_per_segment_rank"] is not None]
    if lazy:
        worst_d = max(r["deliveries_per_segment_rank"] for r in lazy)
        out.append(_target("lazy live stream: payload deliveries per segment per rank", "≤ 1",
                           "; ".join(f"TP{r['tp']}: {r['deliveries_per_segment_rank']:.2f}" for r in lazy),
                           worst_d <= 1.0))  # fmt: skip
    return out


def analyze(records: Sequence[dict]) -> dict:
    out = {"cached": cached_rows(records), "new": new_rows(records), "stream": stream_rows(records)}
    out["targets"] = targets(out) if any(out.values()) else []
    return out


# --- Markdown and plot -------------------------------------------------------------------------------------------
def _b(n: float | None) -> str:
    if n is None:
        return "–"
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB" if n >= 1e3 else f"{n:.0f} B"


def _n(v: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def _by(d: dict, n: int):
    return d.get(n, d.get(str(n)))  # int keys in memory, str keys once through JSON


def markdown(analysis: dict, plan_label: str = "") -> str:
    """The three tables; "" when no video scenario ran."""
    cached, new, stream = analysis.get("cached") or [], analysis.get("new") or [], analysis.get("stream") or []
    if not (cached or new or stream):
        return ""
    lines = []
    if cached:
        ns = sorted({int(n) for r in cached for n in r["ns"]})
        lines += [f"Cached clips ({plan_label}): N distinct clips in the prefix, then a new question. Client TTFT "
                  "p50 (ms), the least-squares TTFT slope against N, payload bytes per request (scheduler→ranks, "
                  "summed over ranks); frontend media CPU: `Usage.image_cpu_seconds` (the scheduler's CPU on the "
                  "request's images and videos) per clip.", "",
                  "| TP | mode | " + " | ".join(f"TTFT N={n}" for n in ns) + " | slope ms/clip [95 % CI] | "
                  + " | ".join(f"payload N={n}" for n in ns) + f" | prompt tokens N={ns[-1]} | frontend media CPU "
                  f"ms/clip N={ns[-1]} |", "|---|---|" + "---:|" * (2 * len(ns) + 3)]  # fmt: skip
        for r in cached:
            s = r["slope"]
            slope = f"{s['slope']:.2f} [{s['ci_low']:.2f}, {s['ci_high']:.2f}]" if s else "–"
            lines.append(
                f"| {r['tp']} | {r['mode']} | "
                + " | ".join(_n(_by(r["ttft_p50_by_n"], n)) for n in ns)
                + f" | {slope} | "
                + " | ".join(_b(_by(r["payload_bytes_by_n"], n)) for n in ns)
                + f" | {_by(r['prompt_tokens_by_n'], ns[-1]) or '–'} | {_n(r.get('frontend_cpu_ms_per_clip'))} |"
            )
    if new:
        lines += ["", "A new clip: one never-seen clip and a question per request", "",
                  "| TP | mode | requests | TTFT p50 ms | file | payload | encoder runs | prompt tokens |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in new:
            lines.append(f"| {r['tp']} | {r['mode']} | {r['requests']} | {r['ttft_p50_ms']:.1f} | "
                         f"{_b(r['file_bytes'])} | {_b(r['payload_bytes'])} | {_n(r['encoder_runs'], '{:g}')} | "
                         f"{r['prompt_tokens']} |")  # fmt: skip
    if stream:
        w = stream[0]["window"]
        lines += ["", f"Live stream: a new segment per turn, the last {w} kept, the prompt rebuilt each turn. "
                  f"Per turn after the window filled (turn > {w}: the oldest segment dropped, so the prefix differs "
                  "from the first segment on), medians:", "",
                  "| TP | mode | turns (after window) | TTFT p50 ms | payload / turn | segment file | encoder runs / "
                  "turn | deliveries / turn | deliveries / segment / rank (all turns) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in stream:
            lines.append(f"| {r['tp']} | {r['mode']} | {r['turns']} ({r['steady_turns']}) | "
                         f"{_n(r['ttft_p50_after_window_ms'])} | {_b(r['payload_bytes_per_turn'])} | "
                         f"{_b(r['segment_file_bytes'])} | {_n(r['encoder_runs_per_turn'], '{:g}')} | "
                         f"{_n(r['deliveries_per_turn'], '{:g}')} | {_n(r['deliveries_per_segment_rank'], '{:.2f}')} |")  # fmt: skip
    return "\n".join(lines)


_COLOURS = {"full": "tab:red", "strip": "tab:orange", "lazy": "tab:green"}


def plot(directory: str, analysis: dict) -> str | None:
    """``videos.png``: TTFT p50 and payload per request against cached clips N, and TTFT per live-stream turn."""
    cached, stream = analysis.get("cached") or [], analysis.get("stream") or []
    if not (cached or stream):
        return None
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.4))
    for r in cached:
        style, colour = ("-o" if r["tp"] == 1 else "--s"), _COLOURS.get(r["mode"])
        pts = sorted((int(n), v) for n, v in r["ttft_p50_by_n"].items())
        axes[0].plot(*zip(*pts, strict=True), style, color=colour, label=f"TP{r['tp']} {r['mode']}")
        pts = sorted((int(n), max(v or 0, 1) / 1e6) for n, v in r["payload_bytes_by_n"].items())
        axes[1].plot(*zip(*pts, strict=True), style, color=colour, label=f"TP{r['tp']} {r['mode']}")
    for r in stream:
        axes[2].plot(range(1, r["turns"] + 1), r["ttft_ms"], ("-o" if r["tp"] == 1 else "--s"), markersize=3,
                     color=_COLOURS.get(r["mode"]), label=f"TP{r['tp']} {r['mode']}")  # fmt: skip
    if stream:
        axes[2].axvline(stream[0]["window"] + 0.5, color="k", lw=0.8, ls=":", label="window full")
    titles = (("cached clips, then a new question", "cached clips N", "client TTFT p50 (ms)"),
              ("payload per request (0 B drawn at 1 B)", "cached clips N", "MB scheduler→ranks (log)"),
              ("live stream: a new segment per turn", "turn", "client TTFT (ms)"))  # fmt: skip
    for ax, (title, xl, yl) in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    path = os.path.join(directory, "videos.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
