"""The Grafana dashboard: structure, variables, metric names, and PromQL that parses and returns data offline."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.support.dashboard import (
    BUILTIN_VARIABLES,
    dashboard_expressions,
    load_dashboard,
    panels,
    substitute_variables,
    variables_used,
)
from tests.support.deploy_tools import run, tool

# Every metric the services export (docs/ARCHITECTURE.md §2.7), histograms by their base name.
SCHEDULER_METRICS = {
    "mmcast_broadcast_bytes_total",
    "mmcast_broadcast_payload_bytes_saved_total",
    "mmcast_mm_items_total",
    "mmcast_encoder_items_total",
    "mmcast_encoder_runs_total",
    "mmcast_encoder_output_shared_bytes_total",
    "mmcast_prefix_cache_query_tokens_total",
    "mmcast_prefix_cache_hit_tokens_total",
    "mmcast_time_to_first_token_seconds",
    "mmcast_step_seconds",
    "mmcast_requests_running",
    "mmcast_requests_waiting",
    "mmcast_kv_blocks_used",
    "mmcast_kv_blocks_capacity",
    "mmcast_preemptions_total",
    "mmcast_worker_group_up",
    "mmcast_prompt_tokens_total",
    "mmcast_generation_tokens_total",
    "mmcast_requests_finished_total",
    "mmcast_e2e_request_latency_seconds",
    "mmcast_request_queue_time_seconds",
    "mmcast_inter_token_latency_seconds",
    "mmcast_request_prompt_tokens",
    "mmcast_request_generation_tokens",
    "mmcast_kv_cache_usage_ratio",
    "mmcast_http_requests_total",
    "mmcast_http_request_duration_seconds",
    "mmcast_http_requests_in_flight",
}
WORKER_METRICS = {
    "mmcast_worker_received_bytes_total",
    "mmcast_worker_encoder_seconds",
    "mmcast_worker_step_seconds",
    "mmcast_worker_payload_cache_bytes",
    "mmcast_worker_encoder_cache_tokens",
    "mmcast_worker_cache_hits_total",
    "mmcast_worker_cache_queries_total",
    "mmcast_worker_protocol_errors_total",
}
GRPC_METRICS = {"grpc_server_started_total", "grpc_server_handled_total", "grpc_server_handling_seconds"}
HISTOGRAMS = {
    "mmcast_time_to_first_token_seconds",
    "mmcast_step_seconds",
    "mmcast_worker_encoder_seconds",
    "mmcast_worker_step_seconds",
    "grpc_server_handling_seconds",
    "mmcast_e2e_request_latency_seconds",
    "mmcast_request_queue_time_seconds",
    "mmcast_inter_token_latency_seconds",
    "mmcast_request_prompt_tokens",
    "mmcast_request_generation_tokens",
    "mmcast_http_request_duration_seconds",
}
KNOWN = SCHEDULER_METRICS | WORKER_METRICS | GRPC_METRICS
PROMQL_WORDS = {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "by",
    "without",
    "rate",
    "irate",
    "increase",
    "histogram_quantile",
    "or",
    "and",
    "unless",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "vector",
    "clamp_min",
    "clamp_max",
    "abs",
    "topk",
    "bottomk",
    "label_replace",
    "delta",
    "deriv",
}
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
IDENT = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b")


def _base(metric: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if metric.endswith(suffix) and metric[: -len(suffix)] in HISTOGRAMS:
            return metric[: -len(suffix)]
    return metric


def _metrics_in(expr: str) -> set[str]:
    no_strings = re.sub(r'"[^"]*"', '""', expr)
    no_selectors = re.sub(r"\{[^}]*\}", "", no_strings)
    no_windows = re.sub(r"\[[^\]]*\]", "", no_selectors)
    no_groupings = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", no_windows)
    return {w for w in IDENT.findall(no_groupings) if w not in PROMQL_WORDS and not w.isdigit()}


def test_dashboard_top_level():
    d = load_dashboard()
    assert d["schemaVersion"] >= 39 and d["uid"] and d["title"]
    assert d.get("id") is None, "provisioned dashboards carry no numeric id"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "release"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}"
        assert v["includeAll"] is True and v["allValue"] == ".*", f"${name} must default to .* (matches absent labels)"
        assert v["current"]["value"] == ["$__all"]
        assert "label_values(" in v["query"]["query"] and f", {name})" in v["query"]["query"]


def test_every_panel_is_complete():
    d = load_dashboard()
    ids = [p["id"] for p in d["panels"]] + [p["id"] for r in d["panels"] for p in r.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    occupied = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert {"h", "w", "x", "y"} <= g.keys() and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"panel {p['title']!r} overlaps another"
        occupied |= cells
    for p in panels(d):
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refids = [t["refId"] for t in p["targets"]]
        assert len(refids) == len(set(refids)) and all(refids), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip(), p["title"]
            assert t.get("datasource", p["datasource"])["uid"] == "${datasource}"


def test_every_variable_used_is_defined():
    d = load_dashboard()
    defined = {v["name"] for v in d["templating"]["list"]} | BUILTIN_VARIABLES
    import json

    used = variables_used(json.dumps(d["panels"])) | variables_used(json.dumps(d["templating"]))
    assert used - defined == set(), f"undefined variables: {used - defined}"


def test_expressions_filter_by_namespace_and_release():
    for title, expr in dashboard_expressions(substitute=False):
        assert "vector(0)" not in expr, f"{title}: no `or vector(0)` padding"
        selectors = SELECTOR.findall(expr)
        assert selectors, f"{title}: {expr}"
        for metric, matchers in selectors:
            assert 'namespace=~"$namespace"' in matchers and 'release=~"$release"' in matchers, f"{title}: {metric}"
        assert "[5m]" not in expr, f"{title}: use $__rate_interval"


def test_expressions_use_known_metrics_and_cover_them_all():
    used = set()
    for title, expr in dashboard_expressions():
        metrics = _metrics_in(expr)
        unknown = {m for m in metrics if _base(m) not in KNOWN}
        assert not unknown, f"{title}: unknown metric(s) {unknown}"
        used |= {_base(m) for m in metrics}
    assert KNOWN - used == set(), f"metrics without a panel: {KNOWN - used}"


def test_known_metrics_are_exported():
    """The names above are the services' own: a renamed or removed metric fails here, not only on a live dashboard."""
    from scripts.metrics_doc import exported_families

    exported = {f.name for f in exported_families()}
    assert KNOWN - exported == set(), f"not exported by any service: {KNOWN - exported}"
    histograms = {f.name for f in exported_families() if f.type == "histogram"}
    assert HISTOGRAMS == KNOWN & histograms


