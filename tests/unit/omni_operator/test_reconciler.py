"""What the operator refuses beyond the CRD, and how it says so (reconciler.parse_spec)."""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from omni_operator.reconciler import (
    PipelineRef,
    Reconciler,
    SpecRefused,
    config_generation,
    parse_spec,
)
from omni_operator.render.names import CHILD_KINDS, COMPONENT_STAGES, LABEL_COMPONENT
from omni_runtime.config.credentials import KEY_FILES
from omni_runtime.kube import KubeClient
from omni_runtime.pod_contract import ANNOTATION_CONFIG_HASH, REVISION_ENV
from omni_runtime.router.revisions import revision_key

TINY = Path(__file__).resolve().parents[3] / "manifests" / "examples" / "tiny-pipeline.yaml"


def tiny_spec() -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load(TINY.read_text())["spec"]
    return spec


def test_the_tiny_example_is_accepted() -> None:
    spec = parse_spec(tiny_spec())
    assert [stage.name for stage in spec.stages] == ["thinker", "dit"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda s: s["stages"][0]["placement"]["resources"]["requests"].update(cpu="lots"),
            "spec.stages[0].placement.resources.requests.cpu: 'lots' is not a Kubernetes quantity",
        ),
        (
            lambda s: s["stages"][1].update(devices="gpu0"),
            "spec.stages[1].devices: expected 'cpu'",
        ),
        (
            # Both stages on GPU 0 form one pod, so their replicas must agree.
            lambda s: [
                s["stages"][0].update(devices="0"),
                s["stages"][1].update(devices="0", replicas=2),
            ],
            "spec.stages[1].replicas: stage 'dit' shares a placement group",
        ),
        (
            lambda s: s["stages"][0]["placement"].update(env=[{"name": "HOME", "value": "/x"}]),
            "spec.stages[0].placement.env",
        ),
        (
            # What the CRD's rule cannot see (a stage's type from its model's topology) is
            # refused here, as SpecValid=False, by the same check the runtime makes.
            lambda s: [
                s["stages"][0].update(devices="0", gpuMemoryUtilization=0.6),
                s["stages"][1].update(devices="0", gpuMemoryUtilization=0.6),
            ],
            "spec.stages: GPU 0 is over-subscribed: the gpuMemoryUtilization of the stages on "
            "it sum to 1.2, more than 1 (thinker (stages[0]) 0.6, dit (stages[1]) 0.6)",
        ),
        (
            # The CRD's rules sum GPU ids 0-15 only.
            lambda s: [
                s["stages"][0].update(devices="16", gpuMemoryUtilization=0.6),
                s["stages"][1].update(devices="16", gpuMemoryUtilization=0.6),
            ],
            "spec.stages: GPU 16 is over-subscribed",
        ),
    ],
)
def test_a_refused_spec_names_the_field_under_spec(change: Any, expected: str) -> None:
    spec = copy.deepcopy(tiny_spec())
    change(spec)
    with pytest.raises(SpecRefused) as info:
        parse_spec(spec)
    assert expected in str(info.value)


# ------------------------------------------------------------- revisions across converges


class FakeKube:
    """What converge needs of KubeClient: apply stores the object, list returns the
    pipeline's children of one kind (by the path's plural), delete drops one."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.versions = itertools.count(1)

    async def apply(self, obj: Mapping[str, Any], *, field_manager: str) -> dict[str, Any]:
        stored = copy.deepcopy(dict(obj))
        stored["metadata"]["resourceVersion"] = str(next(self.versions))
        self.objects[(stored["kind"], stored["metadata"]["name"])] = stored
        return copy.deepcopy(stored)

    async def create(self, obj: Mapping[str, Any]) -> bool:
        key = (obj["kind"], obj["metadata"]["name"])
        if key in self.objects:
            return False
        self.objects[key] = copy.deepcopy(dict(obj))
        return True

    async def list(self, path: str, *, label_selector: str | None = None) -> dict[str, Any]:
        plural = path.rsplit("/", 1)[-1]
        kind = next(k.kind for k in CHILD_KINDS if k.plural == plural)
        items = [copy.deepcopy(o) for (k, _), o in self.objects.items() if k == kind]
        return {"items": items}

    async def delete(self, path: str, *, propagation: str = "Background") -> bool:
        name = path.rsplit("/", 1)[-1]
        found = [key for key in self.objects if key[1] == name]
        for key in found:
            del self.objects[key]
        return bool(found)

    async def patch_merge(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return dict(body)


async def test_the_stage_keys_secret_is_made_once_and_kept() -> None:
    kube = FakeKube()
    spec = tiny_spec()
    await _converge(kube, spec, generation=1)
    secret = kube.objects[("Secret", "tiny-stage-keys")]
    keys = dict(secret["stringData"])
    assert sorted(keys) == sorted(KEY_FILES)
    await _converge(kube, spec, generation=2)
    assert kube.objects[("Secret", "tiny-stage-keys")]["stringData"] == keys
    # No key in any object the renderer applies (ConfigMap, env values, args).
    rendered = json.dumps([o for (kind, _), o in kube.objects.items() if kind != "Secret"])
    assert not any(value in rendered for value in keys.values())


async def test_a_managed_video_stores_password_is_made_once_and_kept() -> None:
    kube = FakeKube()
    spec = {
        "model": "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
        "stages": [{"stageId": 0, "name": "dit", "type": "diffusion"}],
        "router": {"replicas": 2, "videoStore": {}},
    }
    await _converge(kube, spec, generation=1)
    first = dict(kube.objects[("Secret", "tiny-video-store")]["stringData"])
    assert first["redis.conf"] == f"requirepass {first['password']}\n"
    assert len(first["password"]) == 64
    await _converge(kube, spec, generation=2)
    assert kube.objects[("Secret", "tiny-video-store")]["stringData"] == first
    assert ("Deployment", "tiny-video-store") in kube.objects
    # In no object the renderer applies.
    rendered = json.dumps([o for (kind, _), o in kube.objects.items() if kind != "Secret"])
    assert first["password"] not in rendered


def _revisions(kube: FakeKube) -> dict[str, str]:
    """Deployment name -> its pods' OMNI_PIPELINE_REVISION (stage pods only carry one)."""
    found = {}
    for (kind, name), obj in kube.objects.items():
        if kind != "Deployment":
            continue
        (container,) = obj["spec"]["template"]["spec"]["containers"]
        for var in container.get("env", []):
            if var["name"] == REVISION_ENV:
                found[name] = var["value"]
    return found


