"""Paths and tool runners shared by the deployment tests (helm, promtool, kubernetes-validate, hadolint).

The tools come from `scripts/install-tools.sh` (`make tools`). A missing tool fails the test that needs it, with the
command that installs it: the checks are part of CI and must not be skipped silently.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "mmcast"
CI_VALUES = CHART / "ci"
TEST_VALUES = ROOT / "tests" / "deploy" / "values"
SCHEMAS = ROOT / "tests" / "deploy" / "schemas"
RULES_FILE = CHART / "rules" / "mmcast-rules.yaml"
RULES_TEST_FILE = ROOT / "tests" / "deploy" / "rules" / "mmcast-rules.test.yaml"
DASHBOARD_FILE = CHART / "dashboards" / "mmcast.json"

KUBE_VERSION = "1.30.0"  # what the rendered objects are validated against
MONITORING_API = "monitoring.coreos.com/v1"
LWS_API = "leaderworkerset.x-k8s.io/v1"
# Labels the LeaderWorkerSet controller adds to every pod it creates (not in the chart's templates).
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
RELEASE = "demo"
NAMESPACE = "ml"

_SEARCH = (ROOT / ".tools" / "bin", ROOT / ".venv" / "bin")


def tool(name: str) -> str:
    """Absolute path of an installed tool, or a test failure naming the install command."""
    for folder in _SEARCH:
        candidate = folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    pytest.fail(
        f"{name} is not installed (looked in .tools/bin, .venv/bin, PATH): run `bash scripts/install-tools.sh` "
        "or `make tools`",
        pytrace=False,
    )


def run(
    args: list[str], *, check: bool = True, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}", pytrace=False
        )
    return proc


def helm_template_args(
    values: tuple[str, ...] = (),
    sets: tuple[str, ...] = (),
    api_versions: tuple[str, ...] = (),
    kube_version: str = KUBE_VERSION,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> list[str]:
    args = [tool("helm"), "template", release, str(CHART), "--namespace", namespace, "--kube-version", kube_version]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    for api in api_versions:
        args += ["--api-versions", api]
    return args


@functools.cache
def _render_text(
    values: tuple[str, ...], sets: tuple[str, ...], api_versions: tuple[str, ...], kube_version: str, release: str
) -> str:
    return run(helm_template_args(values, sets, api_versions, kube_version, release)).stdout


def render(
    values: tuple[str, ...] = (),
    sets: tuple[str, ...] = (),
    api_versions: tuple[str, ...] = (),
    kube_version: str = KUBE_VERSION,
    release: str = RELEASE,
) -> list[dict]:
    """Objects `helm template` renders (fresh dicts on every call: callers may change them)."""
    text = _render_text(tuple(str(v) for v in values), tuple(sets), tuple(api_versions), kube_version, release)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render_text(
    values: tuple[str, ...] = (),
    sets: tuple[str, ...] = (),
    api_versions: tuple[str, ...] = (),
    kube_version: str = KUBE_VERSION,
    release: str = RELEASE,
) -> str:
    return _render_text(tuple(str(v) for v in values), tuple(sets), tuple(api_versions), kube_version, release)


def find(objects: list[dict], kind: str, name_suffix: str = "") -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(matches) == 1, (
        f"expected one {kind} named *{name_suffix}, found {[o['metadata']['name'] for o in matches]}"
    )
    return matches[0]


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def pod_templates(obj: dict) -> list[dict]:
    """The pod templates of a workload: one for a Deployment or StatefulSet, leader and worker for a LeaderWorkerSet."""
    if obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"], lwt["workerTemplate"]]
    if obj["kind"] in ("Deployment", "StatefulSet"):
        return [obj["spec"]["template"]]
    return []


def container(obj: dict, name: str) -> dict:
    found = [c for c in pod_spec(obj)["containers"] if c["name"] == name]
    assert found, f"{obj['kind']}/{obj['metadata']['name']} has no container {name}"
    return found[0]


def flags(c: dict) -> dict[str, str]:
    """`--name=value` arguments of a container as {name: value}."""
    out = {}
    for arg in c.get("args", []):
        assert arg.startswith("--") and "=" in arg, f"argument {arg!r} is not --flag=value"
        key, value = arg[2:].split("=", 1)
        out[key] = value
    return out


def env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())
