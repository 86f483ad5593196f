"""Renders the metric table of docs/METRICS.md from the metric objects the services register, so the list cannot
drift from the code.

    .venv/bin/python scripts/metrics_doc.py          # rewrite the table in docs/METRICS.md
    .venv/bin/python scripts/metrics_doc.py --check  # exit 1 when the committed table differs (tests do this too)

The table replaces what stands between the ``<!-- metrics:begin -->`` / ``<!-- metrics:end -->`` markers; the prose
around it is kept. Each service's registry is built as its entry point builds it (its own metrics plus the gRPC
server metrics), with nothing served.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "METRICS.md"
BEGIN, END = "<!-- metrics:begin -->", "<!-- metrics:end -->"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # as exposed: counters with their `_total`, histograms by base name (`_bucket`, `_sum`, `_count`)
    type: str  # counter | gauge | histogram
    labels: tuple[str, ...]  # label names, `le` excluded
    help: str
    services: tuple[str, ...]  # "scheduler", "worker", or both


def _registries():
    from prometheus_client import CollectorRegistry

    from common.grpc_metrics import GrpcServerMetrics
    from scheduler_svc.engine.metrics import SchedulerMetrics
    from worker_svc.metrics import WorkerMetrics

    out = {}
    for service, factory in (("scheduler", SchedulerMetrics), ("worker", WorkerMetrics)):
        registry = CollectorRegistry()
        factory(registry)
        GrpcServerMetrics(registry)
        out[service] = registry
    return out


def exported_families() -> list[Family]:
    """Every metric family the scheduler and the worker export, sorted by name."""
    found: dict[str, Family] = {}
    for service, registry in _registries().items():
        # prometheus_client lists a registry's collectors only privately; the label names are the wrappers' own.
        for collector in list(registry._collector_to_names):
            (family,) = collector.describe()
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = tuple(n for n in getattr(collector, "_labelnames", ()) if n != "le")
            seen = found.get(name)
            services = (*seen.services, service) if seen else (service,)
            found[name] = Family(name, family.type, labels, " ".join(family.documentation.split()), services)
    return [found[n] for n in sorted(found)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table(families: list[Family] | None = None) -> str:
    rows = ["| metric | type | labels | exported by | meaning |", "|---|---|---|---|---|"]
    for f in families if families is not None else exported_families():
        labels = ", ".join(f"`{n}`" for n in f.labels)
        rows.append(f"| `{f.name}` | {f.type} | {labels} | {' and '.join(f.services)} | {_cell(f.help)} |")
    return "\n".join(rows)


def render_doc(doc: str) -> str:
    head, begin, rest = doc.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"{DOC} lacks the {BEGIN} / {END} markers")
    return f"{head}{BEGIN}\n{render_table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    current = DOC.read_text()
    wanted = render_doc(current)
    if "--check" in argv:
        if current != wanted:
            print(f"{DOC.relative_to(ROOT)} is stale: run `python scripts/metrics_doc.py`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
