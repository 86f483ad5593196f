"""The chart's security values: Secrets mounted read-only, the services' flags pointing at them, probes moved to
the plaintext health ports while the gRPC ports speak TLS, and arguments the services accept."""

from __future__ import annotations

import json

from tests.support.deploy_tools import (
    CHART,
    KUBE_VERSION,
    container,
    find,
    flags,
    helm_template_args,
    pod_spec,
    render,
    run,
    tool,
)

SECURE = CHART / "ci" / "secure-values.yaml"
SECRETS = {
    "client-tls": "mmcast-client-tls",
    "auth-tokens": "mmcast-tokens",
    "worker-tls": "mmcast-worker-tls",
    "worker-token": "mmcast-worker-token",
}  # volume -> the Secret secure-values.yaml names


MULTINODE = ("topology=multinode",)  # a scheduler Deployment and a rank StatefulSet: one pod per process


def _objects():
    return render((SECURE,), MULTINODE)


def test_secure_values_lint_and_validate(tmp_path):
    run([tool("helm"), "lint", str(CHART), "--strict", "-f", str(SECURE)])
    import yaml

    manifest = tmp_path / "secure.yaml"
    manifest.write_text(yaml.safe_dump_all(_objects() + render((SECURE,))))
    proc = run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", KUBE_VERSION, str(manifest)], check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_secrets_are_mounted_read_only_and_passed_as_files():
    objects = _objects()
    deploy, sts = find(objects, "Deployment", "-scheduler"), find(objects, "StatefulSet", "-worker")
    scheduler, worker = container(deploy, "scheduler"), container(sts, "worker")
    s, w = flags(scheduler), flags(worker)
    assert s["tls-cert-file"] == "/etc/mmcast/client-tls/tls.crt" and s["tls-key-file"].endswith("/tls.key")
    assert s["tls-client-ca-file"] == "/etc/mmcast/client-tls/ca.crt"
    assert s["auth-tokens-file"] == "/etc/mmcast/auth-tokens/tokens"
    assert s["worker-tls-ca-file"] == "/etc/mmcast/worker-tls/ca.crt" and s["worker-tls-cert-file"].endswith("tls.crt")
    assert s["worker-token-file"] == "/etc/mmcast/worker-token/token"
    assert w["tls-client-ca-file"] == "/etc/mmcast/worker-tls/ca.crt"
    assert w["shared-token-file"] == "/etc/mmcast/worker-token/token"
    for obj, c, names in (
        (deploy, scheduler, {"client-tls", "auth-tokens", "worker-tls", "worker-token"}),
        (sts, worker, {"worker-tls", "worker-token"}),
    ):
        mounts = {m["name"]: m for m in c["volumeMounts"] if m["mountPath"].startswith("/etc/mmcast/")}
        assert set(mounts) == names and all(m["readOnly"] for m in mounts.values())
        volumes = {v["name"]: v["secret"] for v in pod_spec(obj)["volumes"] if v["name"] in names}
        assert {n: v["secretName"] for n, v in volumes.items()} == {n: SECRETS[n] for n in names}
    # No secret value ever appears in the pod specs: only Secret names and file paths.
    assert "BEGIN" not in json.dumps(objects)


def test_probes_use_the_plaintext_health_ports():
    objects = _objects()
    for kind, name, port, health in (
        ("Deployment", "scheduler", 50051, 50052),
        ("StatefulSet", "worker", 50061, 50062),
    ):
        c = container(find(objects, kind, f"-{name}"), name)
        assert flags(c)["health-port"] == str(health)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["health"] == health and ports["grpc"] == port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == health, (name, probe)
    # Without TLS nothing changes: probes on the gRPC ports, no TLS flags; only the created worker token is mounted.
    plain = render(sets=MULTINODE)
    c = container(find(plain, "Deployment", "-scheduler"), "scheduler")
    assert c["readinessProbe"]["grpc"]["port"] == 50051
    assert [k for k in flags(c) if k.startswith(("tls-", "auth-", "worker-t", "health"))] == ["worker-token-file"]


def test_services_accept_the_secure_arguments(tmp_path):
    """The rendered flags through the services' own parsers, with the mounted files stood in for by real ones."""
    from scheduler_svc.main import config_from
    from worker_svc.config import load_config

    objects = _objects()
    for folder, names in (
        ("client-tls", ("tls.crt", "tls.key", "ca.crt")),
        ("auth-tokens", ("tokens",)),
        ("worker-tls", ("tls.crt", "tls.key", "ca.crt")),
        ("worker-token", ("token",)),
    ):
        (tmp_path / folder).mkdir()
        for name in names:
            (tmp_path / folder / name).write_text("stand-in\n")

    def local(args):
        return [a.replace("/etc/mmcast", str(tmp_path)) for a in args]

    sconf = config_from(local(container(find(objects, "Deployment", "-scheduler"), "scheduler")["args"]), environ={})
    assert sconf.tls_client_ca_file.endswith("client-tls/ca.crt") and sconf.health_port == 50052
    worker = container(find(objects, "StatefulSet", "-worker"), "worker")
    wconf = load_config(local(worker["args"]) + ["--rank", "0"], environ={})
    assert wconf.shared_token_file.endswith("worker-token/token") and wconf.health_port == 50062