async def _converge(kube: FakeKube, spec: dict[str, Any], generation: int) -> dict[str, str]:
    reconciler = Reconciler(
        kube=cast(KubeClient, kube), default_image="img:1", default_gpu_image=""
    )
    ref = PipelineRef("tiny", "demo", "uid-1", generation)
    await reconciler.converge(ref, spec, None, lambda *_: None)
    return _revisions(kube)


async def test_each_new_config_orders_after_the_last_and_a_scale_change_keeps_its_number() -> None:
    kube = FakeKube()
    spec = tiny_spec()
    first = await _converge(kube, spec, generation=3)
    assert set(first) == {"tiny-thinker", "tiny-dit"}
    (revision,) = set(first.values())
    assert revision.startswith("3-")

    # A scale change bumps the generation but not the config: the pods must not roll.
    scaled = copy.deepcopy(spec)
    scaled["stages"][1]["replicas"] = 2
    assert await _converge(kube, scaled, generation=4) == first
    # Nor does converging again, as after an operator restart (a fresh Reconciler).
    assert await _converge(kube, scaled, generation=4) == first

    changed = copy.deepcopy(scaled)
    changed["stages"][1]["defaultSamplingParams"]["seed"] = 7
    after = await _converge(kube, changed, generation=5)
    (new,) = set(after.values())
    assert new.startswith("5-")
    assert new.split("-", 1)[1] != revision.split("-", 1)[1]
    assert revision_key(new) > revision_key(revision)

    # Back to the first config: a new revision again, newest of all, not the old number.
    back = await _converge(kube, scaled, generation=6)
    assert set(back.values()) == {f"6-{revision.split('-', 1)[1]}"}


def _stage_deployment(config_hash: str, revision: str | None) -> dict[str, Any]:
    env = [] if revision is None else [{"name": REVISION_ENV, "value": revision}]
    return {
        "kind": "Deployment",
        "metadata": {"name": "p-s0", "labels": {LABEL_COMPONENT: COMPONENT_STAGES}},
        "spec": {
            "template": {
                "metadata": {"annotations": {ANNOTATION_CONFIG_HASH: config_hash}},
                "spec": {"containers": [{"name": "stages", "env": env}]},
            }
        },
    }


@pytest.mark.parametrize(
    ("children", "expected"),
    [
        ([], 9),  # a new pipeline
        ([_stage_deployment("abc", "4-abc")], 4),  # the same config: its number stays
        ([_stage_deployment("old", "4-old")], 9),  # another config: the generation now
        ([_stage_deployment("abc", None)], 9),  # no number to keep
        ([_stage_deployment("abc", "4-other")], 9),  # a number given with another hash
        ([_stage_deployment("abc", "x-abc")], 9),
    ],
)
def test_config_generation_keeps_the_number_only_of_the_same_config(
    children: list[dict[str, Any]], expected: int
) -> None:
    assert config_generation("abc", children, generation=9) == expected


def test_the_router_deployment_gives_no_number() -> None:
    router = _stage_deployment("abc", "4-abc")
    router["metadata"]["labels"][LABEL_COMPONENT] = "router"
    assert config_generation("abc", [router], generation=9) == 9


async def test_what_is_remembered_of_a_pipeline_goes_with_it() -> None:
    reconciler = Reconciler(
        kube=cast(KubeClient, FakeKube()), default_image="img:1", default_gpu_image=""
    )
    ref = PipelineRef("tiny", "demo", "uid-1", 1)
    # A lock taken for a pipeline not converged yet does not make it known.
    reconciler.lock(PipelineRef("other", "demo", "uid-2", 1))
    await reconciler.converge(ref, tiny_spec(), None, lambda *_: None)
    reconciler.set_scaling(ref, {}, {"tiny-thinker": 1}, {})
    assert reconciler.known("demo", "tiny") == ref
    assert reconciler.known_refs() == [ref]
    assert reconciler.count() == 1
    assert reconciler.applied_spec("demo", "tiny") is not None
    reconciler.forget("demo", "tiny")
    assert reconciler.known("demo", "tiny") is None
    assert reconciler.applied_spec("demo", "tiny") is None
    assert reconciler.count() == 0
