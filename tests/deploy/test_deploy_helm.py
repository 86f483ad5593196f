"""The Helm chart renders, lints and validates offline, and keeps the contract the services rely on."""

from __future__ import annotations

import json
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.support.deploy_tools import (
    CHART,
    CI_VALUES,
    DASHBOARD_FILE,
    KUBE_VERSION,
    LWS_API,
    MONITORING_API,
    NAMESPACE,
    RELEASE,
    RULES_FILE,
    SCHEMAS,
    TEST_VALUES,
    container,
    env,
    find,
    flags,
    pod_spec,
    pod_templates,
    render,
    run,
    tool,
)

MULTINODE = CI_VALUES / "multinode-values.yaml"
HTTP_READINESS_TLS = TEST_VALUES / "http-readiness-tls.yaml"
# name -> (values files, extra --api-versions, --set values). `topology: pod` is the default; the multinode sets
# render one pod per rank, as a LeaderWorkerSet where its API is served, else as a Deployment + StatefulSet.
VALUE_SETS = {
    "defaults": ((), (), ()),
    "cpu-tiny": ((CI_VALUES / "cpu-tiny-values.yaml",), (), ()),
    "gpu-tp4": ((CI_VALUES / "gpu-tp4-values.yaml",), (), ()),
    "monitoring": ((CI_VALUES / "monitoring-values.yaml",), (MONITORING_API,), ()),
    "pod-replicas": ((CI_VALUES / "cpu-tiny-values.yaml",), (), ("replicaCount=3",)),
    "scale-out": ((CI_VALUES / "scale-out-values.yaml",), (), ()),
    "multinode": ((MULTINODE,), (), ()),
    "multinode-lws": ((MULTINODE,), (LWS_API,), ("replicaCount=3",)),
    "cpu-tiny-multinode": ((CI_VALUES / "cpu-tiny-values.yaml",), (), ("topology=multinode",)),
    # The OpenAI-compatible HTTP API is on by default; gRPC only, and the HTTP readiness probe over HTTPS.
    "http-off": ((), (), ("scheduler.http.enabled=false",)),
    "http-readiness-tls": ((HTTP_READINESS_TLS,), (), ()),
    "http-readiness-tls-multinode": ((HTTP_READINESS_TLS,), (), ("topology=multinode",)),
    # The Gateway API Inference Extension's InferencePool and its endpoint picker (off by default).
    "inference-pool": ((CI_VALUES / "scale-out-values.yaml",), (), ("inferencePool.enabled=true",)),
}
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SCHEMAS / "servicemonitor.monitoring.coreos.com-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): SCHEMAS / "prometheusrule.monitoring.coreos.com-v1.json",
    (LWS_API, "LeaderWorkerSet"): SCHEMAS / "leaderworkerset.x-k8s.io-v1.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): SCHEMAS / "inferencepool.inference.networking.k8s.io-v1.json",
}
# The workload kinds of each layout.
LAYOUT_KINDS = {"pod": {"StatefulSet"}, "statefulset": {"Deployment", "StatefulSet"}, "lws": {"LeaderWorkerSet"}}
INFERENCE_POOL_KINDS = {"InferencePool", "Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"}
WORKER_FLAGS = {
    "world-size",
    "listen",
    "dist-init",
    "model",
    "device",
    "dtype",
    "kv-blocks",
    "metrics-port",
    "payload-cache-bytes",
    "encoder-cache-tokens",
    "scheduler-id",
    "log-level",
}
SCHEDULER_FLAGS = {
    "listen",
    "metrics-port",
    "workers",
    "model",
    "transfer-mode",
    "max-num-batched-tokens",
    "max-num-seqs",
    "max-waiting",
    "max-images-per-request",
    "max-image-pixels",
    "max-request-bytes",
    "chunk-size-bytes",
    "group-deadline-seconds",
    "drain-seconds",
    "scheduler-id",
    "log-level",
}


def _render_set(name: str, **kwargs) -> list[dict]:
    values, apis, sets = VALUE_SETS[name]
    return render(values, sets=sets + tuple(kwargs.pop("sets", ())), api_versions=apis, **kwargs)


def _layout(name: str) -> str:
    values, apis, sets = VALUE_SETS[name]
    multinode = MULTINODE in values or "topology=multinode" in sets
    return ("lws" if LWS_API in apis else "statefulset") if multinode else "pod"


