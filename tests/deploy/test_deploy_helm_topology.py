"""The chart's layouts: a group per pod (`topology: pod`), one pod per rank (`multinode`, on LeaderWorkerSet where
its API is served), the client headless Service, and the NetworkPolicies and PodDisruptionBudgets checked against
the labels and ports of the pods they are meant to cover."""

from __future__ import annotations

import pytest
import yaml

from tests.support.deploy_tools import (
    CHART,
    CI_VALUES,
    LWS_API,
    LWS_GROUP_INDEX,
    LWS_WORKER_INDEX,
    NAMESPACE,
    RELEASE,
    container,
    find,
    flags,
    helm_template_args,
    pod_spec,
    pod_templates,
    render,
    run,
)

CPU = (CI_VALUES / "cpu-tiny-values.yaml",)  # TP=2
SCALE_OUT = CI_VALUES / "scale-out-values.yaml"
MULTINODE_LWS = {"values": CPU, "sets": ("topology=multinode", "replicaCount=3"), "api_versions": (LWS_API,)}
MULTINODE_STS = {"values": CPU, "sets": ("topology=multinode",)}
GROUP_POD = {"values": CPU, "sets": ("replicaCount=3",)}
LAYOUTS = {"pod": GROUP_POD, "statefulset": MULTINODE_STS, "lws": MULTINODE_LWS}


def _selects(selector: dict, labels: dict) -> bool:
    """A label selector as Kubernetes evaluates it (matchLabels and matchExpressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and labels.get(key) in values)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def _pods(objects: list[dict]) -> list[dict]:
    """The pods the workloads create, as {labels, containers}, one per replica; a LeaderWorkerSet's pods also carry
    the group-index and worker-index labels its controller sets (one pod per rank and group)."""
    pods = []
    for obj in objects:
        for template in pod_templates(obj):
            labels = template["metadata"]["labels"]
            containers = template["spec"]["containers"]
            if obj["kind"] == "LeaderWorkerSet":
                size = obj["spec"]["leaderWorkerTemplate"]["size"]
                leader = labels["app.kubernetes.io/component"] == "leader"
                for g in range(obj["spec"]["replicas"]):
                    for w in [0] if leader else range(1, size):
                        pods.append(
                            {
                                "labels": {**labels, LWS_GROUP_INDEX: str(g), LWS_WORKER_INDEX: str(w)},
                                "containers": containers,
                            }
                        )
            else:  # a StatefulSet's controller adds the pod-index label (Kubernetes >= 1.28)
                for i in range(obj["spec"]["replicas"]):
                    extra = {"apps.kubernetes.io/pod-index": str(i)} if obj["kind"] == "StatefulSet" else {}
                    pods.append({"labels": {**labels, **extra}, "containers": containers})
    return pods


def _container_ports(pod: dict) -> dict[int, str]:
    return {p["containerPort"]: p["name"] for c in pod["containers"] for p in c.get("ports", [])}


def _policies(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] == "NetworkPolicy"]


def _admitted(policies: list[dict], pod: dict, source: dict | None, port: int) -> bool:
    """Whether a connection from `source` (a pod of this namespace, or None: anywhere else) reaches `port` of `pod`.
    Pods no policy selects admit everything; `from` entries with a namespaceSelector are taken as matching the
    scrapers' namespace (the metrics rule), so a source is identified by its pod labels."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], pod["labels"])]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            if "ports" in rule and port not in {p["port"] for p in rule["ports"]}:
                continue
            if "from" not in rule:
                return True
            for peer in rule["from"]:
                if source is not None and "podSelector" in peer and _selects(peer["podSelector"], source["labels"]):
                    return True
    return False


PROMETHEUS = {"labels": {"app.kubernetes.io/name": "prometheus"}}
STRANGER = {"labels": {"app": "something-else"}}


# --- topology: pod -----------------------------------------------------------------------------------------------


