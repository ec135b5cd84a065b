"""Smoke tests: the control plane the cluster tests rely on really works.

Each test exercises one component: the apiserver (CRD schema, CEL rules,
printer columns), the controller manager (deployments, endpoint slices,
garbage collection, jobs), the scheduler (extended resources) and kwok's
stages (pods become Running and Ready, job pods complete, deleted pods go).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    # Only for annotations: test modules get helpers through fixtures, which
    # works whatever import mode pytest runs with.
    from conftest import Kube

Eventually = Callable[..., Any]

NODE_KIND_LABEL = "omni-operator.test/node-kind"
CEL_MESSAGE = "minReplicas must not exceed maxReplicas"


def nodes_of_kind(kube: Kube, kind: str) -> list[str]:
    names = [
        n["metadata"]["name"]
        for n in kube.get_json("nodes", "-l", f"{NODE_KIND_LABEL}={kind}")["items"]
    ]
    if not names and not kube.local:
        pytest.skip(f"cluster has no node labelled {NODE_KIND_LABEL}={kind}")
    assert names, f"local control plane has no node labelled {NODE_KIND_LABEL}={kind}"
    return names


def widget_crd(group: str) -> dict[str, Any]:
    int_field = {"type": "integer", "minimum": 0}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {
                "plural": "widgets",
                "singular": "widget",
                "kind": "Widget",
                "listKind": "WidgetList",
            },
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["minReplicas", "maxReplicas"],
                                    "properties": {
                                        "minReplicas": int_field,
                                        "maxReplicas": int_field,
                                        "mode": {"type": "string", "default": "fast"},
                                    },
                                    "x-kubernetes-validations": [
                                        {
                                            "rule": "self.minReplicas <= self.maxReplicas",
                                            "message": CEL_MESSAGE,
                                        }
                                    ],
                                }
                            },
                        }
                    },
                    "additionalPrinterColumns": [
                        {"name": "Min", "type": "integer", "jsonPath": ".spec.minReplicas"},
                        {"name": "Max", "type": "integer", "jsonPath": ".spec.maxReplicas"},
                        {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
                    ],
                }
            ],
        },
    }


def widget(group: str, name: str, lo: int, hi: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{group}/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"minReplicas": lo, "maxReplicas": hi},
    }


def test_crd_cel_rule_and_printer_columns(
    kube: Kube, namespace: str, eventually: Eventually
) -> None:
    # A group of its own per run: CRDs are cluster-wide, and a shared cluster
    # may run this test twice at once.
    group = f"s{uuid.uuid4().hex[:8]}.smoke.omni-operator.test"
    crd = widget_crd(group)
    kube.apply(crd)
    try:
        kube.wait_crd_established(f"widgets.{group}", timeout=30)
        # Established is not yet "in kubectl's discovery"; wait for that too so
        # the rejection below cannot be a "no matches for kind" error.
        eventually(
            lambda: kube.kubectl("get", f"widgets.{group}", namespace=namespace),
            timeout=30,
            what="widgets served",
        )

        bad = kube.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps(widget(group, "bad", 5, 1)),
            namespace=namespace,
            check=False,
        )
        assert bad.returncode != 0, f"invalid widget was accepted: {bad.stdout}"
        assert CEL_MESSAGE in bad.stderr, bad.stderr
        missing = kube.kubectl("get", f"widgets.{group}", "bad", namespace=namespace, check=False)
        assert missing.returncode != 0, missing.stdout
        assert "NotFound" in missing.stderr, missing.stderr

        kube.apply(widget(group, "good", 1, 3), namespace=namespace)
        table = kube.kubectl("get", f"widgets.{group}", namespace=namespace).stdout
        header, *rows = [line.split() for line in table.strip().splitlines()]
        # With additionalPrinterColumns the table has exactly those after NAME.
        assert header == ["NAME", "MIN", "MAX", "MODE"], table
        # "fast" comes from the schema default, so the column shows defaulting too.
        assert rows == [["good", "1", "3", "fast"]], table
    finally:
        kube.kubectl("delete", "crd", f"widgets.{group}", "--wait=false", check=False)


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in pod.get("status", {}).get("conditions", [])
    )


def test_deployment_pods_run_on_cpu_node(
    kube: Kube, namespace: str, eventually: Eventually
) -> None:
    cpu_nodes = nodes_of_kind(kube, "cpu")
    labels = {"app": "smoke"}
    kube.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "smoke"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "nodeSelector": {NODE_KIND_LABEL: "cpu"},
                        # Never pulled: kwok only pretends to run containers.
                        "containers": [
                            {
                                "name": "main",
                                "image": "example.invalid/smoke:1",
                                "ports": [{"containerPort": 8080}],
                            }
                        ],
                    },
                },
            },
        },
        namespace=namespace,
    )
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "smoke"},
            "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": 8080}]},
        },
        namespace=namespace,
    )

    def deployment_ready() -> bool:
        status = kube.get_json("deployment", "smoke", namespace=namespace).get("status", {})
        assert status.get("readyReplicas") == 2, status
        assert status.get("availableReplicas") == 2, status
        return True

    eventually(deployment_ready, timeout=60)

    pods = kube.get_json("pods", "-l", "app=smoke", namespace=namespace)["items"]
    assert len(pods) == 2
    for pod in pods:
        assert pod["spec"]["nodeName"] in cpu_nodes
        assert pod["status"]["phase"] == "Running"
        assert pod_ready(pod)
        assert pod["status"].get("podIP")
        owner = pod["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "ReplicaSet", owner
        assert owner["name"].startswith("smoke-"), owner

    def slice_has_both_pods() -> bool:
        slices = kube.get_json(
            "endpointslices", "-l", "kubernetes.io/service-name=smoke", namespace=namespace
        )["items"]
        ready = {
            a
            for s in slices
            for ep in s.get("endpoints") or []
            if ep.get("conditions", {}).get("ready")
            for a in ep["addresses"]
        }
        assert ready == {p["status"]["podIP"] for p in pods}, slices
        return True

    eventually(slice_has_both_pods, timeout=30, what="EndpointSlice lists both pod IPs as ready")


def gpu_pod(name: str, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "example.invalid/gpu:1",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ]
        },
    }


def test_gpu_pod_lands_on_gpu_node(kube: Kube, namespace: str, eventually: Eventually) -> None:
    gpu_nodes = nodes_of_kind(kube, "gpu")
    for name in gpu_nodes:
        node = kube.get_json("node", name)
        assert node["status"]["allocatable"].get("nvidia.com/gpu") == "8", node["status"][
            "allocatable"
        ]
    for name in nodes_of_kind(kube, "cpu"):
        assert "nvidia.com/gpu" not in kube.get_json("node", name)["status"]["allocatable"]

    # No nodeSelector: only the scheduler's resource fit can pick the node.
    kube.apply(gpu_pod("gpu", 1), namespace=namespace)

    def running() -> dict[str, Any]:
        pod: dict[str, Any] = kube.get_json("pod", "gpu", namespace=namespace)
        assert pod["status"].get("phase") == "Running", pod["status"]
        assert pod_ready(pod), pod["status"]
        return pod

    pod = eventually(running, timeout=60)
    assert pod["spec"]["nodeName"] in gpu_nodes

    # More GPUs than any node has: must stay unscheduled, which shows the
    # placement above was a resource decision and not luck.
    kube.apply(gpu_pod("too-many", 9), namespace=namespace)

    def unschedulable() -> bool:
        pod = kube.get_json("pod", "too-many", namespace=namespace)
        scheduled = [c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"]
        assert scheduled, pod["status"]
        assert scheduled[0]["status"] == "False", scheduled
        assert scheduled[0].get("reason") == "Unschedulable", scheduled
        return True

    eventually(unschedulable, timeout=30)
    assert not kube.get_json("pod", "too-many", namespace=namespace)["spec"].get("nodeName")

    # A bound pod is only removed once its "kubelet" confirms; kwok's
    # pod-delete stage does that, or this delete would hang.
    kube.kubectl("delete", "pod", "gpu", "--timeout=30s", namespace=namespace)
    gone = kube.kubectl("get", "pod", "gpu", namespace=namespace, check=False)
    assert "NotFound" in gone.stderr, gone.stdout


def test_job_pod_completes(kube: Kube, namespace: str, eventually: Eventually) -> None:
    nodes_of_kind(kube, "cpu")
    kube.apply(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "once"},
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "nodeSelector": {NODE_KIND_LABEL: "cpu"},
                        "containers": [{"name": "main", "image": "example.invalid/job:1"}],
                    }
                },
            },
        },
        namespace=namespace,
    )

    def succeeded() -> bool:
        status = kube.get_json("job", "once", namespace=namespace).get("status", {})
        assert status.get("succeeded") == 1, status
        return True

    eventually(succeeded, timeout=60)
    pods = kube.get_json("pods", "-l", "job-name=once", namespace=namespace)["items"]
    assert [p["status"]["phase"] for p in pods] == ["Succeeded"]


def test_garbage_collector_deletes_owned_configmap(
    kube: Kube, namespace: str, eventually: Eventually
) -> None:
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "owner"},
            "data": {"role": "owner"},
        },
        namespace=namespace,
    )
    owner_uid = kube.get_json("configmap", "owner", namespace=namespace)["metadata"]["uid"]
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "owned",
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}
                ],
            },
            "data": {"role": "owned"},
        },
        namespace=namespace,
    )
    # Also a bystander without an owner: the collector must leave it alone.
    kube.apply(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bystander"}},
        namespace=namespace,
    )
    assert (
        kube.get_json("configmap", "owned", namespace=namespace)["metadata"]["ownerReferences"][0][
            "uid"
        ]
        == owner_uid
    )

    kube.kubectl("delete", "configmap", "owner", "--wait=true", namespace=namespace)

    def owned_gone() -> bool:
        res = kube.kubectl("get", "configmap", "owned", namespace=namespace, check=False)
        assert res.returncode != 0, f"still there: {res.stdout}"
        assert "NotFound" in res.stderr, res.stderr
        return True

    eventually(owned_gone, timeout=60, what="owned ConfigMap garbage-collected")
    kube.kubectl("get", "configmap", "bystander", namespace=namespace)


def test_nodes_keep_a_live_heartbeat(kube: Kube, eventually: Eventually) -> None:
    # Without renewed heartbeats the node lifecycle controller would take the nodes for
    # NotReady after its grace period and mark every pod on them not ready for good.
    if not kube.local:
        pytest.skip("only the local control plane's kwok nodes are known here")

    def heartbeats() -> dict[str, str]:
        return {
            node["metadata"]["name"]: next(
                c["lastHeartbeatTime"]
                for c in node["status"]["conditions"]
                if c["type"] == "Ready" and c["status"] == "True"
            )
            for node in kube.get_json("nodes")["items"]
        }

    first = heartbeats()
    assert first, "no Ready node"
    eventually(
        lambda: all(heartbeats()[name] > first[name] for name in first),
        timeout=60,
        interval=1,
        what="every node's Ready heartbeat renewed",
    )
