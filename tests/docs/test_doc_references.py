"""Every reference in the repository's text points at something in the repository.

Scanned: every text file of the tree as git lists it (tracked, and untracked but not ignored) — Markdown, the chart,
Makefile, Dockerfile, protos, configuration whole; Python files in their comments and docstrings only (their other
strings are data: file names a test writes, hostile inputs); generated protobuf code not at all. Checked:

- every Markdown file name resolves to a file here: as a path from the root, from the citing file's folder, or (a
  bare name) as the name of some file in the tree — so a note kept outside the repository can never be cited;
- every citation of a numbered section (``docs/ARCHITECTURE.md`` followed by the section sign and ``2.7``; a bare
  section sign inside a Markdown file cites that file) names a heading that exists, ``## N. Title`` or
  ``### N.M Title``;
- numbered documents keep that convention: ``##`` headings numbered 1, 2, ... in order, numbered ``###`` headings
  N.1, N.2, ... under their ``## N.``;
- every path into a top-level folder, every dotted module of a Python package and every bare Python file name
  exists, and no ``../`` path leaves the repository;
- the README's layout table lists only paths that exist, and every top-level folder.

Not references: text inside URLs (a link to another project), paths git ignores (``benchmarks/results/``, where the
benchmarks write), and the report names in ``GENERATED`` (files the benchmarks write there).
"""

from __future__ import annotations

import ast
import bisect
import fnmatch
import functools
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
TEXT_SUFFIXES = {".py", ".pyi", ".md", ".yaml", ".yml", ".tpl", ".txt", ".toml", ".json", ".proto", ".sh", ".cfg"}
TEXT_NAMES = {"Makefile", "Dockerfile", ".dockerignore", ".gitignore", ".helmignore", "run"}
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", "build", "dist", "node_modules", ".pytest_cache", ".ruff_cache"}
# Reports the benchmarks write into benchmarks/results/ (git-ignored): named in their docs, never in the tree.
GENERATED = {
    "results.md",
    "rank_memory.md",
    "security.md",
    "rank_engine.md",
    "http_overhead.md",
    "grammar_cost.md",
    "sampler.md",
    "step_overlap.md",
}
# ``mmcast.*`` also names loggers, proto packages and chart helpers; its one module, mmcast.v1, is checked as a path.
NOT_MODULE_NAMESPACES = {"mmcast"}

URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")
MD_NAME = re.compile(r"(?<![\w/.-])((?:\.\.?/)*[\w./-]*?[\w-]+\.md)(?![\w-])")
# A file name, then the section sign and a number (comma or spaces between); in Markdown, the sign alone cites
# the file itself.
SECTION_SIGN = re.compile(r"§\s*(\d+(?:\.\d+)*)")
CITED_FILE = re.compile(r"(?<![\w./-])([\w./-]*[\w-]+\.md)[ \t,]*$")  # right before the sign
HEADING = re.compile(r"^(#{1,6})[ \t]+(?:(\d+(?:\.\d+)*)\.?[ \t]+)?(\S.*)$", re.M)
PARENT_PATH = re.compile(r"(?<![\w./-])((?:\.\./)+[\w./-]*)")
BARE_PY = re.compile(r"(?<![\w./-])([A-Za-z_]\w*\.py)(?!\w)")


def _listed_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [line for line in out.splitlines() if (ROOT / line).is_file()]
    except (OSError, subprocess.CalledProcessError):  # a copy without .git: walk it
        found = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
            found += [Path(folder, f).relative_to(ROOT).as_posix() for f in files]
        return found


@functools.cache
def tree() -> frozenset[str]:
    """Every file of the repository, as a root-relative POSIX path."""
    return frozenset(Path(p).as_posix() for p in _listed_files())


@functools.cache
def folders() -> frozenset[str]:
    return frozenset(parent.as_posix() for p in tree() for parent in Path(p).parents if str(parent) != ".")


@functools.cache
def basenames() -> frozenset[str]:
    return frozenset(Path(p).name for p in tree())


@functools.cache
def top_level_folders() -> frozenset[str]:
    return frozenset(f for f in folders() if "/" not in f and not f.startswith("."))


@functools.cache
def ignored(path: str) -> bool:
    """Whether git ignores the path: where tools write their output (benchmarks/results/), not a reference."""
    try:
        # A trailing slash lets a folder pattern (``results/``) match a folder that does not exist yet.
        codes = {
            subprocess.run(["git", "check-ignore", "-q", p], cwd=ROOT, capture_output=True).returncode
            for p in (path, path + "/")
        }
    except OSError:
        codes = {128}
    if 0 in codes:
        return True
    if codes == {1}:
        return False
    return _gitignore_matches(path)  # no git, or not a repository: the root .gitignore's plain patterns


