"""The stage pods' readiness gate: when a revision is whole, and which pods it releases.

The pure rule (revision_gate.pods_to_release) and what the reconciler sends for it; the
real thing, on a real kubelet, is the config rollout of tests/cluster/test_end_to_end.py.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any, cast

import pytest
from test_reconciler import FakeKube, tiny_spec

from omni_operator.handlers import _quiet_watch_handlers
from omni_operator.reconciler import PipelineRef, Reconciler, parse_spec
from omni_operator.render import render
from omni_operator.render.config import config_data, config_hash
from omni_operator.render.names import LABEL_GROUP
from omni_operator.revision_gate import READINESS_GATE, StagePod, pods_to_release
from omni_runtime.kube import KubeClient
from omni_runtime.pod_contract import ANNOTATION_CONFIG_HASH


def pod(
    name: str,
    group: str,
    hash_: str = "new",
    *,
    ready: bool = True,
    released: bool = False,
    deleting: bool = False,
) -> StagePod:
    return StagePod(name, group, hash_, ready, released, deleting)


GROUPS = ["thinker", "dit"]


def test_nothing_is_released_until_every_group_has_a_ready_pod() -> None:
    pods = [pod("t1", "thinker"), pod("d1", "dit", ready=False)]
    assert pods_to_release(pods, "new", GROUPS) == []
    pods[1] = pod("d1", "dit")
    assert pods_to_release(pods, "new", GROUPS) == ["d1", "t1"]


def test_a_ready_pod_of_the_old_config_does_not_complete_the_new_one() -> None:
    pods = [pod("t1", "thinker"), pod("d0", "dit", "old", released=True)]
    assert pods_to_release(pods, "new", GROUPS) == []


def test_a_pod_being_deleted_does_not_count_and_is_not_released() -> None:
    pods = [pod("t1", "thinker"), pod("d1", "dit", deleting=True)]
    assert pods_to_release(pods, "new", GROUPS) == []
    pods.append(pod("d2", "dit"))
    assert pods_to_release(pods, "new", GROUPS) == ["d2", "t1"]


def test_a_whole_revision_releases_a_new_pod_at_once() -> None:
    # A scale-up or a replacement: the gate opens while it still loads, and its own
    # readiness probe (ContainersReady) decides when it takes traffic.
    pods = [pod("t1", "thinker", released=True), pod("d1", "dit", released=True)]
    assert pods_to_release(pods, "new", GROUPS) == []
    pods.append(pod("d2", "dit", ready=False))
    assert pods_to_release(pods, "new", GROUPS) == ["d2"]


def test_pods_of_other_configs_are_never_released() -> None:
    pods = [
        pod("t1", "thinker"),
        pod("d1", "dit"),
        pod("d0", "dit", "old"),  # not Ready yet when the spec changed again
    ]
    assert pods_to_release(pods, "new", GROUPS) == ["d1", "t1"]


def test_no_groups_releases_nothing() -> None:
    assert pods_to_release([pod("t1", "thinker")], "new", []) == []


def test_a_pod_body_is_read_as_the_gate_needs_it() -> None:
    body = {
        "metadata": {
            "name": "tiny-dit-7f9c-abcde",
            "labels": {LABEL_GROUP: "dit"},
            "annotations": {ANNOTATION_CONFIG_HASH: "h1"},
        },
        "status": {
            "conditions": [
                {"type": "ContainersReady", "status": "True"},
                {"type": "Ready", "status": "False"},
                {"type": READINESS_GATE, "status": "False"},
            ]
        },
    }
    read = StagePod.of(body, group_label=LABEL_GROUP, hash_annotation=ANNOTATION_CONFIG_HASH)
    assert read == StagePod("tiny-dit-7f9c-abcde", "dit", "h1", True, False, False)
    body["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    del body["status"]
    read = StagePod.of(body, group_label=LABEL_GROUP, hash_annotation=ANNOTATION_CONFIG_HASH)
    assert (read.containers_ready, read.released, read.deleting) == (False, False, True)


# ---------------------------------------------------------------- what the reconciler sends


class GateKube(FakeKube):
    def __init__(self) -> None:
        super().__init__()
        self.patched: list[tuple[str, dict[str, Any]]] = []

    async def patch_strategic(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self.patched.append((path, copy.deepcopy(dict(body))))
        return dict(body)


def pod_body(deployment: Mapping[str, Any], name: str, *, ready: bool) -> dict[str, Any]:
    """A pod as its Deployment's ReplicaSet would make it, with its containers' state."""
    template = deployment["spec"]["template"]
    return {
        "metadata": {"name": name, **copy.deepcopy(template["metadata"])},
        "status": {
            "conditions": [{"type": "ContainersReady", "status": "True" if ready else "False"}]
        },
    }


async def test_the_reconciler_patches_each_pod_of_a_whole_revision_through_its_status() -> None:
    kube = GateKube()
    reconciler = Reconciler(
        kube=cast(KubeClient, kube), default_image="img:1", default_gpu_image=""
    )
    ref = PipelineRef("tiny", "demo", "uid-1", 1)
    await reconciler.converge(ref, tiny_spec(), None, lambda *_: None)
    thinker = kube.objects[("Deployment", "tiny-thinker")]
    dit = kube.objects[("Deployment", "tiny-dit")]
    # Every stage pod carries the gate; the router's does not.
    for deployment in (thinker, dit):
        gates = deployment["spec"]["template"]["spec"]["readinessGates"]
        assert gates == [{"conditionType": READINESS_GATE}]
    router = kube.objects[("Deployment", "tiny-router")]
    assert "readinessGates" not in router["spec"]["template"]["spec"]

    pods = [pod_body(thinker, "t1", ready=True), pod_body(dit, "d1", ready=False)]
    await reconciler.release_revision(ref, pods, lambda *_: None)
    assert kube.patched == []

    pods[1] = pod_body(dit, "d1", ready=True)
    await reconciler.release_revision(ref, pods, lambda *_: None)
    assert [path for path, _ in kube.patched] == [
        "/api/v1/namespaces/demo/pods/d1/status",
        "/api/v1/namespaces/demo/pods/t1/status",
    ]
    (condition,) = kube.patched[0][1]["status"]["conditions"]
    assert (condition["type"], condition["status"]) == (READINESS_GATE, "True")
    assert condition["reason"] == "RevisionComplete"


async def test_nothing_is_released_for_a_pipeline_whose_spec_was_not_applied() -> None:
    kube = GateKube()
    reconciler = Reconciler(
        kube=cast(KubeClient, kube), default_image="img:1", default_gpu_image=""
    )
    spec = parse_spec(tiny_spec())
    objects = render("tiny", "demo", "uid-1", spec, default_image="img:1")
    pods = [
        pod_body(obj, f"p{i}", ready=True)
        for i, obj in enumerate(objects)
        if obj["kind"] == "Deployment"
    ]
    assert pods
    current = config_hash(config_data(spec, "tiny"))
    assert all(p["metadata"]["annotations"][ANNOTATION_CONFIG_HASH] == current for p in pods)
    await reconciler.release_revision(PipelineRef("tiny", "demo", "uid-1", 1), pods, print)
    assert kube.patched == []


@pytest.mark.parametrize("missing", ["thinker", "dit"])
def test_either_group_missing_holds_the_other(missing: str) -> None:
    pods = [pod(f"{g}1", g) for g in GROUPS if g != missing]
    assert pods_to_release(pods, "new", GROUPS) == []


# ------------------------------------------------------------------ the operator's log


@pytest.mark.parametrize(
    ("message", "kept"),
    [
        ("Handler 'stage_pod_changed' succeeded.", False),
        ("Handler 'deployment_changed' succeeded.", False),
        ("Handler 'ConfigMap-deleted' succeeded.", False),
        ("Handler 'converge' succeeded.", True),
        ("Handler 'stage_pod_changed' failed with an exception and will try again", True),
    ],
)
def test_the_watch_handlers_success_lines_are_dropped_and_nothing_else(
    message: str, kept: bool
) -> None:
    record = logging.LogRecord("kopf.objects", logging.INFO, __file__, 1, message, None, None)
    assert _quiet_watch_handlers(record) is kept