def test_expressions_parse(tmp_path):
    """promtool has no offline query parser; a rule file with one recording rule per expression is the next best."""
    rules = [{"record": f"dashboard:expr_{i}", "expr": expr} for i, (_, expr) in enumerate(dashboard_expressions())]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run([tool("promtool"), "check", "rules", str(path)])


def _series_like_a_bare_prometheus() -> list[dict]:
    """Series as a Prometheus with only job/instance target labels would scrape them from one scheduler and 2 ranks."""
    sched = 'job="mmcast-scheduler", instance="127.0.0.1:9400"'
    ranks = ['job="mmcast-worker", instance="127.0.0.1:9401"', 'job="mmcast-worker", instance="127.0.0.1:9402"']
    series = []

    def counter(name, labels, step):
        series.append({"series": f"{name}{{{labels}}}", "values": f"0+{step}x30"})

    def gauge(name, labels, value):
        series.append({"series": f"{name}{{{labels}}}", "values": f"{value}x30"})

    def histogram(name, labels):
        for le, step in (("0.1", 6), ("1", 54), ("+Inf", 60)):
            counter(f"{name}_bucket", f'{labels}, le="{le}"', step)
        counter(f"{name}_sum", labels, 30)
        counter(f"{name}_count", labels, 60)

    for kind in ("payload", "metadata", "control"):
        counter("mmcast_broadcast_bytes_total", f'{sched}, kind="{kind}"', 6000)
    for reason in ("prefix_covered", "rank_cached", "encoder_shared"):
        counter("mmcast_broadcast_payload_bytes_saved_total", f'{sched}, reason="{reason}"', 3000)
    for disposition in ("sent", "stripped", "rank_cached", "encoder_shared"):
        counter("mmcast_mm_items_total", f'{sched}, disposition="{disposition}"', 60)
    counter("mmcast_encoder_items_total", sched, 20)
    counter("mmcast_encoder_runs_total", sched, 20)
    counter("mmcast_encoder_output_shared_bytes_total", sched, 9000)
    counter("mmcast_prefix_cache_query_tokens_total", sched, 600)
    counter("mmcast_prefix_cache_hit_tokens_total", sched, 300)
    histogram("mmcast_time_to_first_token_seconds", sched)
    histogram("mmcast_step_seconds", sched)
    for name in (
        "mmcast_e2e_request_latency_seconds",
        "mmcast_request_queue_time_seconds",
        "mmcast_inter_token_latency_seconds",
        "mmcast_request_prompt_tokens",
        "mmcast_request_generation_tokens",
    ):
        histogram(name, sched)
    gauge("mmcast_kv_cache_usage_ratio", sched, 0.2)
    gauge("mmcast_requests_running", sched, 3)
    gauge("mmcast_requests_waiting", sched, 1)
    gauge("mmcast_kv_blocks_used", sched, 100)
    gauge("mmcast_kv_blocks_capacity", sched, 512)
    counter("mmcast_preemptions_total", sched, 1)
    gauge("mmcast_worker_group_up", sched, 1)
    counter("mmcast_prompt_tokens_total", sched, 6000)
    counter("mmcast_generation_tokens_total", sched, 600)
    for reason in ("stop", "length"):
        counter("mmcast_requests_finished_total", f'{sched}, reason="{reason}"', 30)
    for route, status in (("/v1/chat/completions", "200"), ("/v1/chat/completions", "400"), ("/health", "200")):
        counter("mmcast_http_requests_total", f'{sched}, route="{route}", method="POST", status="{status}"', 30)
    histogram("mmcast_http_request_duration_seconds", f'{sched}, route="/v1/chat/completions", method="POST"')
    gauge("mmcast_http_requests_in_flight", sched, 2)
    for rank in ranks:
        for kind in ("payload", "metadata", "control"):
            counter("mmcast_worker_received_bytes_total", f'{rank}, kind="{kind}"', 3000)
        histogram("mmcast_worker_encoder_seconds", rank)
        histogram("mmcast_worker_step_seconds", rank)
        gauge("mmcast_worker_payload_cache_bytes", rank, 1 << 20)
        gauge("mmcast_worker_encoder_cache_tokens", rank, 1196)
        for cache in ("payload", "encoder"):
            counter("mmcast_worker_cache_queries_total", f'{rank}, cache="{cache}"', 10)
            counter("mmcast_worker_cache_hits_total", f'{rank}, cache="{cache}"', 6)
        counter("mmcast_worker_protocol_errors_total", f'{rank}, code="BAD_TENSOR"', 0)
    grpc = [
        (sched, "mmcast.v1.GenerationService", "Generate", "server_stream"),
        (sched, "mmcast.v1.GenerationService", "GetServerInfo", "unary"),
    ]
    grpc += [(rank, "mmcast.v1.WorkerService", "Step", "bidi_stream") for rank in ranks]
    for target, service, method, rpc_type in grpc:
        labels = f'{target}, grpc_service="{service}", grpc_method="{method}", grpc_type="{rpc_type}"'
        counter("grpc_server_started_total", labels, 60)
        counter("grpc_server_handled_total", f'{labels}, grpc_code="OK"', 60)
        counter("grpc_server_handled_total", f'{labels}, grpc_code="Unavailable"', 1)
        histogram("grpc_server_handling_seconds", labels)
    return series


