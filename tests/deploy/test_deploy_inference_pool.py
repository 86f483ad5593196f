"""The chart's Gateway API Inference Extension objects (inferencePool.enabled): an InferencePool over the groups and
the endpoint picker that reads mmcast's metric names, checked offline.

The pool is validated against tests/deploy/schemas/inferencepool.inference.networking.k8s.io-v1.json (the v1 API's
schema, vendored; kubernetes-validate knows only core kinds) and the picker's objects by kubernetes-validate --strict
(test_deploy_helm.py's `inference-pool` value set). Here: off by default, the pool selects exactly the pods that
serve the OpenAI API on its target port, its picker reference resolves to the picker's Service, and every metric
the picker is told to read is one the scheduler exports with the labels the protocol reads.
"""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from scripts.metrics_doc import exported_families
from tests.support.deploy_tools import CI_VALUES, SCHEMAS, container, find, flags, pod_spec, render

POOL_SCHEMA = SCHEMAS / "inferencepool.inference.networking.k8s.io-v1.json"
ON = ("inferencePool.enabled=true",)
SCALE_OUT = (CI_VALUES / "scale-out-values.yaml",)
PICKER_KINDS = {"InferencePool", "Role", "RoleBinding"}
# The picker's metric flags -> the labels of that metric it reads (the model-server protocol).
METRIC_FLAGS = {
    "total-queued-requests-metric": (),
    "total-running-requests-metric": (),
    "kv-cache-usage-percentage-metric": (),
    "lora-info-metric": ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
    "cache-info-metric": ("block_size", "num_gpu_blocks"),
}


def test_off_by_default():
    kinds = {o["kind"] for o in render(SCALE_OUT)}
    assert not kinds & PICKER_KINDS, kinds
    assert not [o for o in render(SCALE_OUT) if o["metadata"]["name"].endswith("-epp")]


def test_the_pool_selects_the_groups_that_serve_the_openai_api():
    objects = render(SCALE_OUT, sets=ON)
    pool = find(objects, "InferencePool")
    jsonschema.validate(pool, json.loads(POOL_SCHEMA.read_text()))
    group = find(objects, "StatefulSet", "-group")
    labels = group["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items(), (selector, labels)
    picker = find(objects, "Deployment", "-epp")
    assert not selector.items() <= picker["spec"]["template"]["metadata"]["labels"].items()  # never its own pod
    http = {p["name"]: p["containerPort"] for p in container(group, "scheduler")["ports"]}["http"]
    assert pool["spec"]["targetPorts"] == [{"number": http}]
    ref = pool["spec"]["endpointPickerRef"]
    service = find(objects, "Service", "-epp")
    assert (ref["kind"], ref["name"]) == ("Service", service["metadata"]["name"])
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    assert service["spec"]["selector"].items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    assert pod_spec(picker)["serviceAccountName"] == find(objects, "RoleBinding")["subjects"][0]["name"]


def test_the_picker_reads_metrics_the_scheduler_exports():
    objects = render(SCALE_OUT, sets=ON)
    picker_flags = flags(container(find(objects, "Deployment", "-epp"), "epp"))
    exported = {f.name: f for f in exported_families() if "scheduler" in f.services}
    for flag, labels in METRIC_FLAGS.items():
        name = picker_flags[flag]
        assert name in exported, f"--{flag}={name} is not a scheduler metric"
        assert exported[name].type == "gauge" and exported[name].labels == labels, exported[name]
    scheduler = container(find(objects, "StatefulSet", "-group"), "scheduler")
    metrics_port = {p["name"]: p["containerPort"] for p in scheduler["ports"]}["metrics"]
    assert picker_flags["model-server-metrics-port"] == str(metrics_port)
    pool = find(objects, "InferencePool")
    assert picker_flags["pool-name"] == pool["metadata"]["name"]
    assert picker_flags["pool-namespace"] == pool["metadata"]["namespace"]


@pytest.mark.parametrize("change", ["no port", "two target ports", "unknown failure mode", "bad label value"])
def test_the_vendored_schema_rejects_what_the_crd_rejects(change):
    pool = find(render(SCALE_OUT, sets=ON), "InferencePool")
    schema = json.loads(POOL_SCHEMA.read_text())
    jsonschema.validate(pool, schema)
    bad = copy.deepcopy(pool)
    if change == "no port":
        del bad["spec"]["endpointPickerRef"]["port"]  # a Service referent needs its port
    elif change == "two target ports":
        bad["spec"]["targetPorts"].append({"number": 9})
    elif change == "unknown failure mode":
        bad["spec"]["endpointPickerRef"]["failureMode"] = "FailSoft"
    else:
        bad["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] = "-not a label-"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
