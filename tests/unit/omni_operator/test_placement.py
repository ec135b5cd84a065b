"""Unit tests of omni_operator.placement: placement groups and the checks that need them."""

from __future__ import annotations

import pytest

from omni_operator.api import OmniPipelineSpec
from omni_operator.placement import (
    check_spec,
    group_of,
    is_reserved_env,
    placement_groups,
)
from omni_runtime.config import MAX_STAGE_ID
from omni_runtime.pod_contract import DRAIN_TIMEOUT_ENV, REVISION_ENV
from pipeline_specs import spec_of, stage_of


def _messages(spec: OmniPipelineSpec) -> dict[str, str]:
    return dict(check_spec(spec))


# ---------------------------------------------------------------------- placement groups


def test_stages_sharing_a_gpu_transitively_form_one_group() -> None:
    # 0 and 2 share no GPU, but both share one with 1: one pod for all three.
    spec = spec_of([stage_of(0, "0,1"), stage_of(1, "1,2"), stage_of(2, "2"), stage_of(3, "3")])
    groups = placement_groups(spec)
    assert [g.stage_ids for g in groups] == [(0, 1, 2), (3,)]
    assert groups[0].gpu_ids == (0, 1, 2)
    assert groups[0].gpu_count == 3
    assert groups[0].name == "s0-s1-s2"
    assert groups[1].gpu_count == 1


def test_a_chain_joined_late_still_forms_one_group() -> None:
    # Stage 2 joins the groups of 0 and 1, which are apart until it comes.
    spec = spec_of([stage_of(0, "0"), stage_of(1, "1"), stage_of(2, "1,0")])
    assert [g.stage_ids for g in placement_groups(spec)] == [(0, 1, 2)]


def test_each_cpu_stage_is_a_group_of_its_own() -> None:
    spec = spec_of([stage_of(0), stage_of(1, ""), stage_of(2, "0")])
    groups = placement_groups(spec)
    assert [g.stage_ids for g in groups] == [(0,), (1,), (2,)]
    assert [g.gpu_count for g in groups] == [0, 0, 1]
    assert groups[0].visible_devices(groups[0].stages[0]) == ""


def test_groups_are_ordered_by_lowest_stage_id_whatever_the_spec_order() -> None:
    spec = spec_of([stage_of(3, "1"), stage_of(1, "0"), stage_of(2, "1"), stage_of(0)])
    groups = placement_groups(spec)
    assert [g.stage_ids for g in groups] == [(0,), (1,), (2, 3)]
    assert group_of(groups, 3) is groups[2]
    with pytest.raises(KeyError):
        group_of(groups, 9)


def test_visible_devices_are_renumbered_into_the_pods_gpus() -> None:
    # The pod sees its GPUs as 0..n-1 in ascending order of the ids in devices.
    spec = spec_of([stage_of(0, "5,2"), stage_of(1, "5"), stage_of(2, "7,2")])
    group = placement_groups(spec)[0]
    assert group.gpu_ids == (2, 5, 7)
    by_id = {stage.stage_id: group.visible_devices(stage) for stage in group.stages}
    assert by_id == {0: "1,0", 1: "1", 2: "2,0"}


def test_group_replicas_come_from_its_stages() -> None:
    spec = spec_of([stage_of(0, "0", replicas=3), stage_of(1, "0", replicas=3)])
    assert placement_groups(spec)[0].replicas == 3


# ---------------------------------------------------------------------------- check_spec


def test_a_deployable_spec_has_no_issues() -> None:
    spec = spec_of(
        [
            stage_of(0, "0", output="hidden_states"),
            stage_of(1, "0", type="diffusion", inputConnectors={"from_stage_0": "shm"}),
        ]
    )
    assert check_spec(spec) == []


def test_unequal_replicas_in_a_group_are_refused_with_both_counts() -> None:
    spec = spec_of([stage_of(0, "0,1", replicas=2), stage_of(1, "1", replicas=3)])
    message = _messages(spec)["stages[1].replicas"]
    assert "same replicas (2), not 3" in message
    assert "GPUs 0,1" in message


def test_shared_memory_between_groups_is_refused_naming_both_groups() -> None:
    spec = spec_of(
        [
            stage_of(0, "0"),
            stage_of(1, "1", type="diffusion", inputConnectors={"from_stage_0": "shm"}),
        ]
    )
    message = _messages(spec)["stages[1].inputConnectors.from_stage_0"]
    assert "SharedMemoryConnector" in message
    assert "'s0'" in message
    assert "'s1'" in message
    assert "TCPConnector" in message


def test_tcp_between_groups_is_fine() -> None:
    spec = spec_of(
        [stage_of(0), stage_of(1, type="diffusion", inputConnectors={"from_stage_0": "tcp"})]
    )
    assert check_spec(spec) == []