def _token_objects(*sets):
    objects = render((), sets + MULTINODE)
    sched = flags(container(find(objects, "Deployment", "-scheduler"), "scheduler"))
    worker = flags(container(find(objects, "StatefulSet", "-worker"), "worker"))
    secrets = [o for o in objects if o["kind"] == "Secret"]
    return objects, sched, worker, secrets


def test_the_default_creates_a_worker_token_secret_and_wires_it_into_both():
    import base64

    objects, sched, worker, secrets = _token_objects()
    assert [s["metadata"]["name"] for s in secrets] == ["demo-mmcast-worker-token"]
    token = base64.b64decode(secrets[0]["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    assert sched["worker-token-file"] == worker["shared-token-file"] == "/etc/mmcast/worker-token/token"
    for kind, name in (("Deployment", "scheduler"), ("StatefulSet", "worker")):
        volumes = {v["name"]: v for v in pod_spec(find(objects, kind, f"-{name}"))["volumes"]}
        assert volumes["worker-token"]["secret"]["secretName"] == "demo-mmcast-worker-token"
    assert "insecure-allow-unauthenticated" not in worker
    # Offline there is no Secret to read back (lookup is empty): every render draws a new token (docs/SECURITY.md).
    import yaml

    rendered = yaml.safe_load_all(run(helm_template_args(sets=MULTINODE)).stdout)
    again = [o for o in rendered if o and o["kind"] == "Secret"][0]
    assert base64.b64decode(again["data"]["token"]).decode() != token


def test_an_existing_worker_token_secret_is_used_and_none_is_created():
    objects, sched, worker, secrets = _token_objects(
        "security.workerToken.secretName=mine", "security.workerToken.key=t"
    )
    assert secrets == []
    assert sched["worker-token-file"] == worker["shared-token-file"] == "/etc/mmcast/worker-token/t"
    volumes = {v["name"]: v for v in pod_spec(find(objects, "StatefulSet", "-worker"))["volumes"]}
    assert volumes["worker-token"]["secret"]["secretName"] == "mine"


def test_without_a_token_the_ranks_need_mutual_tls_or_an_explicit_insecure():
    _, _, worker, secrets = _token_objects("security.workerToken.create=false", "security.workerTLS.secretName=wtls")
    assert secrets == [] and worker["tls-client-ca-file"] and "insecure-allow-unauthenticated" not in worker
    _, sched, worker, secrets = _token_objects("security.workerToken.create=false", "security.insecure=true")
    assert secrets == [] and "worker-token-file" not in sched and "shared-token-file" not in worker
    assert worker["insecure-allow-unauthenticated"] == "true"
    proc = run(helm_template_args(sets=("security.workerToken.create=false",) + MULTINODE), check=False)
    assert proc.returncode != 0 and "security.insecure=true" in proc.stderr
    proc = run(helm_template_args(sets=("security.workerToken.create=false",)), check=False)
    assert proc.returncode != 0 and "security.insecure=true" in proc.stderr


def test_group_pod_wires_the_secrets_into_every_container():
    """topology: pod: the scheduler container gets the client-side Secrets, every rank container its TLS and the
    token; each rank's plaintext health port is its own (health port + rank), and the scheduler verifies the
    configured name in the ranks' certificates, since it reaches them at 127.0.0.1."""
    objects = render((SECURE,))
    group = find(objects, "StatefulSet", "-group")
    spec = pod_spec(group)
    scheduler = container(group, "scheduler")
    s = flags(scheduler)
    assert s["worker-tls-server-name"] == "mmcast-worker" and s["workers"] == "127.0.0.1:50061"
    assert s["worker-token-file"] == "/etc/mmcast/worker-token/token"
    assert {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v} == SECRETS
    tp = render((SECURE,), ("tensorParallelSize=2",))
    group = find(tp, "StatefulSet", "-group")
    for rank in range(2):
        c = container(group, f"rank-{rank}")
        w = flags(c)
        assert w["shared-token-file"] == "/etc/mmcast/worker-token/token"
        assert w["tls-client-ca-file"] == "/etc/mmcast/worker-tls/ca.crt"
        assert w["health-port"] == str(50062 + rank)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == 50062 + rank
        mounts = {m["name"] for m in c["volumeMounts"] if m["mountPath"].startswith("/etc/mmcast/")}
        assert mounts == {"worker-tls", "worker-token"}, "a rank never mounts the client-side Secrets"
    # Without a server name the scheduler could verify nothing at 127.0.0.1: the chart refuses, naming the value.
    proc = run(helm_template_args((str(SECURE),), ("security.workerTLS.serverName=",)), check=False)
    assert proc.returncode != 0 and "security.workerTLS.serverName" in proc.stderr
