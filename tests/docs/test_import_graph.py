"""No import circle among the modules of the project's packages.

Every import counts: at the top of a module, inside a function (lazy), and under ``if TYPE_CHECKING:`` (type-only),
because each says that one module needs the other, and a circle means neither can be read, tested or moved without
the other. A package's ``__init__.py`` is the module of the package (``common.families``). ``from pkg import name``
is an import of the module ``pkg.name`` when that module exists, else of ``pkg`` itself. Only explicit imports are
edges: importing ``a.b.c`` also runs ``a/b/__init__.py``, but a module does not ask for that.

A circle is broken by moving the piece both sides need into a module below both, never by hiding the import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
PACKAGES = ("scheduler_svc", "worker_svc", "common", "mmcast_client", "mmcast_local", "benchmarks")

Graph = dict[str, dict[str, str]]  # module -> {module it imports: "path:line" of the first such import}


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[tuple[str, str]]:
    """(dotted name, where it lives) per name an import statement imports: ``import a.b`` gives ("a.b", "a.b"),
    ``from a import b`` gives ("a.b", "a"), b being either the module ``a.b`` or a name defined in ``a``."""
    if isinstance(node, ast.Import):
        return [(alias.name, alias.name) for alias in node.names]
    if node.level:  # relative: from the module's package, one level up per extra dot
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join([*base, *([node.module] if node.module else [])])
    else:
        source = node.module or ""
    return [(f"{source}.{alias.name}", source) for alias in node.names]


def import_graph(root: Path, packages: Iterable[str]) -> Graph:
    """Every module of ``packages`` (folders under ``root``) and the modules of those packages it imports."""
    paths = {module_name(root, p): p for package in packages for p in sorted((root / package).rglob("*.py"))}

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in paths:
            parts.pop()  # `import a.b.c` where c is a class: the nearest enclosing module
        return ".".join(parts) or None

    graph: Graph = {}
    for module, path in paths.items():
        edges: dict[str, str] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name, source in _imported(node, module, path.name == "__init__.py"):
                target = name if name in paths else resolve(source)
                if target and target != module:
                    edges.setdefault(target, f"{path.relative_to(root)}:{node.lineno}")
        graph[module] = edges
    return graph


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next((t for t in targets if t in graph), None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(graph: Graph, component: list[str]) -> str:
    members = set(component)
    edges = [f"  {a} -> {b} ({where})" for a in component for b, where in sorted(graph[a].items()) if b in members]
    return " <-> ".join(component) + "\n" + "\n".join(edges)


def test_the_packages_import_no_circle():
    graph = import_graph(ROOT, PACKAGES)
    assert len(graph) > 100, f"only {len(graph)} modules found under {PACKAGES}"  # the walk saw the tree
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(_describe(graph, c) for c in found)


# --- the checker itself, on tiny graphs ----------------------------------------------------------------------------


def test_circles_finds_two_and_three_module_circles_and_nothing_else():
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a", "d"}, "d": {"e"}, "e": {"c"}, "f": {"c"}, "g": set()}
    assert sorted(circles(graph)) == [["a", "b"], ["c", "d", "e"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) == []


def test_lazy_type_only_and_relative_imports_are_edges(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.leaf import Leaf\n")
    (pkg / "sub" / "leaf.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import top\n"
    )
    (pkg / "top.py").write_text("def f():\n    from .sub import leaf\n")
    (pkg / "other.py").write_text("import pkg.sub.leaf.Leaf\nfrom . import top\n")
    graph = import_graph(tmp_path, ["pkg"])
    assert set(graph["pkg.sub"]) == {"pkg.sub.leaf"}  # `from pkg.sub.leaf import Leaf`: the module, not the class
    assert set(graph["pkg.sub.leaf"]) == {"pkg.top"}  # type-only
    assert set(graph["pkg.top"]) == {"pkg.sub.leaf"}  # lazy and relative
    assert set(graph["pkg.other"]) == {"pkg.sub.leaf", "pkg.top"}
    assert circles(graph) == [["pkg.sub.leaf", "pkg.top"]]
    assert "pkg/top.py:2" in _describe(graph, ["pkg.sub.leaf", "pkg.top"])
