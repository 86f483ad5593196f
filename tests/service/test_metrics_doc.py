"""docs/METRICS.md lists exactly the metrics the services register (scripts/metrics_doc.py renders the table)."""

from __future__ import annotations

from scripts.metrics_doc import BEGIN, DOC, END, exported_families, render_doc


def test_committed_metric_table_is_the_generated_one():
    current = DOC.read_text()
    assert current == render_doc(current), "docs/METRICS.md is stale: run `python scripts/metrics_doc.py`"


def test_table_lists_every_family_with_its_labels():
    families = {f.name: f for f in exported_families()}
    table = DOC.read_text().partition(BEGIN)[2].partition(END)[0]
    for name in families:
        assert f"| `{name}` |" in table, name
    # A few facts the renderer must get right: the counter suffix, histogram base names, labels, both services.
    assert families["mmcast_worker_cache_queries_total"].labels == ("cache",)
    assert families["mmcast_inter_token_latency_seconds"].type == "histogram"
    assert families["grpc_server_handled_total"].services == ("scheduler", "worker")
    assert all(f.name.startswith(("mmcast_", "grpc_server_")) for f in families.values())
    assert all(f.name.endswith("_total") for f in families.values() if f.type == "counter")
    worker_only = [f.name for f in families.values() if f.services == ("worker",)]
    assert worker_only and all(n.startswith("mmcast_worker_") for n in worker_only), worker_only
