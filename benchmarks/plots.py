"""PNG plots of an analysis (matplotlib, optional): TTFT against N per mode with the text control, bytes per
request per mode, TTFT per turn for the conversation and the sliding window, and the cost of a new image per
payload encoding and encoder placement, and the video scenarios (``benchmarks.transfer.videos.plot``)."""

from __future__ import annotations

import os

from benchmarks.transfer import videos

_COLOURS = {"full": "tab:red", "strip": "tab:orange", "lazy": "tab:green"}
_VARIANT_COLOURS = {"pixels+replicated": "tab:red", "encoded+replicated": "tab:blue", "encoded+sharded": "tab:green"}


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(directory: str, analysis: dict) -> list[str]:
    """The PNG files written (none without matplotlib)."""
    if not available():
        return []
    import matplotlib

    matplotlib.use("Agg")
    paths = [
        _ttft_vs_n(directory, analysis),
        _bytes(directory, analysis),
        _turns(directory, analysis),
        _new_images(directory, analysis),
        videos.plot(directory, analysis.get("videos") or {}),
    ]
    return [p for p in paths if p]


def _tps(rows) -> list[int]:
    return sorted({r["tp"] for r in rows})


def _ttft_vs_n(directory: str, analysis: dict) -> str | None:
    import matplotlib.pyplot as plt

    rows = [r for r in analysis["cached_floor"] if r["scenario"] == "cached_floor"]
    if not rows:
        return None
    tps = _tps(rows)
    fig, axes = plt.subplots(1, len(tps), figsize=(6 * len(tps), 4.2), squeeze=False)
    for ax, tp in zip(axes[0], tps, strict=True):
        for mode, colour in _COLOURS.items():
            for client, style in (("sdk", "-o"), ("resend", ":^")):
                pts = sorted(
                    (r["n"], r["ttft_p50_ms"]) for r in rows if (r["tp"], r["mode"], r["client"]) == (tp, mode, client)
                )
                if pts:
                    label = mode if client == "sdk" else f"{mode}, resend bytes"
                    ax.plot(*zip(*pts, strict=True), style, color=colour, label=label)
            ctrl = sorted(
                (r["n"], r["control_p50_ms"])
                for r in rows
                if (r["tp"], r["mode"], r["client"]) == (tp, mode, "sdk") and r["control_p50_ms"]
            )
            if ctrl:
                ax.plot(*zip(*ctrl, strict=True), "--", color=colour, alpha=0.5, label=f"{mode}, text control")
        ax.set_title(f"cached floor, TP={tp}")
        ax.set_xlabel("distinct cached images N")
        ax.set_ylabel("client TTFT p50 (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, directory, "ttft_vs_n.png")


def _bytes(directory: str, analysis: dict) -> str | None:
    import matplotlib.pyplot as plt

    rows = [r for r in analysis["cached_floor"] if r["scenario"] == "cached_floor" and r["client"] == "sdk"]
    turns = [t for t in analysis["turns"] if t["client"] == "sdk"]
    if not rows and not turns:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    labels, payload, metadata = [], [], []
    for r in sorted(rows, key=lambda r: (r["tp"], r["n"], r["mode"])):
        if r["n"] == max(x["n"] for x in rows):
            labels.append(f"TP{r['tp']} {r['mode']}")
            payload.append(max(r["payload_bytes"], 1) / 1e6)
            metadata.append(max(r["metadata_bytes"], 1) / 1e6)
    if labels:
        xs = range(len(labels))
        bars = axes[0].bar([x - 0.2 for x in xs], payload, 0.4, label="payload")
        for bar, value in zip(bars, payload, strict=True):
            if value <= 1e-6:  # nothing sent: drawn at the axis floor
                axes[0].annotate(
                    "0 B", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=7
                )
        axes[0].bar([x + 0.2 for x in xs], metadata, 0.4, label="metadata")
        axes[0].set_xticks(list(xs), labels, rotation=30, fontsize=8)
        axes[0].set_yscale("log")
        axes[0].set_ylabel("MB per request (log)")
        axes[0].set_title(f"cached floor at N={max(x['n'] for x in rows)}, per timed request")
        axes[0].legend(fontsize=8)
    for t in turns:
        axes[1].plot(
            range(1, t["turns"] + 1),
            [b / 1e6 for b in t["payload_bytes"]],
            ("-" if t["tp"] == 1 else "--") + ("o" if t["scenario"] == "conversation" else "s"),
            markersize=3,
            color=_COLOURS[t["mode"]],
            label=f"{t['scenario']} TP{t['tp']} {t['mode']}",
        )
    axes[1].set_xlabel("turn")
    axes[1].set_ylabel("payload MB broadcast")
    axes[1].set_title("payload per request, by turn")
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=6)
    return _save(fig, directory, "bytes_per_request.png")


