"""Every setting the Helm chart passes to the services either equals the setting's default (common/settings.py,
``scheduler_svc/config.py``, ``worker_svc/config.py``) or is listed in ``CHART_DIFFERS`` with the reason it differs.

The chart passes settings as ``--flag=value`` arguments (``helm/mmcast/templates/_containers.tpl`` for the group pod
and the LeaderWorkerSet, ``worker-statefulset.yaml`` for rank pods) and, with the default values, sets no
``MMCAST_*`` variable but the rank's. A default changed in a dataclass therefore either reaches the chart's
``values.yaml`` too or shows up here; a value changed in the chart needs a reason here. An entry whose value no
longer differs fails as well, so the list cannot outlive what it explains.
"""

from __future__ import annotations

import dataclasses

import pytest

from common import settings
from tests.support.deploy_tools import pod_templates, render

# (binary, flag) -> why the chart's value is not the setting's default.
CHART_DIFFERS: dict[tuple[str, str], str] = {
    # Where the processes are: per deployment, no default could hold.
    ("scheduler", "listen"): "the port is scheduler.grpcPort, which the Services, the probes and the NetworkPolicy "
    "name; the chart binds it on every IPv4 interface of the pod (0.0.0.0)",
    ("scheduler", "workers"): "the ranks' addresses in this release (127.0.0.1 in a group pod, DNS names of the rank "
    "pods otherwise); the setting has no default",
    ("scheduler", "model"): "the model volume's mount (model.mountPath, and model.pvc.path)",
    ("scheduler", "scheduler_id"): "<namespace>/<release> (worker.schedulerId), so ranks accept only their own "
    "release's scheduler",
    ("scheduler", "http_port"): "scheduler.http.enabled is on by default: the OpenAI-compatible API is a Service "
    "port of the chart",
    ("scheduler", "worker_token_file"): "the chart's worker-token Secret, mounted (docs/SECURITY.md §3): the ranks "
    "refuse unauthenticated Step streams",
    ("worker", "dist_init"): "rank 0's address in this release and worker.distPort",
    ("worker", "dist_bind_host"): "a group pod's ranks rendezvous on the pod's loopback only",
    ("worker", "model"): "the model volume's mount (model.mountPath, and model.pvc.path)",
    ("worker", "metrics_port"): "ranks are scraped in a cluster (worker.metricsPort 9401, +i for rank i of a group "
    "pod); off by default outside it",
    ("worker", "scheduler_id"): "<namespace>/<release>: a rank accepts only its own release's scheduler",
    ("worker", "shared_token_file"): "the chart's worker-token Secret, mounted (docs/SECURITY.md §3)",
    # Sizes: the chart's default pod is the tiny model on CPU inside a 4Gi rank container (worker.resources).
    ("worker", "kv_blocks"): "512 blocks (8,192 tokens) for the default pod, the tiny model on CPU; a real checkpoint "
    "sets worker.kvBlocks to the memory left after the weights (docs/DEPLOYMENT.md §3)",
    ("worker", "payload_cache_bytes"): "1 GiB keeps a rank inside its 4Gi memory limit (worker.resources) beside "
    "the KV pool, /dev/shm and the model",
    ("worker", "encoder_cache_tokens"): "16,384 rows suit the 4Gi rank container; the default's 65,536 are sized "
    "for a machine of its own",
    ("scheduler", "group_deadline_seconds"): "120 s: a group Kubernetes restarts (the containers, the rendezvous, "
    "the model load) takes longer to return than one serve-local restarts",
}


def _containers(objects: list[dict], command: str) -> list[dict]:
    """Containers that run ``command`` (directly, or through the rank pods' ``sh -c '... exec mmcast-worker'``)."""
    return [
        c
        for obj in objects
        for t in pod_templates(obj)
        for c in t["spec"]["containers"]
        if any(command in part for part in c.get("command", []))
    ]


def _classes() -> dict[str, tuple[type, str]]:
    from scheduler_svc.config import SchedulerConfig
    from worker_svc.config import WorkerConfig

    return {"scheduler": (SchedulerConfig, "mmcast-scheduler"), "worker": (WorkerConfig, "mmcast-worker")}


