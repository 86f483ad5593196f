"""No code-executing deserialization anywhere in the product: nothing received on the wire or read from a cache
may be unpickled or loaded with torch.load. This test fails the build when such a call appears."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ["common", "scheduler_svc", "worker_svc", "mmcast_client", "mmcast_local", "mmcast", "benchmarks", "tests"]
FORBIDDEN = [
    (re.compile(r"\bimport\s+(c?pickle|dill|shelve|marshal|jsonpickle|cloudpickle)\b"), "a pickle-family module"),
    (
        re.compile(r"\bfrom\s+(c?pickle|dill|shelve|marshal|jsonpickle|cloudpickle)\s+import\b"),
        "a pickle-family module",
    ),
    (re.compile(r"\b(pickle|dill|marshal|cloudpickle)\.loads?\s*\("), "unpickling"),
    (re.compile(r"\btorch\.load\s*\("), "torch.load (unpickles)"),
    (re.compile(r"allow_pickle\s*=\s*True"), "numpy allow_pickle"),
    (re.compile(r"\byaml\.load\s*\((?![^)]*SafeLoader)"), "yaml.load without SafeLoader"),
    (re.compile(r"\b(eval|exec)\s*\(\s*(request|frame|data|payload|msg)"), "eval/exec of received data"),
]


def product_files():
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.resolve() == pathlib.Path(__file__).resolve():
                continue
            yield path


def test_no_code_executing_deserialization():
    hits = []
    for path in product_files():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for pattern, what in FORBIDDEN:
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{lineno}: {what}: {line.strip()}")
    assert not hits, "code-executing deserialization found:\n" + "\n".join(hits)


def test_the_scan_sees_the_product_and_catches_a_planted_call(tmp_path):
    files = list(product_files())
    assert any(p.name == "codec.py" for p in files) and len(files) > 20
    planted = "import pickle\nobj = pickle.loads(data)\nt = torch.load(buf)\n"
    found = {what for line in planted.splitlines() for pattern, what in FORBIDDEN if pattern.search(line)}
    assert found == {"a pickle-family module", "unpickling", "torch.load (unpickles)"}
