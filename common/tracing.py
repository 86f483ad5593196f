"""Optional OpenTelemetry tracing (docs/METRICS.md, "Tracing"): off unless ``MMCAST_TRACING`` is set, and then it
needs the ``tracing`` extra (``pip install 'mmcast[tracing]'``). While it is off nothing of OpenTelemetry is
imported and every ``span()`` is a shared no-op context manager, so the call sites cost one attribute check.

Spans do not cross the step stream: a rank's ``mmcast.rank_step`` span starts its own trace and carries the
``mmcast.step_id`` and ``mmcast.request_ids`` that the scheduler's ``mmcast.step`` span of the same step carries
(the step messages have no field for a trace context, and per-stream gRPC metadata is fixed when a stream opens).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

ENV = "MMCAST_TRACING"
_OFF = {"", "0", "off", "false", "no"}
_NULL = contextlib.nullcontext()
_tracer = None  # an opentelemetry Tracer while tracing is on


class TracingError(ValueError):
    """MMCAST_TRACING asks for something this installation cannot do; the message says what to install or set."""


def enabled() -> bool:
    return _tracer is not None


def configure(component: str, *, exporter=None, environ: Mapping[str, str] = os.environ, **resource: object) -> bool:
    """Turns tracing on for this process when ``MMCAST_TRACING`` is on (or an ``exporter`` is given: tests pass an
    in-memory one, exported synchronously). Exporters otherwise come from ``OTEL_TRACES_EXPORTER`` (default
    ``otlp``, comma-separated), each installed package's ``opentelemetry_traces_exporter`` entry point; the
    service name from ``OTEL_SERVICE_NAME`` (default ``mmcast-<component>``). ``resource`` adds attributes
    (e.g. the rank). Returns whether tracing is on; raises TracingError naming the fix."""
    global _tracer
    value = environ.get(ENV, "").strip().lower()
    if exporter is None and value in _OFF:
        return False
    if exporter is None and value not in {"1", "on", "true", "yes"}:
        raise TracingError(f"{ENV}={value!r}: use 1 to turn tracing on (exporters from OTEL_TRACES_EXPORTER) or 0")
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        raise TracingError(f"{ENV}={value} needs OpenTelemetry: pip install 'mmcast[tracing]'") from None
    attributes = {
        "service.name": environ.get("OTEL_SERVICE_NAME") or f"mmcast-{component}",
        "mmcast.component": component,
        **{f"mmcast.{k}": v for k, v in resource.items()},
    }
    provider = TracerProvider(resource=Resource.create(attributes))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        for made in _exporters(environ.get("OTEL_TRACES_EXPORTER", "otlp")):
            provider.add_span_processor(BatchSpanProcessor(made))
    _tracer = provider.get_tracer("mmcast")
    return True


def _exporters(names: str) -> list:
    from importlib.metadata import entry_points

    found = {ep.name: ep for ep in entry_points(group="opentelemetry_traces_exporter")}
    out = []
    for name in (n.strip() for n in names.split(",")):
        if not name or name == "none":
            continue
        if name not in found:
            hint = " (pip install opentelemetry-exporter-otlp)" if name.startswith("otlp") else ""
            raise TracingError(
                f"OTEL_TRACES_EXPORTER names {name!r}, which no installed package provides{hint}; "
                f"installed: {', '.join(sorted(found)) or 'none'}"
            )
        out.append(found[name].load()())
    return out


def reset() -> None:
    """Tracing off again (tests)."""
    global _tracer
    _tracer = None


def span(name: str, **attributes: object):
    """A context manager: the current span ``name`` (a child of the current one) while tracing is on, else a
    no-op. Attribute keys get the ``mmcast.`` prefix; values must be str, bool, int, float or lists of one."""
    if _tracer is None:
        return _NULL
    return _tracer.start_as_current_span(name, attributes=_attributes(attributes))


def record_span(name: str, start_ns: int, end_ns: int, **attributes: object) -> None:
    """A span that already happened (``time.time_ns()`` bounds), for work that only turns out worth a span when
    it is done (a schedule call that produced a step)."""
    if _tracer is None:
        return
    _tracer.start_span(name, start_time=start_ns, attributes=_attributes(attributes)).end(end_time=end_ns)


def open_span(name: str, **attributes: object):
    """A span begun now and ended later by ``end_span`` (None while tracing is off), for work that overlaps other
    work of its kind (steps in flight together); ``within(span)`` makes it the parent of the spans begun inside."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, attributes=_attributes(attributes))


def within(open_one):
    """A context manager: ``open_one`` (an ``open_span``) is the current span inside it; it stays open after."""
    if open_one is None:
        return _NULL
    from opentelemetry import trace

    return trace.use_span(open_one, end_on_exit=False)


def end_span(open_one) -> None:
    if open_one is not None:
        open_one.end()


def set_attributes(current, **attributes: object) -> None:
    """Adds attributes to the span a ``with span(...) as current`` gave (nothing while tracing is off)."""
    if current is not None:
        current.set_attributes(_attributes(attributes))


def _attributes(attributes: Mapping[str, object]) -> dict[str, object]:
    return {f"mmcast.{k}": v for k, v in attributes.items() if v is not None}