def _chart_settings(objects: list[dict]) -> dict[tuple[str, str], set]:
    """(binary, field) -> the values the chart's containers of that binary pass, each converted as the binary's own
    parser converts it (choices in their canonical spelling, numbers as numbers)."""
    out: dict[tuple[str, str], set] = {}
    for binary, (cls, command) in _classes().items():
        parser = settings.build_parser(cls, prog=command, description="")
        fields = {settings.flag_of(f): f for f in dataclasses.fields(cls)}
        containers = _containers(objects, command)
        assert containers, f"the chart renders no {command} container"
        for c in containers:
            for arg in c.get("args", []):
                flag, _, text = arg.partition("=")
                assert flag in fields, f"{command} has no flag {flag} (the chart passes {arg!r})"
                if flag == "--rank":  # the rank container's own index, not a setting with a value to compare
                    continue
                value = getattr(parser.parse_args([arg]), fields[flag].name)
                out.setdefault((binary, fields[flag].name), set()).add(
                    tuple(value) if isinstance(value, list) else value
                )
    return out


# The layouts render their containers from different templates: the group pod and the LeaderWorkerSet share
# _containers.tpl, rank pods without LeaderWorkerSet have worker-statefulset.yaml.
LAYOUTS = {"pod": (), "multinode": ("topology=multinode",)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chart_values_equal_the_defaults_or_say_why(layout):
    classes = _classes()
    passed = _chart_settings(render(sets=LAYOUTS[layout]))
    unexplained = []
    for (binary, name), values in sorted(passed.items()):
        (f,) = [f for f in dataclasses.fields(classes[binary][0]) if f.name == name]
        default = settings.default_of(f)
        default = tuple(default) if isinstance(default, list) else default
        if values != {default} and (binary, name) not in CHART_DIFFERS:
            unexplained.append(
                f"{binary} {settings.flag_of(f)}: the chart passes {sorted(map(str, values))}, the "
                f"default is {default!r}"
            )
    assert not unexplained, (
        "The chart sets these settings to something other than their defaults without a reason: change "
        "helm/mmcast/values.yaml to the default, or add the reason to CHART_DIFFERS in "
        "tests/deploy/test_deploy_helm_defaults.py\n" + "\n".join(unexplained)
    )


def test_every_listed_difference_still_differs():
    """An entry of CHART_DIFFERS names a setting some layout passes with a value other than its default."""
    classes = _classes()
    differing = set()
    for sets in LAYOUTS.values():
        for (binary, name), values in _chart_settings(render(sets=sets)).items():
            (f,) = [f for f in dataclasses.fields(classes[binary][0]) if f.name == name]
            default = settings.default_of(f)
            if values != {tuple(default) if isinstance(default, list) else default}:
                differing.add((binary, name))
    stale = sorted(set(CHART_DIFFERS) - differing)
    assert not stale, f"CHART_DIFFERS explains values the chart no longer sets or that equal the default: {stale}"


def test_deployment_doc_lists_the_flags_the_chart_passes():
    """docs/DEPLOYMENT.md §6's "flags passed" row names exactly the flags the default values render, in either
    layout (with its qualifiers in the prose: `--rank` in a group pod, `--dist-bind-host` there too)."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "DEPLOYMENT.md").read_text()
    (row,) = [line for line in doc.splitlines() if line.startswith("| flags passed |")]
    _, scheduler_cell, worker_cell = row.strip().strip("|").split("|")
    listed = {
        "scheduler": set(re.findall(r"--[a-z][a-z-]*", scheduler_cell)),
        "worker": set(re.findall(r"--[a-z][a-z-]*", worker_cell)),
    }
    rendered: dict[str, set] = {"scheduler": set(), "worker": set()}
    for sets in LAYOUTS.values():
        for binary, name in _chart_settings(render(sets=sets)):
            rendered[binary].add("--" + name.replace("_", "-"))
        rendered["worker"] |= {"--rank"}  # rendered in a group pod, but not a setting _chart_settings compares
    for binary in ("scheduler", "worker"):
        assert listed[binary] == rendered[binary], (
            f"docs/DEPLOYMENT.md §6 'flags passed' ({binary}) differs from what the chart renders: "
            f"not listed {sorted(rendered[binary] - listed[binary])}, listed but not rendered "
            f"{sorted(listed[binary] - rendered[binary])}"
        )
