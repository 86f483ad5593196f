"""docs/ARCHITECTURE.md §7 ("Where the code is") names every module of the packages it maps, so a new module cannot
be left out of the map, and names no module that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
PACKAGES = (
    "common",
    "common/families",
    "scheduler_svc",
    "scheduler_svc/doors",
    "scheduler_svc/engine",
    "scheduler_svc/transport",
    "scheduler_svc/core",
    "worker_svc",
    "mmcast_client",
    "mmcast_client/_core",
    "mmcast_local",
)


def _section() -> str:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    return text.partition("## 7. Where the code is")[2].partition("\n## ")[0]


def _row(section: str, package: str) -> str:
    """The package's own row, else its top package's (``common/families`` is described in ``common/``'s row)."""
    lines = section.splitlines()
    rows = [line for line in lines if line.startswith(f"| `{package}/`")]
    rows = rows or [line for line in lines if line.startswith(f"| `{package.split('/')[0]}/")]
    assert rows, f"§7 has no row for {package}/"
    return rows[0]


def test_every_module_is_in_the_map():
    section = _section()
    missing = []
    for package in PACKAGES:
        row = _row(section, package)
        for path in sorted((ROOT / package).glob("*.py")):
            if path.name != "__init__.py" and f"`{path.name}`" not in row:
                missing.append(f"{package}/{path.name}")
    assert not missing, f"docs/ARCHITECTURE.md §7 does not name: {missing}"


def test_the_map_names_only_modules_that_exist():
    section = _section()
    for package in PACKAGES:
        row = _row(section, package)
        names = set(re.findall(r"`([a-z_]+\.py)`", row))
        present = {p.name for p in (ROOT / package.split("/")[0]).rglob("*.py")}
        assert names <= present, f"{package}: §7 names modules that do not exist: {names - present}"