def _gitignore_matches(path: str) -> bool:
    gitignore = ROOT / ".gitignore"
    patterns = gitignore.read_text().split("\n") if gitignore.is_file() else []
    parts = path.split("/")
    for pattern in (p.strip() for p in patterns):
        if not pattern or pattern.startswith(("#", "!")):
            continue
        pattern = pattern.strip("/")
        if "/" in pattern:  # anchored at the root: the path or a folder above it
            depth = pattern.count("/") + 1
            if fnmatch.fnmatchcase("/".join(parts[:depth]), pattern):
                return True
        elif any(fnmatch.fnmatchcase(part, pattern) for part in parts):
            return True
    return False


def _is_text(path: str) -> bool:
    p = Path(path)
    if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")):
        return False  # generated from proto/, whose text is scanned there
    return p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES


def _python_prose(source: str) -> str:
    """The source with everything but comments and docstrings (string statements) blanked; lines stay in place.

    ``ast`` finds the string literals (a ``#`` inside one starts no comment) and the string statements; it is an
    order of magnitude faster than ``tokenize`` on the whole tree."""
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))

    def at(lineno: int, col: int) -> int:  # ast columns count UTF-8 bytes
        return offsets[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode(errors="ignore"))

    literals, docstrings = [], []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str | bytes)):
            literals.append((at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset)))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings.append((at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset)))
    literals.sort()
    starts = [s for s, _ in literals]
    kept = [c if c == "\n" else " " for c in source]
    for start, end in docstrings:
        kept[start:end] = source[start:end]
    for m in re.finditer("#", source):
        i = bisect.bisect_right(starts, m.start()) - 1
        if i >= 0 and literals[i][0] <= m.start() < literals[i][1]:
            continue  # inside a string literal
        end = source.find("\n", m.start())
        end = len(source) if end < 0 else end
        kept[m.start() : end] = source[m.start() : end]
    return "".join(kept)