def test_gpu_resources_set_by_hand_are_refused() -> None:
    spec = spec_of(
        [stage_of(0, "0", placement={"resources": {"limits": {"nvidia.com/gpu": 2}}})],
        router={"placement": {"resources": {"requests": {"nvidia.com/gpu": 1}}}},
    )
    messages = _messages(spec)
    assert "set by the operator from devices" in messages["stages[0].placement.resources.limits"]
    assert "router.placement.resources.requests" in messages


@pytest.mark.parametrize(
    "name", ["HOME", "HF_HOME", "CUDA_VISIBLE_DEVICES", "OMNI_CUDA_VISIBLE_DEVICES_0"]
)
def test_the_operators_variables_cannot_be_set_in_env(name: str) -> None:
    spec = spec_of([stage_of(0, placement={"env": [{"name": "OK", "value": "1"}, {"name": name}]})])
    message = _messages(spec)["stages[0].placement.env[1].name"]
    assert f"{name} is set by the operator" in message
    assert "mount a volume at /var/lib/omni/hf" in message
    assert is_reserved_env(name)
    assert not is_reserved_env("HF_TOKEN")


def test_router_env_is_checked_too() -> None:
    spec = spec_of([stage_of(0)], router={"placement": {"env": [{"name": "OMNI_NAMESPACE"}]}})
    assert "router.placement.env[0].name" in _messages(spec)


def test_reserved_volume_names_and_mount_paths_are_refused() -> None:
    placement = {
        "volumes": [{"name": "omni-home", "emptyDir": {}}, {"name": "models", "emptyDir": {}}],
        "volumeMounts": [
            {"name": "models", "mountPath": "/tmp/"},
            {"name": "models", "mountPath": "/etc/omni/extra"},
            {"name": "models", "mountPath": "/var/lib/omni/hf"},
        ],
    }
    messages = _messages(spec_of([stage_of(0, placement=placement)]))
    assert "volume the operator adds" in messages["stages[0].placement.volumes[0].name"]
    assert (
        "/tmp/ is where the operator mounts"
        in messages["stages[0].placement.volumeMounts[0].mountPath"]
    )
    assert "stages[0].placement.volumeMounts[1].mountPath" in messages
    # Below the writable HOME is the documented place for a model cache.
    assert "stages[0].placement.volumeMounts[2].mountPath" not in messages


def test_a_mount_may_use_a_volume_of_another_stage_of_its_pod_but_not_an_unknown_one() -> None:
    spec = spec_of(
        [
            stage_of(0, "0", placement={"volumes": [{"name": "models", "emptyDir": {}}]}),
            stage_of(
                1,
                "0",
                placement={
                    "volumeMounts": [
                        {"name": "models", "mountPath": "/models"},
                        {"name": "cache", "mountPath": "/cache"},
                    ]
                },
            ),
        ]
    )
    messages = _messages(spec)
    assert list(messages) == ["stages[1].placement.volumeMounts[1].name"]
    assert "no volume named 'cache'" in messages["stages[1].placement.volumeMounts[1].name"]
    assert "declared: models" in messages["stages[1].placement.volumeMounts[1].name"]


def test_conflicting_placements_in_one_pod_are_refused() -> None:
    spec = spec_of(
        [
            stage_of(
                0,
                "0",
                placement={
                    "image": "a:1",
                    "imagePullPolicy": "Always",
                    "nodeSelector": {"zone": "a"},
                    "env": [{"name": "X", "value": "1"}],
                    "volumes": [{"name": "v", "emptyDir": {}}],
                    "volumeMounts": [{"name": "v", "mountPath": "/v"}],
                },
            ),
            stage_of(
                1,
                "0",
                placement={
                    "image": "b:1",
                    "imagePullPolicy": "Never",
                    "nodeSelector": {"zone": "b"},
                    "env": [{"name": "X", "value": "2"}],
                    "volumes": [{"name": "v", "emptyDir": {"medium": "Memory"}}],
                    "volumeMounts": [{"name": "v", "mountPath": "/v", "readOnly": True}],
                },
            ),
        ]
    )
    messages = _messages(spec)
    assert "its image must be s0's (a:1), not b:1" in messages["stages[1].placement.image"]
    assert (
        "imagePullPolicy must be s0's (Always)" in messages["stages[1].placement.imagePullPolicy"]
    )
    assert "zone=b conflicts with s0's a" in messages["stages[1].placement.nodeSelector"]
    assert "X differs from s0's" in messages["stages[1].placement.env"]
    assert "volume 'v' differs" in messages["stages[1].placement.volumes"]
    assert "/v is mounted differently" in messages["stages[1].placement.volumeMounts"]


def test_a_limit_on_some_stages_of_a_pod_only_is_refused() -> None:
    spec = spec_of(
        [
            stage_of(0, "0", placement={"resources": {"limits": {"memory": "8Gi"}}}),
            stage_of(1, "0", placement={"resources": {"requests": {"memory": "8Gi"}}}),
        ]
    )
    message = _messages(spec)["stages[1].placement.resources.limits"]
    assert "needs a memory limit too (s0 set one)" in message


