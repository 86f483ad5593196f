"""docs/ARCHITECTURE.md §1 has a glossary, and the documents use its words for the things that used to share a name.

"plan" named four things (the scheduler's step plan, the transfer decisions, the rank's first phase, the decoder's
sharding) and "session" two (a rank's stream session, the SDK's conversation). Outside code spans — where a code name
such as ``StepPlan``, ``Session.plan`` or ``session_id`` stands as it is — the prose says "step plan" or "sharding
plan", and "stream session" (or a TLS session); anything else is a conversation, a transfer decision or a step check.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# word -> the qualifiers that may stand right before it
QUALIFIED = {
    "plan": ("step", "sharding", "parallel"),  # "tensor-parallel plan": the sharding plan by transformers' name
    "plans": ("step",),
    "session": ("stream", "tls", "stateful", "live"),  # Envoy's stateful-session filter
    "sessions": ("stream", "live"),
}
WORD = re.compile(r"(?i)(?<![\w`])(plans?|sessions?)(?![\w`-])")


def _prose(text: str) -> str:
    return CODE_SPAN.sub("``", FENCE.sub("", text))


def _glossary_terms() -> list[str]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.partition("### Glossary")[2].partition("\n## ")[0]
    return [m.group(1) for m in re.finditer(r"^\| ([^|]+?) \|", section, re.M) if m.group(1) not in ("term", "---")]


def test_the_glossary_defines_each_term_once():
    terms = _glossary_terms()
    assert terms, "docs/ARCHITECTURE.md §1 has no glossary table (### Glossary)"
    assert len(terms) == len(set(terms)), f"terms defined twice: {sorted(t for t in terms if terms.count(t) > 1)}"
    for term in (
        "item",
        "identifier",
        "payload",
        "step plan",
        "transfer decision",
        "step check",
        "sharding plan",
        "stream session",
        "conversation",
        "live session",
        "step outcome",
        "sampling spec",
        "request body",
        "detokenizer",
        "parse guard",
    ):
        assert term in terms, f"the glossary lacks {term!r}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_plan_and_session_are_qualified(path):
    prose = _prose(path.read_text())
    loose = []
    for m in WORD.finditer(prose):
        word = m.group(1).lower()
        # the word right before it (of a hyphenated one its last part: "tensor-parallel", "stateful-")
        before = re.findall(r"[a-z]+", prose[max(0, m.start() - 40) : m.start()].lower())
        qualifier = before[-1] if before else ""
        if qualifier not in QUALIFIED[word]:
            line = prose.count("\n", 0, m.start()) + 1
            loose.append(f"~line {line}: {prose[max(0, m.start() - 30) : m.end() + 10]!r}")
    assert not loose, (
        f"{path.relative_to(ROOT)} uses 'plan'/'session' without a glossary qualifier "
        "(docs/ARCHITECTURE.md §1: step plan, sharding plan, stream session; else say "
        "transfer decision, step check or conversation):\n" + "\n".join(loose)
    )


# Names retired so that one concept has one name: (where, old name) -> the name now. ``where`` is a path prefix of
# the Python files the old name may not be defined in (a class, function or module).
RETIRED = {
    ("scheduler_svc/", "StepOutcome"): "GroupStepOutcome",  # worker_svc/session.py's StepOutcome is one rank's
    ("", "TextStream"): "Detokenizer",
    ("", "DecodeGuardInterceptor"): "ParseGuardInterceptor",
    ("", "Undecodable"): "Unparsable",
    ("", "decode_guard"): "parse_guard",
    ("scheduler_svc/doors/", "CompletionRequest"): "CompletionBody",  # engine/completion.py's is the engine's
    ("scheduler_svc/doors/", "ChatCompletionRequest"): "ChatCompletionBody",
    ("scheduler_svc/doors/", "ResponsesRequest"): "ResponsesBody",
    ("scheduler_svc/", "Sample"): "Sample",  # one type, common/sample.py, for the sampler and the core
    ("worker_svc/", "Sample"): "Sample",
    ("scheduler_svc/", "SamplingParams"): "RequestSampling",  # the proto's generation_pb2.SamplingParams keeps its name
    ("worker_svc/", "SamplingParams"): "RowSampling",
}


def _definitions() -> list[tuple[str, str]]:
    """(path, name) of every class, function and module the packages define."""
    import ast

    found = []
    for package in ("common", "scheduler_svc", "worker_svc", "mmcast_client", "mmcast_local", "benchmarks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            found.append((rel, path.stem))
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    found.append((rel, node.name))
    return found


def test_retired_names_stay_retired():
    defined = _definitions()
    back = [
        f"{rel}: {name} (now {new})"
        for (where, name_), new in RETIRED.items()
        for rel, name in defined
        if name == name_ and rel.startswith(where)
    ]
    assert not back, "names retired for one name per concept (docs/ARCHITECTURE.md §1) are back:\n" + "\n".join(back)
    new_names = {name for _, name in defined}
    missing = sorted(new for new in RETIRED.values() if new not in new_names)
    assert not missing, f"the glossary's names are not defined anywhere: {missing}"