def test_every_expression_returns_data_without_namespace_or_release_labels(tmp_path):
    """Each expression, with the variables at All (.*), must select series that carry only job/instance labels."""
    expressions = dashboard_expressions()
    rules = [{"alert": f"DashboardExpr{i}", "expr": f"count({expr}) > 0"} for i, (_, expr) in enumerate(expressions)]
    rule_file = tmp_path / "dashboard-alerts.yaml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    test_file = tmp_path / "dashboard-alerts.test.yaml"
    test_file.write_text(
        yaml.safe_dump(
            {
                "rule_files": [rule_file.name],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": _series_like_a_bare_prometheus(),
                        "alert_rule_test": [
                            {"alertname": f"DashboardExpr{i}", "eval_time": "20m", "exp_alerts": [{"exp_labels": {}}]}
                            for i in range(len(expressions))
                        ],
                    }
                ],
            },
            width=10_000,
        )
    )
    proc = run([tool("promtool"), "test", "rules", test_file.name], cwd=tmp_path, check=False)
    if proc.returncode != 0:
        names = {f"DashboardExpr{i}": f"{title}: {expr}" for i, (title, expr) in enumerate(expressions)}
        failing = sorted(set(re.findall(r"alertname: (DashboardExpr\d+)", proc.stdout + proc.stderr)))
        pytest.fail(
            "expressions without data:\n" + "\n".join(names[n] for n in failing) + "\n" + proc.stdout + proc.stderr,
            pytrace=False,
        )


def test_substitution_matches_grafana_all():
    assert substitute_variables('x{namespace=~"$namespace"}[$__rate_interval]') == 'x{namespace=~".*"}[5m]'
    assert substitute_variables('x{release=~"${release}"}') == 'x{release=~".*"}'
    with pytest.raises(KeyError):
        substitute_variables('x{pod=~"$pod"}')
