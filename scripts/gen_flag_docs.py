"""Renders the flag tables of the documentation from the settings dataclasses, so no default is kept by hand.

    .venv/bin/python scripts/gen_flag_docs.py          # rewrite the tables in README.md and docs/FLAGS.md
    .venv/bin/python scripts/gen_flag_docs.py --check  # exit 1 when a committed table differs (tests do this too)

Every flag of ``mmcast-scheduler`` (``scheduler_svc.config.SchedulerConfig``) and ``mmcast-worker``
(``worker_svc.config.WorkerConfig``) is a ``common.settings.setting``; its flag, variable, default, section and help
text come from the field alone (``common.settings.flag_of``, ``env_of``, ``default_of``). The tables replace what
stands between the ``<!-- flags:NAME:begin -->`` / ``<!-- flags:NAME:end -->`` markers:

- ``flags:scheduler`` and ``flags:worker`` in docs/FLAGS.md: every flag, one table per ``--help`` section;
- ``flags:readme`` in README.md: the flags most often changed (``README_FLAGS``), with a note where the help text
  alone says too little.

The prose around the markers is kept.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FLAGS_DOC = ROOT / "docs" / "FLAGS.md"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (binary, field, note appended to the help text) of the README's table, in its order.
README_FLAGS: tuple[tuple[str, str, str], ...] = (
    (
        "scheduler",
        "transfer_mode",
        "a `strip` request whose uncovered payloads exceed a rank's payload cache has them deferred as `lazy` does",
    ),
    ("scheduler", "payload_encoding", "under `encoded` the frontend reads only image headers"),
    ("scheduler", "encoder_placement", ""),
    ("scheduler", "max_num_batched_tokens", ""),
    ("scheduler", "max_num_seqs", ""),
    ("scheduler", "max_waiting", ""),
    ("worker", "kv_blocks", ""),
    ("worker", "kv_cache_memory_fraction", "vLLM's `gpu_memory_utilization` / `VLLM_CPU_KVCACHE_SPACE`"),
    ("worker", "payload_cache_bytes", ""),
    ("worker", "encoder_cache_tokens", ""),
    ("scheduler", "max_images_per_request", ""),
    ("scheduler", "max_image_pixels", ""),
    ("scheduler", "max_upload_bytes", ""),
    ("scheduler", "max_request_bytes", ""),
    ("scheduler", "allowed_media_domains", 'the SSRF rules: [docs/SECURITY.md](docs/SECURITY.md), "Image URLs"'),
    ("scheduler", "http_port", '`serve-local` turns it on at 8000; see "Call it with any OpenAI client"'),
    ("scheduler", "served_model_name", ""),
)


def config_classes() -> dict[str, type]:
    """Binary -> its settings dataclass."""
    from scheduler_svc.config import SchedulerConfig
    from worker_svc.config import WorkerConfig

    return {"scheduler": SchedulerConfig, "worker": WorkerConfig}


def _cell(text: str) -> str:
    """One line of Markdown table text: no pipes, no HTML, no emphasis by accident."""
    text = " ".join(text.split())
    for raw, escaped in (("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*")):
        text = text.replace(raw, escaped)
    return text


def _size(n: int) -> str:
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n, rest = divmod(n, 1024)
        if rest:
            return ""
        if n < 1024:
            return f"{n} {unit}"
    return ""


def shown_default(f: dataclasses.Field) -> str:
    """The default as a table cell: what to type for it, and a size in words for round byte counts."""
    from common.settings import default_of

    value = default_of(f)
    if value is dataclasses.MISSING:
        return "required"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return f"`{','.join(map(str, value))}`" if value else "empty"
    if isinstance(value, float):
        return f"`{value:g}`"
    if value == "":
        return "empty"
    if isinstance(value, int) and "_bytes" in f.name and value >= 1024:
        words = _size(value)
        return f"`{value}` ({words})" if words else f"`{value}`"
    return f"`{value}`"


def _row(f: dataclasses.Field, label: str = "", note: str = "") -> str:
    from common.settings import env_of, flag_of

    meaning = _cell(f.metadata.get("help", ""))
    if note:
        meaning = f"{meaning}; {note}"
    return f"| `{flag_of(f)}`{label} | `{env_of(f)}` | {shown_default(f)} | {meaning} |"


HEADER = "| flag | environment variable | default | meaning |\n|---|---|---|---|"


def binary_tables(cls: type) -> str:
    """Every flag of ``cls``, one table per ``--help`` section, in the order of the dataclass."""
    sections: dict[str, list[str]] = {}
    for f in dataclasses.fields(cls):
        sections.setdefault(f.metadata.get("section", "settings"), []).append(_row(f))
    return "\n\n".join(f"**{title}**\n\n{HEADER}\n" + "\n".join(rows) for title, rows in sections.items())


def readme_table() -> str:
    classes = config_classes()
    rows = []
    for binary, name, note in README_FLAGS:
        (f,) = [f for f in dataclasses.fields(classes[binary]) if f.name == name]
        rows.append(_row(f, " (worker)" if binary == "worker" else "", note))
    return HEADER + "\n" + "\n".join(rows)


def regions() -> dict[Path, dict[str, str]]:
    """Document -> {marker name: generated body}."""
    classes = config_classes()
    return {
        README: {"flags:readme": readme_table()},
        FLAGS_DOC: {f"flags:{b}": binary_tables(cls) for b, cls in classes.items()},
    }


def replace_region(doc: str, name: str, body: str, where: Path) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    head, found, rest = doc.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found or not found_end:
        raise SystemExit(f"{where.relative_to(ROOT)} has no {begin} ... {end} markers")
    return f"{head}{begin}\n{body}\n{end}{tail}"


def render(path: Path, current: str) -> str:
    """``current`` (the text of ``path``) with its flag regions generated anew."""
    for name, body in regions()[path].items():
        current = replace_region(current, name, body, path)
    return current


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print(__doc__, file=sys.stderr)
        return 2
    stale = []
    for path in regions():
        current = path.read_text()
        fresh = render(path, current)
        if fresh != current:
            stale.append(str(path.relative_to(ROOT)))
            if not check:
                path.write_text(fresh)
    if check and stale:
        print(
            f"stale flag tables in {', '.join(stale)}: run `.venv/bin/python scripts/gen_flag_docs.py`", file=sys.stderr
        )
        return 1
    print(("stale: " if check else "rewrote: ") + ", ".join(stale) if stale else "flag tables are current")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
