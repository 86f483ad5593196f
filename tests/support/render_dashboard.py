"""Draws the Grafana dashboard (helm/mmcast/dashboards/mmcast.json) as a PNG from a Prometheus' data, with matplotlib.

No Grafana is needed: every panel's targets are queried over a time range through the HTTP API (`query_range`) and
drawn where the panel's gridPos puts it, with its unit, legend format and (for stat panels) value mappings. The
integration test renders docs/img/dashboard.png this way from a live local group when MMCAST_RENDER_DASHBOARD=1:

    python -m tests.support.render_dashboard --prometheus http://127.0.0.1:9090 --minutes 15 --out dashboard.png
"""

from __future__ import annotations

import argparse
import math
import re
import time
from pathlib import Path

from tests.support.dashboard import SUBSTITUTIONS, load_dashboard, substitute_variables
from tests.support.prometheus_server import PrometheusAPI

GRID_COLUMNS = 24
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_SI = ((1e9, "G"), (1e6, "M"), (1e3, "k"))
_IEC = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def format_value(value: float, unit: str) -> str:
    """Grafana-like tick labels for the units the dashboard uses."""
    if not math.isfinite(value):
        return ""
    if unit == "percentunit":
        return f"{value * 100:.0f}%"
    if unit == "s":
        if value == 0:
            return "0"
        return f"{value * 1000:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"
    if unit == "bytes":
        for scale, name in _IEC:
            if abs(value) >= scale:
                return f"{value / scale:.3g} {name}"
        return f"{value:.3g} B"
    suffix = {"Bps": "B/s", "ops": " ops/s", "reqps": " req/s"}.get(unit, "")
    for scale, name in _SI:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {name}{suffix}"
    return f"{value:.3g}{suffix}"


def legend(fmt: str | None, metric: dict) -> str:
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(metric.items())) + "}"
    return _LEGEND.sub(lambda m: metric.get(m.group(1), ""), fmt)


def _layout(dashboard: dict) -> list[dict]:
    """Every panel (rows too, and panels of collapsed rows) in drawing order."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def fetch(
    prom: PrometheusAPI, dashboard: dict, start: float, end: float, step: float, substitutions: dict[str, str]
) -> dict[int, list[tuple[str, list[float], list[float]]]]:
    """panel id -> [(legend, times, values)] for every target of every non-row panel."""
    data: dict[int, list[tuple[str, list[float], list[float]]]] = {}
    for panel in _layout(dashboard):
        if panel.get("type") == "row":
            continue
        series = data.setdefault(panel["id"], [])
        for target in panel.get("targets", []):
            expr = substitute_variables(target["expr"], substitutions)
            for result in prom.query_range(expr, start, end, step):
                times = [float(t) - start for t, _ in result["values"]]
                values = [float(v) for _, v in result["values"]]
                series.append((legend(target.get("legendFormat"), result["metric"]), times, values))
    return data


def render(
    data: dict[int, list[tuple[str, list[float], list[float]]]],
    dashboard: dict,
    out: Path,
    *,
    title: str,
    span: float,
    width_inches: float = 18.0,
    dpi: int = 80,
) -> Path:
    """`data` as `fetch` returns it; `span`: seconds the x axes cover (times are relative to the range start)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    panels = _layout(dashboard)
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_height = width_inches / GRID_COLUMNS * 0.42  # Grafana's 30 px row unit against a ~72 px column
    header = 0.6
    height = rows * unit_height + header
    fig = plt.figure(figsize=(width_inches, height), dpi=dpi, facecolor="#f4f5f5")
    fig.suptitle(title, x=0.01, y=1 - 0.12 / height, ha="left", va="top", fontsize=13, fontweight="bold")

    def box(grid: dict, pad_left: float = 0.1, pad_right: float = 0.1, pad_top: float = 0.0, pad_bottom: float = 0.0):
        """Figure coordinates of a gridPos, less margins in inches."""
        x0 = grid["x"] / GRID_COLUMNS + pad_left / width_inches
        w = grid["w"] / GRID_COLUMNS - (pad_left + pad_right) / width_inches
        top = 1 - (header + grid["y"] * unit_height) / height - pad_top / height
        h = grid["h"] * unit_height / height - (pad_top + pad_bottom) / height
        return [x0, top - h, w, h]

    for panel in panels:
        grid, kind = panel["gridPos"], panel.get("type")
        if kind == "row":
            x0, y0, _, h = box(grid)
            fig.text(x0, y0 + h / 2, panel["title"], fontsize=12, fontweight="bold", va="center", color="#333")
            continue
        series = data.get(panel["id"], [])
        defaults = panel.get("fieldConfig", {}).get("defaults", {})
        unit = defaults.get("unit", "short")
        if kind == "stat":
            ax = fig.add_axes(box(grid, pad_top=0.35, pad_bottom=0.1))
            ax.set_xticks([])
            ax.set_yticks([])
            last = [next((v for v in reversed(vals) if math.isfinite(v)), math.nan) for _, _, vals in series]
            text, color = _stat_text(last, defaults)
            ax.set_facecolor(color)
            ax.text(
                0.5,
                0.5,
                text,
                ha="center",
                va="center",
                fontsize=26,
                fontweight="bold",
                color="white",
                transform=ax.transAxes,
            )
            ax.set_title(panel["title"], fontsize=10, loc="left")
            continue
        ax = fig.add_axes(box(grid, pad_left=0.75, pad_right=0.15, pad_top=0.3, pad_bottom=0.55))
        ax.set_facecolor("white")
        ax.set_title(panel["title"], fontsize=10, loc="left")
        ax.grid(True, color="#e3e3e3", linewidth=0.6)
        ax.tick_params(labelsize=7)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos, unit=unit: format_value(v, unit)))
        for label, times, values in series:
            line = ax.plot(times, values, linewidth=1.2, label=label)[0]
            ax.fill_between(times, values, alpha=0.08, color=line.get_color())
        if "min" in defaults:
            ax.set_ylim(bottom=defaults["min"])
        if "max" in defaults:
            ax.set_ylim(top=defaults["max"])
        ax.set_xlim(0, span)
        ax.set_xlabel("seconds", fontsize=7, labelpad=1)
        if series:
            ax.legend(fontsize=6.5, loc="upper left", frameon=False, ncol=2 if len(series) > 4 else 1)
        else:
            ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes, color="#888")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, facecolor=fig.get_facecolor())
    plt.close(fig)
    return out


