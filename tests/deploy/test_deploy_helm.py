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

from tests.deploy.deploy_tools import (
    CHART,
    CI_VALUES,
    DASHBOARD_FILE,
    KUBE_VERSION,
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
    render,
    run,
    tool,
)

# name -> (values files, extra --api-versions)
VALUE_SETS = {
    "defaults": ((), ()),
    "cpu-tiny": ((CI_VALUES / "cpu-tiny-values.yaml",), ()),
    "gpu-tp4": ((CI_VALUES / "gpu-tp4-values.yaml",), ()),
    "monitoring": ((CI_VALUES / "monitoring-values.yaml",), (MONITORING_API,)),
}
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SCHEMAS / "servicemonitor.monitoring.coreos.com-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): SCHEMAS / "prometheusrule.monitoring.coreos.com-v1.json",
}
WORKER_FLAGS = {"world-size", "listen", "dist-init", "model", "device", "dtype", "kv-blocks", "metrics-port",
                "payload-cache-bytes", "encoder-cache-tokens", "scheduler-id", "log-level"}
SCHEDULER_FLAGS = {"listen", "metrics-port", "workers", "model", "transfer-mode", "max-num-batched-tokens",
                   "max-num-seqs", "max-waiting", "max-images-per-request", "max-image-pixels", "max-request-bytes",
                   "chunk-size-bytes", "group-deadline-seconds", "drain-seconds", "scheduler-id", "log-level"}


def _render_set(name: str, **kwargs) -> list[dict]:
    values, apis = VALUE_SETS[name]
    return render(values, api_versions=apis, **kwargs)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint(name):
    values, _ = VALUE_SETS[name]
    args = [tool("helm"), "lint", str(CHART), "--strict", "--namespace", NAMESPACE]
    for v in values:
        args += ["-f", str(v)]
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
        else:
            core.append(obj)
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(core))
    proc = run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", KUBE_VERSION, str(manifest)], check=False)
    assert proc.returncode == 0, f"kubernetes-validate failed for {name}:\n{proc.stdout}\n{proc.stderr}"
    kinds = sorted(o["kind"] for o in core)
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "ServiceAccount"} <= set(kinds), kinds


def test_monitoring_objects_need_the_api_version():
    values, _ = VALUE_SETS["monitoring"]
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


@pytest.mark.parametrize("name", ["defaults", "cpu-tiny", "gpu-tp4"])
def test_worker_group_contract(name):
    objects = _render_set(name)
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
    objects = render(kube_version="1.27.0")
    worker = container(find(objects, "StatefulSet", "-worker"), "worker")
    assert "MMCAST_RANK" not in env(worker)
    assert worker["command"][:2] == ["/bin/sh", "-c"]
    script = worker["command"][2]
    assert 'MMCAST_RANK="${POD_NAME##*-}"' in script and 'exec mmcast-worker "$@"' in script
    assert env(worker)["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_scheduler_contract():
    objects = render()
    deploy = find(objects, "Deployment", "-scheduler")
    svc = find(objects, "Service", "-scheduler")
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 50051, "metrics": 9400}
    c = container(deploy, "scheduler")
    args = flags(c)
    assert SCHEDULER_FLAGS <= set(args), SCHEDULER_FLAGS - set(args)
    assert args["listen"] == "0.0.0.0:50051" and args["metrics-port"] == "9400"
    assert args["transfer-mode"] == "lazy"
    assert c["command"] == ["mmcast-scheduler"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "metrics": 9400}
    assert pod_spec(deploy)["terminationGracePeriodSeconds"] > int(args["drain-seconds"])


@pytest.mark.parametrize("component,service", [("scheduler", "mmcast.v1.Generation"),
                                               ("worker", "mmcast.v1.WorkerService")])
def test_grpc_health_probes(component, service):
    objects = render()
    kind = "Deployment" if component == "scheduler" else "StatefulSet"
    c = container(find(objects, kind, f"-{component}"), component)
    port = 50051 if component == "scheduler" else 50061
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == port, probe
    assert c["readinessProbe"]["grpc"]["service"] == service
    assert c["livenessProbe"]["grpc"]["service"] == ""
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "startup must cover a model load"


def test_gpu_resources():
    gpu = _render_set("gpu-tp4")
    worker = container(find(gpu, "StatefulSet", "-worker"), "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert worker["resources"]["limits"]["memory"] == "96Gi"
    assert "nvidia.com/gpu" not in json.dumps(container(find(gpu, "Deployment", "-scheduler"), "scheduler")["resources"])
    pvc = [v for v in pod_spec(find(gpu, "StatefulSet", "-worker"))["volumes"] if v["name"] == "model"][0]
    assert pvc["persistentVolumeClaim"] == {"claimName": "qwen2-vl-7b", "readOnly": True}
    assert flags(worker)["model"] == "/models/Qwen2-VL-7B-Instruct"
    assert not pod_spec(find(gpu, "StatefulSet", "-worker")).get("initContainers")

    cpu = _render_set("cpu-tiny")
    for obj in cpu:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            assert "gpu" not in json.dumps(pod_spec(obj)["containers"][0]["resources"])
    # Another vendor's resource name.
    amd = render(sets=("worker.gpus=2", "gpu.resourceName=amd.com/gpu"))
    assert container(find(amd, "StatefulSet", "-worker"), "worker")["resources"]["limits"]["amd.com/gpu"] == 2


@pytest.mark.parametrize("name", VALUE_SETS)
def test_pods_run_unprivileged(name):
    for obj in _render_set(name):
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = pod_spec(obj)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}, f"{c['name']} needs a writable /tmp"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and volumes["dshm"]["emptyDir"]["sizeLimit"]
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm"


