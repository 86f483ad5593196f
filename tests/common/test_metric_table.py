"""The metric tables (common/metric_table.py): a row becomes the metric it declares, and a bad row fails at import."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common.metric_table import COUNTER, GAUGE, HISTOGRAM, Metric, MetricSet
from scheduler_svc.engine.metrics import SCHEDULER_METRICS, SchedulerMetrics
from worker_svc.metrics import WORKER_METRICS, WorkerMetrics


class _Two(MetricSet):
    TABLE = (
        Metric("sent", COUNTER, "t_sent_bytes_total", "Bytes sent.", ("kind", "modality"), series=(("a", "x"),)),
        Metric("lag", HISTOGRAM, "t_lag_seconds", "Lag.", ("stage",), buckets=(0.1, 1.0), series=("s1", "s2")),
    )


def test_rows_become_attributes_with_their_series():
    two = _Two()
    text = generate_latest(two.registry).decode()
    assert two.sent._labelnames == ("kind", "modality") and two.lag._upper_bounds == [0.1, 1.0, float("inf")]
    assert 't_sent_bytes_total{kind="a",modality="x"} 0.0' in text
    assert 't_lag_seconds_bucket{le="1.0",stage="s2"} 0.0' in text
    assert _Two().registry is not two.registry  # one registry per set unless one is given


@pytest.mark.parametrize(
    "row, message",
    [
        (dict(kind="summary"), "kind='summary' must be one of counter, gauge, histogram"),
        (dict(kind=HISTOGRAM), "buckets are required for a histogram"),
        (dict(kind=GAUGE, buckets=(1.0,)), "buckets are required for a histogram and only there"),
        (dict(kind=GAUGE, series=("a",)), "series need labels"),
    ],
)
def test_a_bad_row_is_refused(row, message):
    with pytest.raises(ValueError, match=message):
        Metric(**{"attr": "m", "name": "t_m", "help": "M.", **row})


def test_a_repeated_attribute_or_name_is_refused():
    with pytest.raises(ValueError, match="attr up listed twice"):

        class _Twice(MetricSet):
            TABLE = (Metric("up", GAUGE, "t_up", "Up."), Metric("up", GAUGE, "t_up_again", "Up."))


@pytest.mark.parametrize("metrics, table", [(SchedulerMetrics, SCHEDULER_METRICS), (WorkerMetrics, WORKER_METRICS)])
def test_the_process_tables(metrics, table):
    registry = CollectorRegistry()
    instance = metrics(registry)
    for row in table:
        assert getattr(instance, row.attr)._name == row.name.removesuffix("_total"), row.attr
        assert row.name.startswith("mmcast_") and ":" not in row.name
        assert list(row.buckets) == sorted(set(row.buckets)), f"{row.name}: buckets must rise"