def _stat_text(values: list[float], defaults: dict) -> tuple[str, str]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "No data", "#888888"
    value = min(finite)
    for mapping in defaults.get("mappings", []):
        option = mapping.get("options", {}).get(f"{value:g}")
        if mapping.get("type") == "value" and option:
            return option.get("text", f"{value:g}"), {"green": "#56a64b", "red": "#e02f44"}.get(
                option.get("color", ""), option.get("color", "#56a64b")
            )
    return f"{value:g}", "#56a64b"


def render_dashboard(
    prom: PrometheusAPI,
    start: float,
    end: float,
    out: Path,
    *,
    step: float = 1.0,
    rate_interval: str = "10s",
    title: str | None = None,
) -> Path:
    """Queries every panel over [start, end] and writes the PNG. `rate_interval` stands in for Grafana's
    $__rate_interval (Grafana takes max(4 x scrape interval, step + scrape interval); a short run wants a short one)."""
    dashboard = load_dashboard()
    substitutions = {**SUBSTITUTIONS, "__rate_interval": rate_interval}
    data = fetch(prom, dashboard, start, end, step, substitutions)
    title = title or (
        f"{dashboard['title']} — {end - start:.0f} s from {prom.url}, $__rate_interval={rate_interval}, step {step:g} s"
    )
    return render(data, dashboard, out, title=title, span=end - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=15, help="range ending now (ignored with --start)")
    parser.add_argument("--start", type=float, help="unix time of the range start")
    parser.add_argument("--end", type=float, help="unix time of the range end (default now)")
    parser.add_argument("--step", type=float, help="seconds between points (default: range / 300, at least 1)")
    parser.add_argument("--rate-interval", default="1m", help="value of $__rate_interval (default 1m)")
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = parser.parse_args(argv)
    end = args.end or time.time()
    start = args.start or end - args.minutes * 60
    step = args.step or max(1.0, (end - start) / 300)
    path = render_dashboard(
        PrometheusAPI(args.prometheus), start, end, args.out, step=step, rate_interval=args.rate_interval
    )
    print(path)


if __name__ == "__main__":
    main()