def _pod_object(obj: dict, template: dict) -> dict:
    """A pod template as a Pod, for kubernetes-validate (a LeaderWorkerSet's templates are not checked otherwise)."""
    name = f"{obj['metadata']['name']}-{template['metadata']['labels']['app.kubernetes.io/component']}"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template["metadata"], "name": name},
        "spec": template["spec"],
    }


@pytest.mark.parametrize("name", [n for n, (_, apis, _) in VALUE_SETS.items() if LWS_API not in apis])
def test_helm_lint(name):
    values, _, sets = VALUE_SETS[name]
    args = [tool("helm"), "lint", str(CHART), "--strict", "--namespace", NAMESPACE]
    for v in values:
        args += ["-f", str(v)]
    for v in sets:
        args += ["--set", v]
    run(args)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_objects_validate(name, tmp_path):
    """Core objects against Kubernetes' own schemas (strict), CRD objects against the subset schemas kept here."""
    objects = _render_set(name)
    core = []
    for obj in objects:
        key = (obj["apiVersion"], obj["kind"])
        if key in CRD_SCHEMAS:
            schema = json.loads(CRD_SCHEMAS[key].read_text())
            jsonschema.validate(obj, schema)
            # A CRD's pod templates are core PodSpecs: checked strictly as Pods.
            core += [_pod_object(obj, t) for t in pod_templates(obj)]
        else:
            core.append(obj)
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(core))
    proc = run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", KUBE_VERSION, str(manifest)], check=False)
    assert proc.returncode == 0, f"kubernetes-validate failed for {name}:\n{proc.stdout}\n{proc.stderr}"
    kinds = {o["kind"] for o in objects}
    assert {"Service", "ConfigMap", "ServiceAccount", "NetworkPolicy", "PodDisruptionBudget"} <= kinds, kinds
    workloads = kinds & {"Deployment", "StatefulSet", "LeaderWorkerSet"}
    if name == "inference-pool":  # the endpoint picker's Deployment beside the layout's workloads
        assert INFERENCE_POOL_KINDS <= kinds, kinds
        workloads -= {"Deployment"}
    else:
        assert "InferencePool" not in kinds, name
    assert workloads == LAYOUT_KINDS[_layout(name)], (name, workloads)


def test_monitoring_objects_need_the_api_version():
    values, _, _ = VALUE_SETS["monitoring"]
    without = {o["kind"] for o in render(values)}
    assert "ServiceMonitor" not in without and "PrometheusRule" not in without
    with_api = {o["kind"] for o in render(values, api_versions=(MONITORING_API,))}
    assert {"ServiceMonitor", "PrometheusRule", "PodDisruptionBudget"} <= with_api
    # Enabled only by the API, never by default.
    assert "ServiceMonitor" not in {o["kind"] for o in render(api_versions=(MONITORING_API,))}


@pytest.mark.parametrize("path", sorted(TEST_VALUES.glob("invalid-*.yaml")), ids=lambda p: p.stem)
def test_invalid_values_make_helm_fail(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} must start with '# expect: <error text>'"
    expected = first.removeprefix("# expect: ")
    proc = run([tool("helm"), "template", RELEASE, str(CHART), "-f", str(path)], check=False)
    assert proc.returncode != 0, f"helm accepted {path.name}"
    assert expected in proc.stderr, proc.stderr


def test_schema_ships_in_the_package(tmp_path):
    run([tool("helm"), "package", str(CHART), "--destination", str(tmp_path)])
    (package,) = tmp_path.glob("mmcast-*.tgz")
    with tarfile.open(package) as tar:
        names = set(tar.getnames())
    assert {"mmcast/values.schema.json", "mmcast/dashboards/mmcast.json", "mmcast/rules/mmcast-rules.yaml"} <= names