def _turns(directory: str, analysis: dict) -> str | None:
    import matplotlib.pyplot as plt

    turns = analysis["turns"]
    if not turns:
        return None
    scenarios = sorted({t["scenario"] for t in turns})
    fig, axes = plt.subplots(1, len(scenarios), figsize=(6 * len(scenarios), 4.2), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        for t in turns:
            if t["scenario"] != scenario:
                continue
            style = ("-" if t["tp"] == 1 else "--") + ("o" if t["client"] == "sdk" else "^")
            ax.plot(
                range(1, t["turns"] + 1),
                t["ttft_ms"],
                style,
                color=_COLOURS[t["mode"]],
                markersize=3,
                label=f"TP{t['tp']} {t['mode']} {t['client']}",
            )
        ax.set_title(scenario.replace("_", " "))
        ax.set_xlabel("turn")
        ax.set_ylabel("client TTFT (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, directory, "ttft_per_turn.png")


def _new_images(directory: str, analysis: dict) -> str | None:
    """Per (TP, image set): payload bytes and collective bytes per new image (log), scheduler CPU per new image,
    one bar per variant; and client TTFT against N new images at the largest TP."""
    import matplotlib.pyplot as plt

    rows = (analysis.get("new_images") or {}).get("rows") or []
    if not rows:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.4))
    cases = list(dict.fromkeys((r["tp"], r["image"]) for r in rows))
    variants = [v for v in _VARIANT_COLOURS if any(r["variant"] == v for r in rows)]  # baseline first
    by = {(r["tp"], r["image"], r["variant"]): r for r in rows}
    width = 0.8 / len(variants)
    for v, variant in enumerate(variants):
        xs = [i + (v - (len(variants) - 1) / 2) * width for i in range(len(cases))]
        got = [by.get((*case, variant)) for case in cases]
        colour = _VARIANT_COLOURS.get(variant)
        axes[0].bar(
            xs,
            [max(r["payload_bytes_wire"] or 1, 1) / 1e3 if r else 0 for r in got],
            width,
            color=colour,
            label=f"{variant}: payload",
        )
        shared = [(x, r["collective_bytes"] / 1e3) for x, r in zip(xs, got, strict=True) if r and r["collective_bytes"]]
        if shared:
            axes[0].plot(*zip(*shared, strict=True), "k_", markersize=14, mew=2)
        axes[1].bar(
            xs,
            [r["scheduler_cpu_ms"]["slope"] if r and r["scheduler_cpu_ms"] else 0 for r in got],
            width,
            color=colour,
            label=variant,
        )
    axes[0].plot([], [], "k_", markersize=14, mew=2, label="encoder output shared over the collective")
    labels = [f"TP{tp}\n{image}" for tp, image in cases]
    for ax, title, unit in ((axes[0], "scheduler→ranks bytes per new image (log)", "kB"),
                            (axes[1], "scheduler CPU per new image", "ms")):  # fmt: skip
        ax.set_xticks(range(len(cases)), labels, fontsize=7)
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7, loc="upper right")
    axes[0].set_yscale("log")
    axes[0].set_ylim(top=axes[0].get_ylim()[1] * 30)  # room for the legend above the tallest bar
    top = max(r["tp"] for r in rows)
    for r in rows:
        if r["tp"] != top or len(r["ttft_p50_by_n"]) < 2:
            continue
        style = "-o" if r["image"].endswith("jpeg") else "--s"
        pts = sorted((int(n), ms) for n, ms in r["ttft_p50_by_n"].items())
        axes[2].plot(
            *zip(*pts, strict=True),
            style,
            color=_VARIANT_COLOURS.get(r["variant"]),
            markersize=4,
            label=f"{r['variant']}, {r['image']}",
        )
    axes[2].set_title(f"new images, TP={top}")
    axes[2].set_xlabel("new images in the request N")
    axes[2].set_ylabel("client TTFT p50 (ms)")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=6)
    return _save(fig, directory, "new_images.png")


def _save(fig, directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