def test_a_group_named_like_the_routers_objects_is_refused() -> None:
    spec = OmniPipelineSpec.model_validate(
        {"model": "m", "stages": [{"stageId": 0, "name": "router", "type": "llm"}]}
    )
    assert "router's" in _messages(spec)["stages[0].name"]


def test_two_groups_of_one_name_are_refused() -> None:
    # a-b + c and a + b-c both join to "a-b-c".
    names = ["a-b", "c", "a", "b-c"]
    devices = ["0", "0", "1", "1"]
    spec = OmniPipelineSpec.model_validate(
        {
            "model": "m",
            "stages": [
                stage_of(i, device, name=name)
                for i, (name, device) in enumerate(zip(names, devices, strict=True))
            ],
        }
    )
    message = _messages(spec)["stages[2].name"]
    assert "both named 'a-b-c'" in message


def test_a_stage_id_beyond_the_port_range_is_refused() -> None:
    fine = spec_of([stage_of(MAX_STAGE_ID)])
    assert check_spec(fine) == []
    message = _messages(spec_of([stage_of(MAX_STAGE_ID + 1)]))["stages[0].stageId"]
    assert "above 65535" in message
    assert f"ids up to {MAX_STAGE_ID}" in message


def test_the_pipeline_revision_cannot_be_set_in_env() -> None:
    # Routers compare it to keep a request on one configuration: a value set by hand
    # could pair an encoder and a DiT of two configurations.
    env = [{"name": "OMNI_PIPELINE_REVISION", "value": "999-forged"}]
    spec = spec_of([stage_of(0, placement={"env": env})], router={"placement": {"env": env}})
    messages = _messages(spec)
    for path in ("stages[0].placement.env[0].name", "router.placement.env[0].name"):
        assert "OMNI_PIPELINE_REVISION is set by the operator" in messages[path]
    assert is_reserved_env(REVISION_ENV)


@pytest.mark.parametrize("value", ["soon", "-1", "inf", "nan"])
def test_a_drain_timeout_the_runtime_would_refuse_is_refused(value: str) -> None:
    # The pods' grace period is sized from it, and the runtime refuses it at start.
    env = [{"name": DRAIN_TIMEOUT_ENV, "value": value}]
    spec = spec_of([stage_of(0, placement={"env": env})], router={"placement": {"env": env}})
    messages = _messages(spec)
    for path in ("stages[0].placement.env[0].value", "router.placement.env[0].value"):
        assert f"{DRAIN_TIMEOUT_ENV}={value!r}: expected seconds" in messages[path]


def test_a_drain_timeout_from_elsewhere_is_refused_and_a_number_is_not() -> None:
    from_elsewhere = {"name": DRAIN_TIMEOUT_ENV, "valueFrom": {"configMapKeyRef": {"name": "x"}}}
    messages = _messages(spec_of([stage_of(0, placement={"env": [from_elsewhere]})]))
    assert "must be a plain value" in messages["stages[0].placement.env[0].valueFrom"]
    plain = {"name": DRAIN_TIMEOUT_ENV, "value": "120"}
    assert _messages(spec_of([stage_of(0, placement={"env": [plain]})])) == {}


def _video(**router: object) -> OmniPipelineSpec:
    return spec_of(
        [{"stageId": 0, "name": "dit", "type": "diffusion"}], family="wan2.2", router=router
    )


def test_a_video_pipelines_router_replicas_need_a_shared_store() -> None:
    messages = _messages(_video(replicas=2))
    assert "router replicas of a video pipeline" in messages["router.videos.storeUrl"]
    assert _messages(_video(replicas=2, videos={"storeUrl": "redis://redis:6379/0"})) == {}
    assert _messages(_video(replicas=1)) == {}
    # An image pipeline's routers keep no jobs.
    assert "router.videos.storeUrl" not in _messages(spec_of([stage_of(0)], router={"replicas": 2}))


def test_a_managed_video_store_is_a_shared_store_and_stands_alone() -> None:
    assert _messages(_video(replicas=3, videoStore={})) == {}
    both = _messages(_video(videoStore={}, videos={"storeUrl": "redis://redis:6379/0"}))
    assert "not both" in both["router.videoStore"]
    password = _messages(_video(videoStore={}, videoStorePasswordSecretRef={"name": "auth"}))
    assert "the operator makes the password" in password["router.videoStorePasswordSecretRef"]
    # An image pipeline has no jobs to keep.
    image = _messages(spec_of([stage_of(0)], router={"videoStore": {}}))
    assert "makes no videos" in image["router.videoStore"]
    # Its objects are P-video-store: a placement group of that name would be one of them.
    group = _messages(spec_of([stage_of(0, name="video-store")]))
    assert "video-store" in group["stages[0].name"]