def test_group_pod_holds_its_scheduler_and_one_container_per_rank():
    objects = render(**GROUP_POD)
    group = find(objects, "StatefulSet", "-group")
    assert group["spec"]["replicas"] == 3 and group["spec"]["podManagementPolicy"] == "Parallel"
    assert group["spec"]["serviceName"] == f"{RELEASE}-mmcast-headless"
    spec = pod_spec(group)
    assert [c["name"] for c in spec["containers"]] == ["scheduler", "rank-0", "rank-1"]
    assert not any(spec.get(k) for k in ("hostIPC", "hostNetwork", "hostPID", "shareProcessNamespace"))
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    listens = []
    for rank in range(2):
        c = container(group, f"rank-{rank}")
        args = flags(c)
        assert (args["rank"], args["world-size"]) == (str(rank), "2")
        assert args["dist-init"] == "tcp://127.0.0.1:29500"
        assert args["listen"] == f"0.0.0.0:{50061 + rank}" and args["metrics-port"] == str(9401 + rank)
        # Rank 0's rendezvous store binds the pod's loopback; every rank is told, so all of them build the same
        # store (worker_svc/process_group.py: a rank without the flag would use torch's own, under other keys, and wait).
        assert args["dist-bind-host"] == "127.0.0.1"
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm" and mounts["/tmp"] == f"tmp-rank-{rank}"
        assert volumes[f"tmp-rank-{rank}"]["emptyDir"]["sizeLimit"] == "2Gi"
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
        assert c["readinessProbe"]["grpc"]["port"] == 50061 + rank
        listens.append("127.0.0.1:" + args["listen"].rsplit(":", 1)[1])
    scheduler = container(group, "scheduler")
    assert flags(scheduler)["workers"] == ",".join(listens)
    assert {m["mountPath"]: m["name"] for m in scheduler["volumeMounts"]}["/tmp"] == "tmp"
    # Port names are unique in the pod and fit Kubernetes' 15 characters.
    names = [p["name"] for c in spec["containers"] for p in c["ports"]]
    assert len(names) == len(set(names)) and max(map(len, names)) <= 15
    # The kubelet signals every container at once: the ranks wait out the scheduler's drain before they stop
    # (5 s after SIGTERM), and the pod's grace period covers both.
    drain = int(flags(scheduler)["drain-seconds"])
    for rank in range(2):
        assert container(group, f"rank-{rank}")["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(drain)]
    assert "lifecycle" not in scheduler
    assert spec["terminationGracePeriodSeconds"] > drain + 5


def test_a_name_set_in_extra_env_wins_over_the_loopback_default():
    objects = render(CPU, ("worker.extraEnv[0].name=NCCL_SOCKET_IFNAME", "worker.extraEnv[0].value=eth0"))
    env = [(e["name"], e.get("value")) for e in container(find(objects, "StatefulSet", "-group"), "rank-1")["env"]]
    assert [v for n, v in env if n == "NCCL_SOCKET_IFNAME"] == ["eth0"]
    assert ("GLOO_SOCKET_IFNAME", "lo") in env


def test_image_digest_extra_volumes_and_sidecars_reach_every_pod():
    objects = render((CI_VALUES / "multinode-values.yaml",), ("replicaCount=2",), (LWS_API,))
    digest = "registry.example.com/mmcast@sha256:4f1e3b5a9c2d7e8f0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f6071"
    templates = [t for o in objects for t in pod_templates(o)]
    assert len(templates) == 2
    for template in templates:
        spec = template["spec"]
        assert "fingerprint-cache" in {v["name"] for v in spec["volumes"]}
        assert spec["containers"][-1]["name"] == "log-shipper"
        for c in spec["containers"][:-1] + spec.get("initContainers", []):
            assert c["image"] == digest, c["name"]
        for c in spec["containers"][:-1]:
            assert {"name": "fingerprint-cache", "mountPath": "/var/cache/mmcast"} in c["volumeMounts"], c["name"]
    # Without a digest the tag is used.
    assert container(find(render(), "StatefulSet", "-group"), "scheduler")["image"] == "mmcast:0.1.0"


# --- topology: multinode ------------------------------------------------------------------------------------------


def test_multinode_renders_a_leaderworkerset_only_where_its_api_is_served():
    with_api = render(**MULTINODE_LWS)
    kinds = {o["kind"] for o in with_api}
    assert "LeaderWorkerSet" in kinds and not kinds & {"Deployment", "StatefulSet"}
    lws = find(with_api, "LeaderWorkerSet")
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lws["spec"]["replicas"] == 3 and lwt["size"] == 2
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = (t["spec"]["containers"] for t in pod_templates(lws))
    assert [c["name"] for c in leader] == ["scheduler", "rank"] and [c["name"] for c in worker] == ["rank"]
    scheduler, rank0 = leader
    host = f"{RELEASE}-mmcast-group-$(MMCAST_GROUP_INDEX).{RELEASE}-mmcast-group.{NAMESPACE}.svc.cluster.local"
    assert flags(rank0)["dist-init"] == flags(worker[0])["dist-init"] == f"tcp://{host}:29500"
    assert flags(rank0)["rank"] == "0" and "rank" not in flags(worker[0])
    drain = int(flags(scheduler)["drain-seconds"])
    for template, rank in zip(pod_templates(lws), (rank0, worker[0]), strict=True):
        assert rank["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(drain)]
        assert template["spec"]["terminationGracePeriodSeconds"] > drain + 5
    rank_env = {e["name"]: e for e in worker[0]["env"]}
    assert rank_env["MMCAST_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.labels['{LWS_WORKER_INDEX}']"
    for c in (scheduler, rank0, worker[0]):
        group_env = {e["name"]: e for e in c["env"]}["MMCAST_GROUP_INDEX"]
        assert group_env["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.labels['{LWS_GROUP_INDEX}']"
    # Rank 0 shares the leader pod with the scheduler; rank 1 is the group's second pod.
    assert flags(scheduler)["workers"] == (
        f"127.0.0.1:50061,{RELEASE}-mmcast-group-$(MMCAST_GROUP_INDEX)-1.{RELEASE}-mmcast-group.{NAMESPACE}"
        ".svc.cluster.local:50061"
    )

    without = render(**MULTINODE_STS)
    assert {"Deployment", "StatefulSet"} <= {o["kind"] for o in without}
    assert "LeaderWorkerSet" not in {o["kind"] for o in without}
    assert find(without, "StatefulSet", "-worker")["spec"]["replicas"] == 2


# --- the client Services ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_headless_service_reaches_every_scheduler_and_only_them(layout):
    objects = render(**LAYOUTS[layout])
    svc = find(objects, "Service", "-headless")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is False, "a group that is down must leave the ring"
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 50051 and port["appProtocol"] == "grpc"
    pods = _pods(objects)
    selected = [p for p in pods if _selects({"matchLabels": svc["spec"]["selector"]}, p["labels"])]
    with_scheduler = [p for p in pods if "scheduler" in {c["name"] for c in p["containers"]}]
    assert selected == with_scheduler and len(selected) == (1 if layout == "statefulset" else 3)
    for pod in selected:
        assert _container_ports(pod)[50051] == port["targetPort"]
    # The ClusterIP Service selects the same pods.
    plain = find(objects, "Service", "-scheduler")
    assert plain["spec"]["selector"] == svc["spec"]["selector"]


# --- NetworkPolicy ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_pod_is_covered_and_every_policy_port_is_a_container_port(layout):
    objects = render(**LAYOUTS[layout])
    policies = _policies(objects)
    pods = _pods(objects)
    assert policies and pods
    for pod in pods:
        selecting = [p for p in policies if _selects(p["spec"]["podSelector"], pod["labels"])]
        assert selecting, f"no NetworkPolicy covers pod {pod['labels']}"
    for policy in policies:
        selected = [p for p in pods if _selects(policy["spec"]["podSelector"], p["labels"])]
        assert selected, f"{policy['metadata']['name']} selects no pod"
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            for port in rule.get("ports", []):
                assert any(port["port"] in _container_ports(p) for p in selected), (policy["metadata"]["name"], port)


def test_group_pod_admits_only_the_client_and_metrics_ports():
    objects = render(**GROUP_POD)
    policies = _policies(objects)
    (pod, *_) = _pods(objects)
    ports = _container_ports(pod)
    for port, name in ports.items():
        from_anywhere = _admitted(policies, pod, None, port)
        from_prometheus = _admitted(policies, pod, PROMETHEUS, port)
        if name in ("grpc", "http"):
            assert from_anywhere, "the client ports (gRPC, OpenAI-compatible HTTP) are open to every client by default"
        elif name.endswith("metrics"):
            assert from_prometheus and not from_anywhere and not _admitted(policies, pod, STRANGER, port), name
        else:  # the ranks' Step ports and the rendezvous: loopback only
            assert not from_anywhere and not from_prometheus and not _admitted(policies, pod, pod, port), name
    # networkPolicy.client.from narrows the client port.
    narrowed = render(values=CPU + (SCALE_OUT,))
    pod = _pods(narrowed)[0]
    (policy,) = _policies(narrowed)
    for port in (50051, 8000):
        assert not _admitted([policy], pod, None, port) and not _admitted([policy], pod, STRANGER, port)
    assert policy["spec"]["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}
    ]


def test_multinode_ranks_admit_their_scheduler_on_the_step_port_and_their_peers():
    objects = render(**MULTINODE_STS)
    policies = _policies(objects)
    pods = _pods(objects)
    (scheduler,) = [p for p in pods if p["labels"]["app.kubernetes.io/component"] == "scheduler"]
    rank, other_rank = [p for p in pods if p["labels"]["app.kubernetes.io/component"] == "worker"]
    assert _admitted(policies, rank, scheduler, 50061)
    assert not _admitted(policies, rank, None, 50061) and not _admitted(policies, rank, PROMETHEUS, 50061)
    assert _admitted(policies, rank, other_rank, 29500), "peers reach rank 0's rendezvous"
    assert not _admitted(policies, rank, scheduler, 29500) and not _admitted(policies, rank, None, 29500)
    assert _admitted(policies, rank, PROMETHEUS, 9401) and not _admitted(policies, rank, None, 9401)
    # Another release's pods are strangers.
    other = {"labels": {**rank["labels"], "app.kubernetes.io/instance": "other"}}
    assert not _admitted(policies, rank, other, 29500)


def test_leaderworkerset_groups_admit_only_their_own_leader_and_peers():
    objects = render(**MULTINODE_LWS)
    policies = _policies(objects)
    pods = _pods(objects)
    assert len(pods) == 3 * 2

    def pod(group, index):
        (p,) = [
            p
            for p in pods
            if p["labels"][LWS_GROUP_INDEX] == str(group) and p["labels"][LWS_WORKER_INDEX] == str(index)
        ]
        return p

    for g in range(3):
        leader, rank1 = pod(g, 0), pod(g, 1)
        assert _admitted(policies, rank1, leader, 50061), "the group's scheduler reaches its rank"
        assert _admitted(policies, leader, rank1, 29500), "a rank reaches its rank 0's rendezvous"
        for h in range(3):
            if h != g:
                assert not _admitted(policies, rank1, pod(h, 0), 50061), "another group's scheduler"
                assert not _admitted(policies, leader, pod(h, 1), 29500), "another group's rank"
        assert _admitted(policies, leader, None, 50051)
        assert not _admitted(policies, rank1, None, 50061) and not _admitted(policies, leader, None, 29500)
        assert _admitted(policies, rank1, PROMETHEUS, 9401) and not _admitted(policies, rank1, STRANGER, 9401)


def test_network_policies_can_be_turned_off():
    assert not _policies(render(sets=("networkPolicy.enabled=false",)))


# --- PodDisruptionBudget ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pdbs_select_the_pods_and_allow_a_drain(layout):
    objects = render(**LAYOUTS[layout])
    pdbs = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    pods = _pods(objects)
    covered = []
    for pdb in pdbs:
        spec = pdb["spec"]
        assert ("minAvailable" in spec) != ("maxUnavailable" in spec), "exactly one of the two"
        assert spec["maxUnavailable"] == 1, "the default lets kubectl drain take one group (or rank) at a time"
        selected = [p for p in pods if _selects(pdb["spec"]["selector"], p["labels"])]
        assert selected, f"{pdb['metadata']['name']} selects no pod"
        covered += [id(p) for p in selected]
    assert sorted(covered) == sorted(id(p) for p in pods), "every pod in exactly one PDB"
    expected = {"pod": ["group"], "lws": ["group"], "statefulset": ["scheduler", "worker"]}[layout]
    assert sorted(p["metadata"]["name"] for p in pdbs) == [f"{RELEASE}-mmcast-{e}" for e in expected]


def test_pdb_values():
    monitoring = render((CI_VALUES / "monitoring-values.yaml",))
    assert find(monitoring, "PodDisruptionBudget")["spec"] == {
        "maxUnavailable": "50%",
        "selector": {"matchLabels": {"app.kubernetes.io/name": "mmcast", "app.kubernetes.io/instance": RELEASE}},
    }
    min_available = find(
        render(sets=("podDisruptionBudget.group.minAvailable=2", "podDisruptionBudget.group.maxUnavailable=null")),
        "PodDisruptionBudget",
    )
    assert min_available["spec"]["minAvailable"] == 2 and "maxUnavailable" not in min_available["spec"]
    both = run(helm_template_args(sets=("podDisruptionBudget.group.minAvailable=1",)), check=False)
    assert (
        both.returncode != 0
        and "podDisruptionBudget.group: set minAvailable or maxUnavailable, not both" in both.stderr
    )
    assert not [o for o in render(sets=("podDisruptionBudget.enabled=false",)) if o["kind"] == "PodDisruptionBudget"]


# --- installed once -----------------------------------------------------------------------------------------------


def test_dashboard_and_rules_have_one_name_for_every_release():
    """Several releases in a namespace: the dashboard and the rules carry names that do not depend on the release,
    so only the release that installs them owns them (Helm refuses a second owner); the others turn them off."""
    apis = ("monitoring.coreos.com/v1",)
    names = set()
    for release in ("vl7b-a", "vl7b-b"):
        objects = render(sets=("prometheusRule.enabled=true",), api_versions=apis, release=release)
        names.add(
            (
                find(objects, "ConfigMap", "-dashboard")["metadata"]["name"],
                find(objects, "PrometheusRule")["metadata"]["name"],
            )
        )
    assert names == {("mmcast-dashboard", "mmcast-rules")}
    off = render(sets=("dashboard.enabled=false",), api_versions=apis, release="vl7b-b")
    assert not {"ConfigMap", "PrometheusRule"} & {o["kind"] for o in off}


# --- the documented recipe ----------------------------------------------------------------------------------------


def test_deployment_doc_shows_the_scale_out_recipe_tested_here():
    doc = (CHART.parents[1] / "docs" / "DEPLOYMENT.md").read_text()
    recipe = SCALE_OUT.read_text()
    body = "\n".join(line for line in recipe.splitlines() if not line.startswith("#"))
    assert body in doc, "docs/DEPLOYMENT.md section 4 must show helm/mmcast/ci/scale-out-values.yaml as it is"
    assert "helm install vl7b helm/mmcast -n mmcast -f helm/mmcast/ci/scale-out-values.yaml" in doc
    assert "dns:///vl7b-mmcast-headless.mmcast.svc.cluster.local:50051" in doc
    assert yaml.safe_load(recipe)["replicaCount"] == 3

    objects = render((SCALE_OUT,), release="vl7b")
    group = find(objects, "StatefulSet", "-group")
    assert group["spec"]["replicas"] == 3, "N replicas"
    assert [c["name"] for c in pod_spec(group)["containers"]] == ["scheduler", "rank-0", "rank-1"], "one pod per group"
    svc = find(objects, "Service", "-headless")
    assert svc["metadata"]["name"] == "vl7b-mmcast-headless" and svc["spec"]["clusterIP"] == "None"