@functools.cache
def texts() -> dict[str, str]:
    out = {}
    for path in sorted(tree()):
        if not _is_text(path):
            continue
        try:
            text = (ROOT / path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if path.endswith(".py"):
            text = _python_prose(text)
        out[path] = URL.sub(lambda m: " " * len(m.group(0)), text)
    return out


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _resolve(name: str, citing: str) -> str | None:
    """The repository file a cited path means, or None. Tried: from the root, from the citing file's folder, as
    the tail of a path in the tree (``mmcast/v1/tensor.proto`` from ``proto/``), and a bare name as any file's."""
    for base in (Path("."), Path(citing).parent):
        candidate = Path(os.path.normpath(base / name)).as_posix()
        if candidate in tree() or candidate in folders():
            return candidate
    tail = "/" + name.lstrip("./")
    for p in sorted(tree()):
        if p.endswith(tail) or ("/" not in name and Path(p).name == name):
            return p
    return None


@functools.cache
def sections(md_path: str) -> frozenset[str]:
    return frozenset(m.group(2) for m in HEADING.finditer(texts()[md_path]) if m.group(2))


def test_the_scan_sees_the_tree():
    """The checks below cannot pass vacuously: the scan reads the documents and the code that cite them."""
    assert {"README.md", "docs/ARCHITECTURE.md", "scheduler_svc/core/transfer.py", "Makefile"} <= set(texts())
    assert "3" in sections("docs/ARCHITECTURE.md") and "2.7" in sections("docs/ARCHITECTURE.md")
    assert "docs/ARCHITECTURE.md §2.4" in texts()["scheduler_svc/core/transfer.py"]  # a docstring is kept


def test_python_files_are_read_in_their_comments_and_docstrings_only():
    source = '"""Doc: see a.md."""\nX = "b.md"  # c.md\n\n\ndef f():\n    """d.md"""\n    return "e.md"\n'
    prose = _python_prose(source)
    assert [m.group(1) for m in MD_NAME.finditer(prose)] == ["a.md", "c.md", "d.md"]
    assert len(prose) == len(source) and prose.count("\n") == source.count("\n")


def test_every_md_file_named_exists():
    missing = []
    for path, text in texts().items():
        for m in MD_NAME.finditer(text):
            name = m.group(1)
            if Path(name).name in GENERATED or _resolve(name, path) is not None:
                continue
            missing.append(f"{path}:{_line(text, m.start())}: {name}")
    assert not missing, "Markdown files named but not in the repository:\n" + "\n".join(missing)


def citations(text: str):
    """(cited file name or None, section number, position) of every section sign followed by a number."""
    for m in SECTION_SIGN.finditer(text):
        before = CITED_FILE.search(text, max(0, m.start() - 200), m.start())
        yield (before.group(1) if before else None), m.group(1), m.start()


def test_every_section_cited_exists():
    broken = []
    for path, text in texts().items():
        for name, number, pos in citations(text):
            where = f"{path}:{_line(text, pos)}: {name or ''} §{number}"
            if name is None:
                if not path.endswith(".md"):
                    broken.append(f"{where} cites a section without naming the file")
                    continue
                target = path
            else:
                target = _resolve(name, path)
                if target is None or not target.endswith(".md"):
                    broken.append(f"{where}: no such file")
                    continue
            if number not in sections(target):
                broken.append(f"{where}: {target} has no heading numbered {number}")
    assert not broken, "Section citations that point nowhere:\n" + "\n".join(broken)


def test_numbered_documents_keep_the_heading_convention():
    problems = []
    numbered = [p for p in texts() if p.endswith(".md") and sections(p)]
    assert "docs/ARCHITECTURE.md" in numbered
    for path in numbered:
        chapter, sub = 0, 0
        for m in HEADING.finditer(texts()[path]):
            level, number = len(m.group(1)), m.group(2)
            where = f"{path}:{_line(texts()[path], m.start())}: {m.group(0)!r}"
            if level == 2:
                chapter, sub = chapter + 1, 0
                if number != str(chapter):
                    problems.append(f"{where}: expected '## {chapter}. ...'")
            elif level == 3 and number is not None:
                sub += 1
                if number != f"{chapter}.{sub}":
                    problems.append(f"{where}: expected '### {chapter}.{sub} ...'")
            elif level > 3 and number is not None:
                problems.append(f"{where}: only ## and ### headings are numbered")
    assert not problems, "\n".join(problems)


def test_every_path_into_the_tree_exists():
    tops = "|".join(sorted(map(re.escape, top_level_folders())))
    path_ref = re.compile(rf"(?<![\w./-])((?:{tops})/[\w./-]*[\w/])")
    missing = []
    for path, text in texts().items():
        for m in path_ref.finditer(text):
            ref = m.group(1).rstrip("/")
            if "*" in ref or _resolve(ref, path) is not None or ignored(ref):
                continue
            missing.append(f"{path}:{_line(text, m.start())}: {m.group(1)}")
    assert not missing, "Paths that are not in the repository:\n" + "\n".join(missing)


def test_every_dotted_module_exists():
    packages = sorted(
        f
        for f in top_level_folders() - NOT_MODULE_NAMESPACES
        if any(p.startswith(f + "/") and p.endswith(".py") and p.count("/") == 1 for p in tree())
    )
    dotted = re.compile(rf"(?<![\w./-])((?:{'|'.join(map(re.escape, packages))})(?:\.[A-Za-z_]\w*)+)")
    missing = []
    for path, text in texts().items():
        if not path.endswith((".py", ".md")):
            continue
        for m in dotted.finditer(text):
            head, first = m.group(1).split(".")[:2]
            if first in {"py", "md", "yaml", "json", "txt", "proto"}:
                continue  # a file name's suffix, not a module
            if text[max(0, m.start() - 12) : m.start()].endswith('"logger": "'):
                continue  # a log line's logger name, which keeps its name when its module moves
            if f"{head}/{first}.py" in tree() or f"{head}/{first}" in folders():
                continue
            if re.search(
                rf"\b{re.escape(first)}\b",
                texts().get(f"{head}/__init__.py", "")
                + ((ROOT / head / "__init__.py").read_text() if (ROOT / head / "__init__.py").is_file() else ""),
            ):
                continue  # a name the package itself exports
            missing.append(f"{path}:{_line(text, m.start())}: {m.group(1)}")
    assert not missing, "Modules named but not in the repository:\n" + "\n".join(missing)


def test_every_bare_python_file_named_exists():
    missing = []
    for path, text in texts().items():
        for m in BARE_PY.finditer(text):
            if m.group(1) not in basenames():
                missing.append(f"{path}:{_line(text, m.start())}: {m.group(1)}")
    assert not missing, "Python files named but not in the repository:\n" + "\n".join(missing)


def test_no_path_leaves_the_repository():
    outside = []
    for path, text in texts().items():
        for m in PARENT_PATH.finditer(text):
            target = Path(os.path.normpath(Path(path).parent / m.group(1)))
            if target.parts[:1] == ("..",):
                outside.append(f"{path}:{_line(text, m.start())}: {m.group(1)}")
    assert not outside, "References to files outside the repository:\n" + "\n".join(outside)


def _layout_rows() -> list[str]:
    text = texts()["README.md"]
    start = text.index("## Layout")
    end = text.index("\n## ", start + 1)
    return re.findall(r"^\|\s*`([^`]+)`\s*\|", text[start:end], re.M)


def test_the_readme_layout_table_matches_the_tree():
    rows = _layout_rows()
    assert rows, "README.md has no layout table under '## Layout'"
    missing = [r for r in rows if r.rstrip("/") not in tree() and r.rstrip("/") not in folders()]
    assert not missing, f"README layout rows that are not in the tree: {missing}"
    unlisted = sorted(top_level_folders() - {r.split("/")[0] for r in rows})
    assert not unlisted, f"top-level folders the README layout table does not list: {unlisted}"


@pytest.mark.parametrize(
    "text, cited",
    [
        ("see docs/ARCHITECTURE.md §2.4", [("docs/ARCHITECTURE.md", "2.4")]),
        ("(SECURITY.md, §6)", [("SECURITY.md", "6")]),
        ("§3, invariant 1", [(None, "3")]),
    ],
)
def test_the_citation_pattern_reads_the_forms_in_use(text, cited):
    assert [(name, number) for name, number, _ in citations(text)] == cited