@pytest.mark.parametrize("name", ["defaults", "cpu-tiny"])
def test_worker_group_contract(name):
    """topology: multinode without LeaderWorkerSet: a rank StatefulSet behind a headless Service, a scheduler Deployment."""
    objects = _render_set(name, sets=("topology=multinode",))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for v in VALUE_SETS[name][0]:
        _merge(values, yaml.safe_load(Path(v).read_text()))
    tp = values["tensorParallelSize"]
    sts = find(objects, "StatefulSet", "-worker")
    headless = find(objects, "Service", "-worker")
    sts_name, svc_name = sts["metadata"]["name"], headless["metadata"]["name"]
    assert sts["spec"]["replicas"] == tp
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["serviceName"] == svc_name
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert {p["name"]: p["port"] for p in headless["spec"]["ports"]} == {"grpc": 50061, "metrics": 9401, "dist": 29500}

    worker = container(sts, "worker")
    args = flags(worker)
    assert WORKER_FLAGS <= set(args), WORKER_FLAGS - set(args)
    assert args["world-size"] == str(tp)
    assert args["listen"] == "0.0.0.0:50061"
    assert args["metrics-port"] == "9401"
    fqdn = f"{svc_name}.{NAMESPACE}.svc.cluster.local"
    assert args["dist-init"] == f"tcp://{sts_name}-0.{fqdn}:29500"
    # Rank = pod ordinal, from the pod-index label (Kubernetes >= 1.28).
    rank = env(worker)["MMCAST_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert rank == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert worker["command"] == ["mmcast-worker"]

    scheduler = container(find(objects, "Deployment", "-scheduler"), "scheduler")
    sargs = flags(scheduler)
    assert sargs["workers"] == ",".join(f"{sts_name}-{r}.{fqdn}:50061" for r in range(tp))
    assert sargs["model"] == args["model"]
    # The ranks accept only the scheduler that announces the same id.
    assert sargs["scheduler-id"] == args["scheduler-id"] == f"{NAMESPACE}/{RELEASE}"
    assert sargs["log-level"] == "INFO" and args["log-level"] == "info"


def test_rank_from_hostname_before_pod_index_label():
    objects = render(sets=("topology=multinode",), kube_version="1.27.0")
    worker = container(find(objects, "StatefulSet", "-worker"), "worker")
    assert "MMCAST_RANK" not in env(worker)
    assert worker["command"][:2] == ["/bin/sh", "-c"]
    script = worker["command"][2]
    assert 'MMCAST_RANK="${POD_NAME##*-}"' in script and 'exec mmcast-worker "$@"' in script
    assert env(worker)["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_scheduler_contract():
    objects = render(sets=("topology=multinode",))
    deploy = find(objects, "Deployment", "-scheduler")
    svc = find(objects, "Service", "-scheduler")
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 50051, "http": 8000, "metrics": 9400}
    c = container(deploy, "scheduler")
    args = flags(c)
    assert SCHEDULER_FLAGS <= set(args), SCHEDULER_FLAGS - set(args)
    assert args["listen"] == "0.0.0.0:50051" and args["metrics-port"] == "9400" and args["http-port"] == "8000"
    assert args["transfer-mode"] == "lazy"
    assert c["command"] == ["mmcast-scheduler"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "metrics": 9400, "http": 8000}
    assert pod_spec(deploy)["terminationGracePeriodSeconds"] > int(args["drain-seconds"])


@pytest.mark.parametrize(
    "component,service", [("scheduler", "mmcast.v1.GenerationService"), ("worker", "mmcast.v1.WorkerService")]
)
def test_grpc_health_probes(component, service):
    objects = render(sets=("topology=multinode",))
    kind = "Deployment" if component == "scheduler" else "StatefulSet"
    c = container(find(objects, kind, f"-{component}"), component)
    port = 50051 if component == "scheduler" else 50061
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == port, probe
    assert c["readinessProbe"]["grpc"]["service"] == service
    assert c["livenessProbe"]["grpc"]["service"] == ""
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "startup must cover a model load"


# The layouts the HTTP API is checked in: (--set values, --api-versions, the workload holding the scheduler).
HTTP_LAYOUTS = {
    "pod": ((), (), ("StatefulSet", "-group")),
    "statefulset": (("topology=multinode",), (), ("Deployment", "-scheduler")),
    "lws": (("topology=multinode",), (LWS_API,), ("LeaderWorkerSet", "-group")),
}


def _http_render(layout: str, *sets: str) -> tuple[list[dict], dict]:
    """Objects of a layout and its scheduler container."""
    base, apis, (kind, suffix) = HTTP_LAYOUTS[layout]
    objects = render(sets=base + sets, api_versions=apis)
    (scheduler,) = [
        c
        for t in pod_templates(find(objects, kind, suffix))
        for c in t["spec"]["containers"]
        if c["name"] == "scheduler"
    ]
    return objects, scheduler


def _client_rule(objects: list[dict]) -> dict:
    """The ingress rule of the scheduler pods' NetworkPolicy that admits the gRPC client port."""
    (rule,) = [
        r
        for o in objects
        if o["kind"] == "NetworkPolicy"
        for r in o["spec"]["ingress"]
        if 50051 in {p["port"] for p in r.get("ports", [])}
    ]
    return rule


@pytest.mark.parametrize("layout", HTTP_LAYOUTS)
def test_http_api_is_served_exposed_and_admitted_by_default(layout):
    objects, scheduler = _http_render(layout)
    assert flags(scheduler)["http-port"] == "8000"
    ports = {p["name"]: p for p in scheduler["ports"]}
    assert ports["http"]["containerPort"] == 8000 and ports["http"]["protocol"] == "TCP"
    svc = find(objects, "Service", "-scheduler")
    http = {p["name"]: p for p in svc["spec"]["ports"]}["http"]
    assert http == {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}
    # Admitted from the same peers as the gRPC client port: the same rule.
    assert {p["port"] for p in _client_rule(objects)["ports"]} == {50051, 8000}
    narrowed, _ = _http_render(layout, "networkPolicy.client.from[0].podSelector.matchLabels.app=gw")
    rule = _client_rule(narrowed)
    assert {p["port"] for p in rule["ports"]} == {50051, 8000}
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app": "gw"}}}]
    # Readiness stays the gRPC health check unless asked otherwise.
    assert "grpc" in scheduler["readinessProbe"] and "httpGet" not in scheduler["readinessProbe"]


@pytest.mark.parametrize("layout", HTTP_LAYOUTS)
def test_http_api_can_be_turned_off(layout):
    objects, scheduler = _http_render(layout, "scheduler.http.enabled=false")
    assert "http-port" not in flags(scheduler)
    assert "http" not in {p["name"] for p in scheduler["ports"]}
    assert "http" not in {p["name"] for p in find(objects, "Service", "-scheduler")["spec"]["ports"]}
    assert {p["port"] for p in _client_rule(objects)["ports"]} == {50051}
    assert 8000 not in {
        p["port"]
        for o in objects
        if o["kind"] == "NetworkPolicy"
        for r in o["spec"]["ingress"]
        for p in r.get("ports", [])
    }


def test_http_ports_follow_their_values():
    objects, scheduler = _http_render(
        "pod", "scheduler.http.port=8080", "scheduler.service.httpPort=80", "scheduler.service.type=LoadBalancer"
    )
    assert flags(scheduler)["http-port"] == "8080"
    assert {p["name"]: p["containerPort"] for p in scheduler["ports"]}["http"] == 8080
    http = {p["name"]: p for p in find(objects, "Service", "-scheduler")["spec"]["ports"]}["http"]
    assert (http["port"], http["targetPort"]) == (80, "http")
    assert {p["port"] for p in _client_rule(objects)["ports"]} == {50051, 8080}


def test_servicemonitor_ignores_the_http_port():
    values, apis, _ = VALUE_SETS["monitoring"]
    on, off = (
        find(render(values, sets=sets, api_versions=apis), "ServiceMonitor")
        for sets in ((), ("scheduler.http.enabled=false",))
    )
    assert on == off
    assert "http" not in {e["port"] for e in on["spec"]["endpoints"]}


@pytest.mark.parametrize("layout", HTTP_LAYOUTS)
def test_http_readiness_probe(layout):
    _, scheduler = _http_render(
        layout, "scheduler.probes.readiness.kind=http", "scheduler.probes.readiness.periodSeconds=7"
    )
    ready = scheduler["readinessProbe"]
    assert ready == {
        "httpGet": {"path": "/health", "port": "http", "scheme": "HTTP"},
        "periodSeconds": 7,
        "failureThreshold": 2,
        "timeoutSeconds": 5,
    }
    # Startup and liveness stay on gRPC health: /health answers 503 while the group is down, which must not restart
    # the scheduler.
    for probe in ("startupProbe", "livenessProbe"):
        assert scheduler[probe]["grpc"]["port"] == 50051, probe
    # With client TLS the HTTP API is HTTPS (the kubelet does not verify the certificate); gRPC probes move to the
    # plaintext health port.
    _, tls = _http_render(
        layout, "scheduler.probes.readiness.kind=http", "security.clientTLS.secretName=mmcast-client-tls"
    )
    assert tls["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    assert tls["livenessProbe"]["grpc"]["port"] == 50052


def test_http_readiness_values_file():
    """tests/deploy/values/http-readiness-tls.yaml: HTTPS readiness, both APIs behind TLS and tokens."""
    objects = _render_set("http-readiness-tls")
    group = find(objects, "StatefulSet", "-group")
    scheduler = container(group, "scheduler")
    args = flags(scheduler)
    assert args["http-port"] == "8443" and args["tls-cert-file"] and args["auth-tokens-file"]
    assert scheduler["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    http = {p["name"]: p for p in find(objects, "Service", "-scheduler")["spec"]["ports"]}["http"]
    assert (http["port"], http["targetPort"], http["appProtocol"]) == (443, "http", "https")
    assert {p["port"] for p in _client_rule(objects)["ports"]} == {50051, 8443, 50052}


def test_gpu_resources():
    """One GPU per rank container in a group pod; none for the scheduler container."""
    gpu = _render_set("gpu-tp4")
    group = find(gpu, "StatefulSet", "-group")
    assert group["spec"]["replicas"] == 2
    ranks = [c for c in pod_spec(group)["containers"] if c["name"].startswith("rank-")]
    assert [c["name"] for c in ranks] == ["rank-0", "rank-1", "rank-2", "rank-3"]
    for worker in ranks:
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert worker["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert worker["resources"]["limits"]["memory"] == "96Gi"
        assert flags(worker)["model"] == "/models/Qwen2-VL-7B-Instruct"
    assert "nvidia.com/gpu" not in json.dumps(container(group, "scheduler")["resources"])
    pvc = [v for v in pod_spec(group)["volumes"] if v["name"] == "model"][0]
    assert pvc["persistentVolumeClaim"] == {"claimName": "qwen2-vl-7b", "readOnly": True}
    assert not pod_spec(group).get("initContainers")

    cpu = _render_set("cpu-tiny")
    for obj in cpu:
        for template in pod_templates(obj):
            assert "gpu" not in json.dumps([c["resources"] for c in template["spec"]["containers"]])
    # Another vendor's resource name, multinode: one GPU count per rank pod.
    amd = render(sets=("worker.gpus=2", "gpu.resourceName=amd.com/gpu", "topology=multinode"))
    assert container(find(amd, "StatefulSet", "-worker"), "worker")["resources"]["limits"]["amd.com/gpu"] == 2


@pytest.mark.parametrize("name", VALUE_SETS)
def test_pods_run_unprivileged(name):
    templates = [t for obj in _render_set(name) for t in pod_templates(obj)]
    assert templates
    for template in templates:
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        if template["metadata"]["labels"]["app.kubernetes.io/component"] == "endpoint-picker":
            # Not an mmcast pod: the picker watches its pool through the API (its token), and has no model or /tmp.
            (c,) = spec["containers"]
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            continue
        assert spec["automountServiceAccountToken"] is False
        assert not spec.get("hostIPC") and not spec.get("hostNetwork") and not spec.get("hostPID")
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}, f"{c['name']} needs a writable /tmp"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and volumes["dshm"]["emptyDir"]["sizeLimit"]
        for c in spec["containers"]:
            if c["name"] in ("scheduler", "worker", "rank") or c["name"].startswith("rank-"):
                mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
                assert mounts["/dev/shm"] == "dshm", c["name"]


def test_tiny_model_init_container():
    for obj in render():
        for template in pod_templates(obj):
            (init,) = template["spec"]["initContainers"]
            assert init["command"] == ["mmcast"] and init["args"][:2] == ["make-tiny-model", "/models/tiny"]
            assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
            assert [v for v in template["spec"]["volumes"] if v["name"] == "model"][0] == {
                "name": "model",
                "emptyDir": {},
            }


def test_dashboard_configmap_embeds_the_chart_file():
    cm = find(render(), "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"] == {"mmcast.json": DASHBOARD_FILE.read_text()}
    custom = find(render(sets=("dashboard.label=my_dashboards", "dashboard.labelValue=yes")), "ConfigMap", "-dashboard")
    assert custom["metadata"]["labels"]["my_dashboards"] == "yes"
    assert not [o for o in render(sets=("dashboard.enabled=false",)) if o["kind"] == "ConfigMap"]


def test_prometheusrule_wraps_the_rules_file(tmp_path):
    source = yaml.safe_load(RULES_FILE.read_text())
    plain = find(render(sets=("prometheusRule.enabled=true",), api_versions=(MONITORING_API,)), "PrometheusRule")
    assert plain["spec"]["groups"] == source["groups"]
    # One name for every release: a second release that installs the rules again is refused by Helm.
    assert plain["metadata"]["name"] == "mmcast-rules"

    values, apis, _ = VALUE_SETS["monitoring"]
    rule = find(render(values, api_versions=apis), "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert "MmcastPreemptionStorm" not in alerts
    assert alerts["MmcastTimeToFirstTokenP99High"]["expr"].endswith("> 5")
    assert alerts["MmcastTimeToFirstTokenP99High"]["for"] == "15m"
    original = next(r for g in source["groups"] for r in g["rules"] if r.get("alert") == "MmcastWorkerGroupDown")
    down = alerts["MmcastWorkerGroupDown"]
    assert {k: v for k, v in down.items() if k != "annotations"} == {
        k: v for k, v in original.items() if k != "annotations"
    }
    # runbookBaseUrl prefixes the repository-relative runbook links.
    assert down["annotations"]["runbook_url"] == (
        "https://git.example.com/mmcast/blob/v0.1.0/" + original["annotations"]["runbook_url"]
    )
    rules_file = tmp_path / "rendered-rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    run([tool("promtool"), "check", "rules", str(rules_file)])


def test_every_alert_links_a_runbook_section():
    """Each alert's runbook_url names an anchor of docs/DEPLOYMENT.md that a heading there produces."""
    doc = (CHART.parents[1] / "docs" / "DEPLOYMENT.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in doc.splitlines()
        if line.startswith("#")
    }
    alerts = [r for g in yaml.safe_load(RULES_FILE.read_text())["groups"] for r in g["rules"] if "alert" in r]
    assert alerts
    for alert in alerts:
        url = alert["annotations"]["runbook_url"]
        page, anchor = url.split("#")
        assert page == "docs/DEPLOYMENT.md" and anchor in anchors, (alert["alert"], url)


def test_servicemonitor_scrapes_every_metrics_port():
    values, apis, _ = VALUE_SETS["monitoring"]
    objects = render(values, api_versions=apis)
    sm = find(objects, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    ports = [e["port"] for e in sm["spec"]["endpoints"]]
    assert ports == ["metrics", "rank0-metrics", "rank1-metrics"]
    for endpoint in sm["spec"]["endpoints"]:
        targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
        assert targets["release"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"]
    # Of the Services it selects, only the metrics Service (every pod, ready or not) carries those ports, so each
    # target is scraped once and a group that is down still reports mmcast_worker_group_up 0.
    selected = [
        o
        for o in objects
        if o["kind"] == "Service" and sm["spec"]["selector"]["matchLabels"].items() <= o["metadata"]["labels"].items()
    ]
    carrying = [o for o in selected if set(ports) & {p["name"] for p in o["spec"]["ports"]}]
    (svc,) = carrying
    assert svc["metadata"]["name"] == f"{RELEASE}-mmcast-metrics" and svc["spec"]["publishNotReadyAddresses"] is True
    # Each Service port reaches a container port of that name in the group pod.
    group = find(objects, "StatefulSet", "-group")
    assert group["spec"]["template"]["metadata"]["labels"].items() >= svc["spec"]["selector"].items()
    container_ports = {p["name"]: p["containerPort"] for c in pod_spec(group)["containers"] for p in c["ports"]}
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {n: container_ports[n] for n in ports}
    # Multinode without LeaderWorkerSet: the scheduler Service and the ranks' headless Service carry `metrics`.
    multinode = render(values, sets=("topology=multinode", "replicaCount=1"), api_versions=apis)
    sm = find(multinode, "ServiceMonitor")
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    carrying = sorted(
        o["metadata"]["name"]
        for o in multinode
        if o["kind"] == "Service" and "metrics" in {p["name"] for p in o["spec"]["ports"]}
    )
    assert carrying == [f"{RELEASE}-mmcast-scheduler", f"{RELEASE}-mmcast-worker"]


def test_long_release_names_fit_kubernetes_limits():
    for sets, apis, workload in (
        (("topology=multinode",), (), ("StatefulSet", "-worker")),
        ((), (), ("StatefulSet", "-group")),
        (("topology=multinode",), (LWS_API,), ("LeaderWorkerSet", "-group")),
    ):
        objects = render(sets=sets, api_versions=apis, release="a-very-long-release-name-for-a-serving-deployment-x")
        for obj in objects:
            assert len(obj["metadata"]["name"]) <= 63
        assert len(find(objects, *workload)["metadata"]["name"]) <= 52


def test_every_value_is_documented():
    """helm-docs style: a `# --` comment above every leaf value not already covered by a commented parent."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    key_re = re.compile(r"^(\s*)([A-Za-z0-9_]+):(.*)$")
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    missing = []
    for i, line in enumerate(lines):
        m = key_re.match(line)
        if not m:
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3).strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        documented = prev.startswith("# --")
        covered = any(doc for _, doc in stack)
        nxt = next(
            (lines[j] for j in range(i + 1, len(lines)) if lines[j].strip() and not lines[j].strip().startswith("#")),
            "",
        )
        nxt_indent = len(nxt) - len(nxt.lstrip())
        is_leaf = bool(rest) or nxt_indent <= indent or nxt.lstrip().startswith("- ")
        if is_leaf and not documented and not covered:
            missing.append(f"line {i + 1}: {key}")
        stack.append((indent, documented))
    assert not missing, "values without a `# --` comment:\n" + "\n".join(missing)


def test_schema_covers_every_value():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node, sch, path):
        if not isinstance(node, dict) or sch.get("type") != "object" or "properties" not in sch:
            return
        assert sch.get("additionalProperties") is False, f"{path or '(root)'}: the schema must reject unknown keys"
        for key, value in node.items():
            assert key in sch["properties"], f"{path}{key} is not in values.schema.json"
            walk(value, sch["properties"][key], f"{path}{key}.")

    walk(values, schema, "")


def _notes(*sets: str) -> str:
    """NOTES.txt as `helm install` prints it (helm template renders no notes: it is included into a ConfigMap)."""
    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / "mmcast"
        shutil.copytree(CHART, chart)
        notes = (chart / "templates" / "NOTES.txt").read_text()
        (chart / "templates" / "zz-notes.yaml").write_text(
            '{{- define "notes-under-test" }}' + notes + "{{- end }}\n"
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
            'data:\n  notes: {{ include "notes-under-test" . | quote }}\n'
        )
        args = [
            tool("helm"),
            "template",
            RELEASE,
            str(chart),
            "--namespace",
            NAMESPACE,
            "--show-only",
            "templates/zz-notes.yaml",
        ]
        for s in sets:
            args += ["--set", s]
        out = run(args).stdout
    return yaml.safe_load(out)["data"]["notes"]


def test_notes_show_how_to_call_the_service():
    text = _notes()
    assert f"port-forward svc/{RELEASE}-mmcast-scheduler 50051:50051" in text
    assert "mmcast generate --target localhost:50051" in text
    for rpc in (
        "mmcast.v1.GenerationService/Generate",
        "mmcast.v1.GenerationService/GetServerInfo",
        "grpc.health.v1.Health/Check",
    ):
        assert "grpcurl -plaintext" in text and rpc in text
    # The OpenAI-compatible API (on by default): its base URL in the cluster and through a port-forward.
    assert f"http://{RELEASE}-mmcast-scheduler.{NAMESPACE}.svc.cluster.local:8000/v1" in text
    assert f"port-forward svc/{RELEASE}-mmcast-scheduler 8000:8000" in text
    assert "base URL http://localhost:8000/v1" in text and "curl http://localhost:8000/v1/models" in text
    # HTTPS with client TLS, on the Service's http port; a bearer token with authTokens.
    tls = _notes(
        "security.clientTLS.secretName=t", "security.authTokens.secretName=a", "scheduler.service.httpPort=443"
    )
    assert f"https://{RELEASE}-mmcast-scheduler.{NAMESPACE}.svc.cluster.local:443/v1" in tls
    assert (
        "http://" not in tls
        and 'curl --cacert ca.crt -H "Authorization: Bearer $TOKEN" https://localhost:443/v1/models' in tls
    )
    off = _notes("scheduler.http.enabled=false")
    assert "/v1" not in off and "8000" not in off and "OpenAI" not in off


def test_chart_matches_the_project():
    import tomllib

    project = tomllib.loads((CHART.parents[1] / "pyproject.toml").read_text())["project"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == project["version"], (
        "the image tag defaults to appVersion: keep it the package version"
    )
    client = tomllib.loads((CHART.parents[1] / "client" / "pyproject.toml").read_text())["project"]
    scripts = {**project["scripts"], **client["scripts"]}  # the image installs both distributions
    for name in ("defaults", "multinode-lws"):
        for obj in _render_set(name, kube_version="1.27.0") + render(
            sets=("topology=multinode",), kube_version="1.27.0"
        ):
            for template in pod_templates(obj):
                spec = template["spec"]
                for c in spec["containers"] + spec.get("initContainers", []):
                    if c["name"] == "log-shipper":  # the example sidecar of multinode-values.yaml
                        continue
                    command = c["command"]
                    exe = command[3] if command[0] == "/bin/sh" else command[0]
                    assert exe in scripts, f"{c['name']} runs {exe}, not a console script of either distribution"


def _merge(base: dict, override: dict) -> None:
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


@pytest.mark.parametrize("name", VALUE_SETS)
def test_services_accept_the_rendered_arguments(name, tmp_path):
    """The chart's flags go through the services' own parsers and config validation (no server is started); the
    mounted Secret files (the worker token, by default) are stood in for by real files."""
    from scheduler_svc.main import config_from
    from worker_svc.config import load_config

    def local(args):
        out = []
        for arg in args:
            if "=/etc/mmcast/" in arg:
                path = tmp_path / arg.split("=/etc/mmcast/", 1)[1]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("stand-in-token-0123456789\n")
                arg = arg.split("=", 1)[0] + "=" + str(path)
            out.append(arg)
        return out

    objects = _render_set(name)
    ranks = _ranks(objects, _layout(name))
    (scheduler,) = [
        c for obj in objects for t in pod_templates(obj) for c in t["spec"]["containers"] if c["name"] == "scheduler"
    ]
    sconf = config_from(local(_group_index(scheduler["args"])), environ={})
    assert sconf.http_port == int(flags(scheduler).get("http-port", 0))
    tp = len(ranks)
    assert len(sconf.workers) == tp
    dist = set()
    for rank, (args, environ) in enumerate(ranks):
        wconf = load_config(local(_group_index(args)), environ=environ)
        assert (wconf.rank, wconf.world_size) == (rank, tp)
        assert wconf.scheduler_id == sconf.scheduler_id
        assert wconf.model == sconf.model
        dist.add(wconf.dist_init)
        assert sconf.workers[rank].endswith(":" + wconf.listen.rsplit(":", 1)[1])
    assert len(dist) == 1, f"the ranks disagree on rank 0's rendezvous: {dist}"


def _group_index(args: list[str], group: int = 1) -> list[str]:
    """Kubernetes expands $(MMCAST_GROUP_INDEX) from the pod's LeaderWorkerSet group-index label."""
    return [a.replace("$(MMCAST_GROUP_INDEX)", str(group)) for a in args]


def _ranks(objects: list[dict], layout: str) -> list[tuple[list[str], dict]]:
    """(arguments, environment) of each rank in rank order, as the layout starts them."""
    if layout == "pod":
        group = find(objects, "StatefulSet", "-group")
        cs = [c for c in pod_spec(group)["containers"] if c["name"].startswith("rank-")]
        assert [c["name"] for c in cs] == [f"rank-{i}" for i in range(len(cs))]
        return [(c["args"], {}) for c in cs]
    if layout == "lws":
        lws = find(objects, "LeaderWorkerSet")
        size = lws["spec"]["leaderWorkerTemplate"]["size"]
        leader, worker = (
            container({"spec": {"template": t}, "kind": "", "metadata": lws["metadata"]}, "rank")
            for t in pod_templates(lws)
        )
        return [(leader["args"], {})] + [(worker["args"], {"MMCAST_RANK": str(r)}) for r in range(1, size)]
    sts = find(objects, "StatefulSet", "-worker")
    worker = container(sts, "worker")
    return [(worker["args"], {"MMCAST_RANK": str(r)}) for r in range(sts["spec"]["replicas"])]
