"""Prometheus rules: valid, unit-tested with promtool, and complete enough to page someone usefully."""

from __future__ import annotations

import yaml

from tests.support.deploy_tools import ROOT, RULES_FILE, RULES_TEST_FILE, run, tool

ALERTS = {
    "MmcastWorkerGroupDown",
    "MmcastGrpcErrorRatioHigh",
    "MmcastTimeToFirstTokenP99High",
    "MmcastPreemptionStorm",
    "MmcastInterTokenLatencyP99High",
}


def test_promtool_check_rules():
    run([tool("promtool"), "check", "rules", str(RULES_FILE)])


def test_promtool_unit_tests():
    out = run([tool("promtool"), "test", "rules", RULES_TEST_FILE.name], cwd=RULES_TEST_FILE.parent).stdout
    assert "SUCCESS" in out


def test_alerts_are_complete():
    rules = [r for g in yaml.safe_load(RULES_FILE.read_text())["groups"] for r in g["rules"]]
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    assert set(alerts) == ALERTS
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        assert rule.get("for"), f"{name} must wait before firing"
        assert {"summary", "description"} <= rule["annotations"].keys(), name
    for rule in rules:
        assert "vector(0)" not in rule["expr"], rule


def test_every_alert_has_a_unit_test():
    tests = yaml.safe_load(RULES_TEST_FILE.read_text())["tests"]
    tested = {case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if case["exp_alerts"]}
    assert tested == ALERTS
    records = {
        r["record"] for g in yaml.safe_load(RULES_FILE.read_text())["groups"] for r in g["rules"] if "record" in r
    }
    checked = {case["expr"] for t in tests for case in t.get("promql_expr_test", [])}
    assert records <= checked, f"recording rules without a unit test: {records - checked}"


def test_standalone_prometheus_config():
    out = run([tool("promtool"), "check", "config", "deploy/prometheus/prometheus.yml"]).stdout
    assert "1 rule files found" in out
    # Debian's promtool is built without Kubernetes discovery, so the pod scrape job is checked for shape only.
    (job,) = yaml.safe_load((ROOT / "deploy" / "prometheus" / "kubernetes-pods-scrape.yaml").read_text())
    targets = {r.get("target_label") for r in job["relabel_configs"]}
    assert {"namespace", "release", "pod", "container"} <= targets
    # Every metrics port the chart declares is kept, in every layout; no other port.
    (keep,) = [
        r for r in job["relabel_configs"] if r.get("source_labels") == ["__meta_kubernetes_pod_container_port_name"]
    ]
    import re

    for name in ("metrics", "rank0-metrics", "rank15-metrics", "rank-metrics"):
        assert re.fullmatch(keep["regex"], name), name
    for name in ("grpc", "rank0-grpc", "rank-dist", "health"):
        assert not re.fullmatch(keep["regex"], name), name
