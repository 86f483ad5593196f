"""The Grafana dashboard's PromQL, for tests that check or run it (offline with promtool, live against Prometheus).

The dashboard's one source is helm/mmcast/dashboards/mmcast.json; this module only reads it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD_FILE = Path(__file__).resolve().parents[2] / "helm" / "mmcast" / "dashboards" / "mmcast.json"

# What Grafana would put in place of each variable when every value is selected: the dashboard's `All` is `.*`,
# which also matches series without the label (a Prometheus that sets only job/instance).
SUBSTITUTIONS = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
    "namespace": ".*",
    "release": ".*",
}

# Variables Grafana defines itself.
BUILTIN_VARIABLES = {
    "__rate_interval",
    "__interval",
    "__interval_ms",
    "__range",
    "__range_s",
    "__range_ms",
    "__from",
    "__to",
    "__dashboard",
    "__name",
    "__org",
    "__user",
    "__all",
    "timeFilter",
    "__timeFilter",
}

_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)(?::\w+)?\]\]")


def load_dashboard(path: Path = DASHBOARD_FILE) -> dict:
    return json.loads(path.read_text())


def panels(dashboard: dict | None = None) -> list[dict]:
    """Every panel, those inside collapsed rows included, rows themselves excluded."""
    dashboard = dashboard or load_dashboard()
    out = []
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def substitute_variables(expr: str, values: dict[str, str] | None = None) -> str:
    """Replace $var, ${var} and [[var]] with the values Grafana would use (SUBSTITUTIONS by default)."""
    values = SUBSTITUTIONS if values is None else values

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in values:
            raise KeyError(f"no substitution for ${name} in {expr!r}")
        return values[name]

    return _VAR.sub(repl, expr)


def variables_used(text: str) -> set[str]:
    return {m.group(1) or m.group(2) or m.group(3) for m in _VAR.finditer(text)}


def dashboard_expressions(substitute: bool = True, *, dashboard: dict | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, variables substituted unless asked not to."""
    out = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            out.append((panel["title"], substitute_variables(expr) if substitute else expr))
    return out