def test_tiny_model_init_container():
    for obj in render():
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        (init,) = pod_spec(obj)["initContainers"]
        assert init["command"] == ["mmcast"] and init["args"][:2] == ["make-tiny-model", "/models/tiny"]
        assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
        assert [v for v in pod_spec(obj)["volumes"] if v["name"] == "model"][0] == {"name": "model", "emptyDir": {}}


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

    values, apis = VALUE_SETS["monitoring"]
    rule = find(render(values, api_versions=apis), "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert "MmcastPreemptionStorm" not in alerts
    assert alerts["MmcastTimeToFirstTokenP99High"]["expr"].endswith("> 5")
    assert alerts["MmcastTimeToFirstTokenP99High"]["for"] == "15m"
    assert alerts["MmcastWorkerGroupDown"] == next(r for g in source["groups"] for r in g["rules"]
                                                   if r.get("alert") == "MmcastWorkerGroupDown")
    rules_file = tmp_path / "rendered-rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    run([tool("promtool"), "check", "rules", str(rules_file)])


def test_servicemonitor_labels_targets():
    values, apis = VALUE_SETS["monitoring"]
    sm = find(render(values, api_versions=apis), "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert targets["release"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"]
    # The selector matches both Services that carry a `metrics` port.
    objects = render(values, api_versions=apis)
    selected = [o for o in objects if o["kind"] == "Service"
                and sm["spec"]["selector"]["matchLabels"].items() <= o["metadata"]["labels"].items()]
    assert sorted(o["metadata"]["name"] for o in selected) == [f"{RELEASE}-mmcast-scheduler", f"{RELEASE}-mmcast-worker"]
    assert all("metrics" in {p["name"] for p in o["spec"]["ports"]} for o in selected)


def test_pdbs():
    values, apis = VALUE_SETS["monitoring"]
    pdbs = {o["metadata"]["name"]: o["spec"] for o in render(values, api_versions=apis)
            if o["kind"] == "PodDisruptionBudget"}
    assert pdbs[f"{RELEASE}-mmcast-scheduler"]["maxUnavailable"] == 0
    assert pdbs[f"{RELEASE}-mmcast-worker"]["minAvailable"] == "100%"
    assert not [o for o in render() if o["kind"] == "PodDisruptionBudget"]


def test_long_release_names_fit_kubernetes_limits():
    objects = render(release="a-very-long-release-name-for-a-serving-deployment-x")
    for obj in objects:
        assert len(obj["metadata"]["name"]) <= 63
    assert len(find(objects, "StatefulSet", "-worker")["metadata"]["name"]) <= 52


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
        nxt = next((lines[j] for j in range(i + 1, len(lines)) if lines[j].strip() and not lines[j].strip().startswith("#")), "")
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


def test_notes_show_how_to_call_the_service():
    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / "mmcast"
        shutil.copytree(CHART, chart)
        notes = (chart / "templates" / "NOTES.txt").read_text()
        (chart / "templates" / "zz-notes.yaml").write_text(
            '{{- define "notes-under-test" }}' + notes + "{{- end }}\n"
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
            'data:\n  notes: {{ include "notes-under-test" . | quote }}\n')
        out = run([tool("helm"), "template", RELEASE, str(chart), "--namespace", NAMESPACE,
                   "--show-only", "templates/zz-notes.yaml"]).stdout
    text = yaml.safe_load(out)["data"]["notes"]
    assert f"port-forward svc/{RELEASE}-mmcast-scheduler 50051:50051" in text
    assert "mmcast generate --target localhost:50051" in text
    for rpc in ("mmcast.v1.Generation/Generate", "mmcast.v1.Generation/GetServerInfo", "grpc.health.v1.Health/Check"):
        assert "grpcurl -plaintext" in text and rpc in text


def test_chart_matches_the_project():
    import tomllib

    project = tomllib.loads((CHART.parents[1] / "pyproject.toml").read_text())["project"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == project["version"], "the image tag defaults to appVersion: keep it the package version"
    scripts = project["scripts"]
    for obj in render(kube_version="1.27.0"):
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = pod_spec(obj)
        for c in spec["containers"] + spec.get("initContainers", []):
            command = c["command"]
            exe = command[3] if command[0] == "/bin/sh" else command[0]
            assert exe in scripts, f"{c['name']} runs {exe}, not a console script of pyproject.toml"


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
    scheduler = container(find(objects, "Deployment", "-scheduler"), "scheduler")
    sconf = config_from(local(scheduler["args"]), environ={})
    worker = container(find(objects, "StatefulSet", "-worker"), "worker")
    tp = find(objects, "StatefulSet", "-worker")["spec"]["replicas"]
    assert len(sconf.workers) == tp
    for rank in range(tp):
        wconf = load_config(local(worker["args"]), environ={"MMCAST_RANK": str(rank)})
        assert (wconf.rank, wconf.world_size) == (rank, tp)
        assert wconf.scheduler_id == sconf.scheduler_id
        assert wconf.model == sconf.model
        assert sconf.workers[rank].endswith(":" + wconf.listen.rsplit(":", 1)[1])
