"""The Dockerfile (no docker engine here): hadolint, a non-root user, real entry points, real COPY sources."""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib

from tests.support.deploy_tools import ROOT, run, tool

DOCKERFILE = ROOT / "Dockerfile"
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "4294967296",
    "MALLOC_TRIM_THRESHOLD_": "4294967296",
    "MALLOC_TOP_PAD_": "67108864",
}


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue
        current += " " + stripped.removesuffix("\\") if current else stripped.removesuffix("\\")
        if not stripped.endswith("\\"):
            word, _, rest = current.partition(" ")
            out.append((word.upper(), rest.strip()))
            current = ""
    return out


def _stages() -> list[list[tuple[str, str]]]:
    stages = []
    for ins in _instructions():
        if ins[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


def _env(args: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in shlex.split(args))


def _pyproject(folder: str = ".") -> dict:
    return tomllib.loads((ROOT / folder / "pyproject.toml").read_text())


def _project(folder: str = ".") -> dict:
    """The [project] table of the server distribution (the root) or of the client's (folder "client")."""
    return _pyproject(folder)["project"]


def test_hadolint():
    run([tool("hadolint"), "--failure-threshold", "warning", str(DOCKERFILE)])


def test_multi_stage_builds_the_wheel_and_installs_it():
    builder, runtime = _stages()
    assert "AS builder" in builder[0][1]
    wheel_builds = [shlex.split(a) for i, a in builder if i == "RUN" and "pip wheel" in a]
    assert len(wheel_builds) == 1 and {"./client", "."} <= set(wheel_builds[0]), "both distributions' wheels"
    assert runtime[0][1].startswith("${BASE_IMAGE}")
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for i, a in _instructions() if i == "ARG" and "=" in a}
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    run_lines = " ".join(a for i, a in runtime if i == "RUN")
    # one pip call installs both wheels, so the server's mmcast-client requirement is met by the wheel beside it
    assert re.search(r"pip install [^&]*/tmp/wheels/mmcast_client-\*\.whl /tmp/wheels/mmcast-\*\.whl", run_lines)
    serve_torch = [d for d in _project()["dependencies"] if d.startswith("torch")]
    assert serve_torch == ["torch==2.13.0"] and '"torch==2.13.0"' in run_lines
    # the server and the client are released together: same version, and the server pins the client to it
    assert _project()["version"] == _project("client")["version"]
    assert f"mmcast-client=={_project()['version']}" in _project()["dependencies"]
    assert any(i == "COPY" and a.startswith("--from=builder") for i, a in runtime)


def test_runs_as_non_root():
    runtime = _stages()[-1]
    users = [a for i, a in runtime if i == "USER"]
    assert users, "the runtime stage must set USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"} and user.isdigit() and int(user) >= 1000, (
        "numeric non-root uid, so Kubernetes' runAsNonRoot can verify it"
    )
    assert any("useradd" in a and f"--uid {user}" in a for i, a in runtime if i == "RUN")


def test_allocator_environment():
    env = {}
    for i, a in _stages()[-1]:
        if i == "ENV":
            env.update(_env(a))
    for key, value in MALLOC_ENV.items():
        assert env.get(key) == value, key


def test_entry_points_exist_in_pyproject():
    scripts = _project()["scripts"] | _project("client")["scripts"]
    assert {"mmcast", "mmcast-scheduler", "mmcast-worker"} <= scripts.keys()
    runtime = _stages()[-1]
    entrypoint = [a for i, a in runtime if i == "ENTRYPOINT"]
    cmd = [a for i, a in runtime if i == "CMD"]
    assert entrypoint == ["[]"], "the command names the role; no wrapper"
    (cmd_args,) = cmd
    executable = re.findall(r'"([^"]+)"', cmd_args)[0]
    assert executable in scripts


def _dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern that matches a parent folder matches the path."""
    patterns = [
        p.strip()
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.strip().startswith("#")
    ]
    excluded = False
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        if any(
            fnmatch.fnmatch(c, pat) or (pat.startswith("**/") and fnmatch.fnmatch(c.split("/")[-1], pat[3:]))
            for c in candidates
        ):
            excluded = not negate
    return excluded


def test_copy_sources_exist_and_reach_the_build():
    for instruction, args in _instructions():
        if instruction not in ("COPY", "ADD") or "--from=" in args:
            continue
        *sources, _dest = [a for a in shlex.split(args) if not a.startswith("--")]
        for source in sources:
            assert (ROOT / source).exists(), f"COPY source {source} does not exist"
    # `COPY . .` sends what .dockerignore keeps: both pyproject files and every package of both wheels (the client's
    # folders are links into the repository root, whose targets must travel too).
    for folder in (".", "client"):
        assert not _dockerignore_excludes(f"{folder}/pyproject.toml".removeprefix("./")), folder
        includes = _pyproject(folder)["tool"]["setuptools"]["packages"]["find"]["include"]
        top = [i for i in includes if "*" not in i and "." not in i]
        assert top, folder
        for pkg in top:
            path = ROOT / folder / pkg
            assert path.is_dir(), f"{folder}: no package folder {pkg}"
            for name in {f"{folder}/{pkg}/main.py".removeprefix("./"), f"{path.resolve().relative_to(ROOT)}/main.py"}:
                assert not _dockerignore_excludes(name), f".dockerignore drops {name}"
    for heavy in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/deploy/test_deploy_dockerfile.py",
        ".tools/bin/helm",
        "mmcast/__pycache__/x.pyc",
    ):
        assert _dockerignore_excludes(heavy), f"{heavy} would be sent to the docker build"
