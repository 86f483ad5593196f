"""The chart's security values: Secrets mounted read-only, the services' flags pointing at them, probes moved to
the plaintext health ports while the gRPC ports speak TLS, and arguments the services accept."""

from __future__ import annotations

import json

from tests.deploy.deploy_tools import CHART, KUBE_VERSION, container, find, flags, pod_spec, render, run, tool

SECURE = CHART / "ci" / "secure-values.yaml"
SECRETS = {"client-tls": "mmcast-client-tls", "auth-tokens": "mmcast-tokens", "worker-tls": "mmcast-worker-tls",
           "worker-token": "mmcast-worker-token"}  # volume -> the Secret secure-values.yaml names


def _objects():
    return render((SECURE,))


def test_secure_values_lint_and_validate(tmp_path):
    run([tool("helm"), "lint", str(CHART), "--strict", "-f", str(SECURE)])
    import yaml

    manifest = tmp_path / "secure.yaml"
    manifest.write_text(yaml.safe_dump_all(_objects()))
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
    for obj, c, names in ((deploy, scheduler, {"client-tls", "auth-tokens", "worker-tls", "worker-token"}),
                          (sts, worker, {"worker-tls", "worker-token"})):
        mounts = {m["name"]: m for m in c["volumeMounts"] if m["mountPath"].startswith("/etc/mmcast/")}
        assert set(mounts) == names and all(m["readOnly"] for m in mounts.values())
        volumes = {v["name"]: v["secret"] for v in pod_spec(obj)["volumes"] if v["name"] in names}
        assert {n: v["secretName"] for n, v in volumes.items()} == {n: SECRETS[n] for n in names}
    # No secret value ever appears in the pod specs: only Secret names and file paths.
    assert "BEGIN" not in json.dumps(objects)


def test_probes_use_the_plaintext_health_ports():
    objects = _objects()
    for kind, name, port, health in (("Deployment", "scheduler", 50051, 50052), ("StatefulSet", "worker", 50061, 50062)):
        c = container(find(objects, kind, f"-{name}"), name)
        assert flags(c)["health-port"] == str(health)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["health"] == health and ports["grpc"] == port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == health, (name, probe)
    # Without TLS nothing changes: probes on the gRPC ports, no security flags, no secret volumes.
    plain = render()
    c = container(find(plain, "Deployment", "-scheduler"), "scheduler")
    assert c["readinessProbe"]["grpc"]["port"] == 50051
    assert not any(k.startswith(("tls-", "auth-", "worker-t", "health")) for k in flags(c))


def test_services_accept_the_secure_arguments(tmp_path):
    """The rendered flags through the services' own parsers, with the mounted files stood in for by real ones."""
    from scheduler_svc.main import config_from
    from worker_svc.config import load_config

    objects = _objects()
    for folder, names in (("client-tls", ("tls.crt", "tls.key", "ca.crt")), ("auth-tokens", ("tokens",)),
                          ("worker-tls", ("tls.crt", "tls.key", "ca.crt")), ("worker-token", ("token",))):
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
