"""Where an mmcast request's time to first token goes, beside vLLM's TTFT (``benchmarks/peer/compare.py``).

The scheduler may export a histogram ``mmcast_request_stage_seconds{stage=...}`` on its ``/metrics`` (stages such
as http_parse, frontend, queue, schedule, step_send, rank, result_back, detokenize, first_byte, and the parts
rank_assemble, rank_encode, rank_forward, rank_sample of the rank's step; ``scheduler_svc/engine/stage_timing.py``). The single-request workloads (cached, new) scrape it before and after every timed request, so the
``_sum``/``_count`` deltas belong to that request alone (nothing else is in flight then), and the report shows the
mean of each stage beside the client's TTFT and vLLM's. Nothing here depends on the label set: whatever stages
the build exports are shown (known ones in pipeline order, others after them), and a build without the metric
says so instead of failing the run. vLLM exports no such breakdown, so only its client TTFT stands beside it.
"""

from __future__ import annotations

import urllib.request

from scheduler_svc.engine.stage_timing import DISJOINT_STAGES, RANK_PARTS

METRIC = "mmcast_request_stage_seconds"
# Pipeline order: the stages that follow one another (their sum is at most the TTFT), then the parts of the rank's
# step that lie inside ``rank``; stages not listed here follow, sorted by name, and are not summed.
ORDER = DISJOINT_STAGES + RANK_PARTS
NOT_EXPORTED = "not exported by this build"

Snapshot = dict[str, tuple[float, float]]  # stage -> (sum of seconds, count)


def parse(text: str) -> Snapshot | None:
    """``{stage: (sum_s, count)}`` of the stage histogram in a Prometheus text page, summed over any other labels;
    None when the page has no such metric. Samples are matched by name, so a page without ``# TYPE`` lines (each
    sample then parses as its own untyped family) or a summary instead of a histogram reads the same."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    found = False
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name not in (METRIC + "_sum", METRIC + "_count"):
                continue
            found = True
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            stage = labels.get("stage") or ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "(all)"
            entry = out.setdefault(stage, [0.0, 0.0])
            entry[0 if s.name.endswith("_sum") else 1] += s.value
    return {k: (v[0], v[1]) for k, v in out.items()} if found else None


class Probe:
    """Reads one scheduler's /metrics (a loopback URL of a group this benchmark started)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def snapshot(self) -> Snapshot | None:
        try:
            with urllib.request.urlopen(self.url, timeout=10) as reply:  # noqa: S310 - loopback URL we started
                return parse(reply.read().decode())
        except OSError:
            return None


def new_accumulator() -> dict:
    return {"requests": 0, "exported": False, "stages": {}}


def add(acc: dict, before: Snapshot | None, after: Snapshot | None) -> None:
    """Adds one request's deltas: ``stages[stage] = [seconds, observations]`` summed over the requests."""
    acc["requests"] += 1
    if before is None or after is None:
        return
    acc["exported"] = True
    for stage, (s1, c1) in after.items():
        s0, c0 = before.get(stage, (0.0, 0.0))
        entry = acc["stages"].setdefault(stage, [0.0, 0.0])
        entry[0] += s1 - s0
        entry[1] += c1 - c0


def merge(accs: list[dict | None]) -> dict | None:
    """One accumulator from several rounds' (None entries skipped; None when there is none)."""
    accs = [a for a in accs if a]
    if not accs:
        return None
    out = new_accumulator()
    for a in accs:
        out["requests"] += a["requests"]
        out["exported"] |= a["exported"]
        for stage, (s, c) in a["stages"].items():
            entry = out["stages"].setdefault(stage, [0.0, 0.0])
            entry[0] += s
            entry[1] += c
    return out


def means(acc: dict | None) -> dict[str, dict] | None:
    """Per stage: mean ms per observation and observations per request (a stage observed per decode step, or not
    on every request, shows there); None when the metric was not exported."""
    if not acc or not acc["exported"]:
        return None
    requests = max(acc["requests"], 1)
    out = {}
    for stage in sorted(acc["stages"], key=lambda s: (ORDER.index(s) if s in ORDER else len(ORDER), s)):
        seconds, count = acc["stages"][stage]
        out[stage] = {"mean_ms": 1e3 * seconds / count if count else None, "per_request": count / requests,
                      "ms_per_request": 1e3 * seconds / requests}  # fmt: skip
    return out


def _fmt(x, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown(columns: list[tuple[str, dict | None, float | None]], vllm_ttft: list[float | None]) -> str:
    """The table "TTFT breakdown (mmcast) beside vLLM's TTFT". ``columns``: (heading, stage means or None, the
    engine's client TTFT p50 in ms) per mmcast engine and workload; ``vllm_ttft``: vLLM's client TTFT p50 of the
    same workload per column (None where vLLM did not run)."""
    title = "TTFT breakdown (mmcast) beside vLLM's TTFT: mean ms per observation (observations per request)"
    if not columns or all(m is None for _, m, _ in columns):
        return f"{title}\n\n`{METRIC}`: {NOT_EXPORTED}."
    stages: list[str] = []
    for _, m, _ in columns:
        stages += [s for s in (m or {}) if s not in stages]
    stages.sort(key=lambda s: (ORDER.index(s) if s in ORDER else len(ORDER), s))
    lines = [title, "", "| stage | " + " | ".join(h for h, _, _ in columns) + " |", "|---|" + "---:|" * len(columns)]
    for stage in stages:
        cells = []
        for _, m, _ in columns:
            e = (m or {}).get(stage)
            cells.append("–" if e is None else f"{_fmt(e['mean_ms'], 2)} ({e['per_request']:.2g})")
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    sums = [
        None if m is None else sum(e["ms_per_request"] for s, e in m.items() if s in DISJOINT_STAGES)
        for _, m, _ in columns
    ]
    lines.append(f"| sum of {', '.join(DISJOINT_STAGES)} per request | " + " | ".join(_fmt(s) for s in sums) + " |")
    lines.append("| mmcast client TTFT p50 (sliding: mean) | " + " | ".join(_fmt(t) for _, _, t in columns) + " |")
    lines.append("| vLLM client TTFT p50 (sliding: mean) | " + " | ".join(_fmt(t) for t in vllm_ttft) + " |")
    missing = [h for h, m, _ in columns if m is None]
    if missing:
        lines += ["", f"`{METRIC}` {NOT_EXPORTED} for: {', '.join(missing)}."]
    return "\n".join(lines)


def samples(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """The samples of the named metrics on one scheduler's /metrics (``name`` or ``name{label=value}`` ->
    value); empty when the page cannot be read. The burst records the stall bound's counters and measured costs."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 - loopback URL we started
            text = reply.read().decode()
    except OSError:
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
