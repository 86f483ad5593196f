"""No layer of the scheduler imports a layer above it, by the order docs/ARCHITECTURE.md §7 states in its layer table.

The table lists the layers top first, each with the folders and modules it holds; a module may import its own layer
and any layer below. Every import counts, lazy and type-only ones too (the graph of test_import_graph.py), and every
module of ``scheduler_svc`` must belong to exactly one layer, so a new module cannot sit outside the order.
"""

from __future__ import annotations

import re

from tests.docs.test_import_graph import ROOT, import_graph, module_name

PACKAGE = "scheduler_svc"


def layer_table() -> list[tuple[str, list[str]]]:
    """[(layer, [path, ...])] top first, from the table under ``### Layers`` in docs/ARCHITECTURE.md §7."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.partition("## 7. Where the code is")[2].partition("\n## ")[0]
    table = section.partition("### Layers")[2]
    rows = []
    for line in table.splitlines():
        m = re.match(r"^\| (\w+) \| ([^|]+) \|", line)
        if m and m.group(1) != "layer":
            rows.append((m.group(1), re.findall(r"`([\w/.]+)`", m.group(2))))
        elif rows and not line.startswith("|"):
            break
    return rows


def layer_of(module: str, table: list[tuple[str, list[str]]]) -> str | None:
    for layer, paths in table:
        for path in paths:
            name = module_name(ROOT, ROOT / path) if path.endswith(".py") else path.rstrip("/").replace("/", ".")
            if module == name or (not path.endswith(".py") and module.startswith(name + ".")):
                return layer
    return None


def test_every_module_of_the_scheduler_has_one_layer():
    table = layer_table()
    assert [layer for layer, _ in table][:2] == ["wiring", "doors"], f"ARCHITECTURE §7's layer table: {table}"
    graph = import_graph(ROOT, [PACKAGE])
    modules = [m for m in graph if m != PACKAGE and not (ROOT / m.replace(".", "/") / "__init__.py").is_file()]
    unplaced = [m for m in modules if layer_of(m, table) is None]
    assert not unplaced, f"modules in no layer of docs/ARCHITECTURE.md §7 (### Layers): {unplaced}"


def test_no_layer_imports_one_above_it():
    table = layer_table()
    rank = {layer: i for i, (layer, _) in enumerate(table)}  # 0 = top
    graph = import_graph(ROOT, [PACKAGE])
    upward = []
    for module, targets in graph.items():
        below = layer_of(module, table)
        for target, where in targets.items():
            above = layer_of(target, table)
            if below and above and rank[above] < rank[below]:
                upward.append(f"{where}: {module} ({below}) imports {target} ({above})")
    assert not upward, "imports of a higher layer:\n" + "\n".join(sorted(upward))


def test_the_checker_sees_an_upward_import():
    table = [("doors", ["scheduler_svc/doors/"]), ("core", ["scheduler_svc/core/"]), ("settings", ["x/config.py"])]
    assert layer_of("scheduler_svc.doors.servicer", table) == "doors"
    assert layer_of("scheduler_svc.core.request", table) == "core"
    assert layer_of("x.config", table) == "settings"
    assert layer_of("scheduler_svc.server", table) is None
