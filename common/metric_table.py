"""Prometheus metrics declared as data: each process lists its metrics in one table of ``Metric`` rows (name, kind,
help, labels, buckets), and ``MetricSet`` registers the rows in the process's registry as attributes the code uses.

The scheduler's table is in scheduler_svc/engine/metrics.py, the worker's in worker_svc/metrics.py; docs/METRICS.md is
rendered from the registries they fill (scripts/metrics_doc.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
_TYPES = {COUNTER: Counter, GAUGE: Gauge, HISTOGRAM: Histogram}


@dataclasses.dataclass(frozen=True)
class Metric:
    """One metric of a process's table."""

    attr: str  # the attribute of the process's MetricSet that holds it
    kind: str  # COUNTER | GAUGE | HISTOGRAM
    name: str  # as given to prometheus_client (a counter's `_total` is optional: it strips and re-adds it)
    help: str  # the HELP line, and docs/METRICS.md's "meaning" column
    labels: tuple[str, ...] = ()  # label names, in the order `.labels(...)` takes their values
    buckets: tuple[float, ...] = ()  # upper bounds in the metric's unit; histograms only, and required there
    # Label values whose series exist from the start (at 0), so a dashboard shows a 0 rate rather than no data
    # before the first event; one string per series for a metric of one label, a tuple of values otherwise.
    series: Sequence[str | tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if self.kind not in _TYPES:
            raise ValueError(f"metric {self.name}: kind={self.kind!r} must be one of {', '.join(_TYPES)}")
        if (self.kind == HISTOGRAM) != bool(self.buckets):
            raise ValueError(f"metric {self.name}: buckets are required for a histogram and only there")
        if self.series and not self.labels:
            raise ValueError(f"metric {self.name}: series need labels")

    def register(self, registry: CollectorRegistry) -> Any:
        """The prometheus_client metric of this row in ``registry``, with its initial series created."""
        extra = {"buckets": self.buckets} if self.kind == HISTOGRAM else {}
        metric = _TYPES[self.kind](self.name, self.help, self.labels, registry=registry, **extra)
        for values in self.series:
            metric.labels(*((values,) if isinstance(values, str) else values))
        return metric


class MetricSet:
    """A process's metrics: every row of ``TABLE`` as the attribute it names, all in one registry, so several
    processes' sets can live in one test process."""

    TABLE: ClassVar[tuple[Metric, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for field in ("attr", "name"):  # a repeated attribute would hide a metric; a repeated name fails at start
            seen = [getattr(row, field) for row in cls.TABLE]
            repeated = sorted({v for v in seen if seen.count(v) > 1})
            if repeated:
                raise ValueError(f"{cls.__name__}.TABLE: {field} {', '.join(repeated)} listed twice")

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        for row in self.TABLE:
            setattr(self, row.attr, row.register(self.registry))
