"""Placement groups: which stages share a pod, and the checks that need the whole spec.

Stages whose ``devices`` share a GPU id (directly, or through other stages) form one
placement group: one Deployment whose pod requests ``nvidia.com/gpu`` = the number of
distinct ids and runs the group's stages in one container. Each stage's GPU ids are mapped
into the pod's own numbering (the device plugin shows a pod its GPUs as 0..n-1), which is
the ``CUDA_VISIBLE_DEVICES`` its engine sees. A CPU stage is a group of its own.

``check_spec`` refuses what the CRD admits but no pod could run: unequal replicas or
conflicting placements within a group, a shared-memory connector between groups, and
placements that would redefine the pod layout the renderer gives every pod (the paths,
volumes and variables below).

Pure functions only: the renderer and the operator's spec checks both use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omni_runtime.config.connectors import SHARED_MEMORY_CONNECTOR
from omni_runtime.config.stages import MAX_STAGE_ID, STAGE_PORT_BASE
from omni_runtime.pod_contract import (
    DRAIN_TIMEOUT_ENV,
    NAMESPACE_ENV,
    REVISION_ENV,
    STAGE_CUDA_DEVICES_ENV_PREFIX,
    DrainTimeoutError,
    parse_drain_timeout,
)

from .api import EnvVar, OmniPipelineSpec, Placement, StageAutoscaling, StageSpec

GPU_RESOURCE = "nvidia.com/gpu"
# What the operator assumes another autoscaler may scale a group to: enough to give the
# group a PodDisruptionBudget.
EXTERNAL_MAX_REPLICAS = 1000

# The pod layout the renderer gives every container (render/pods.py); a placement that redefined
# any of it would break the pod, so check_spec refuses that with the reason.
CONFIG_DIR = "/etc/omni"
HOME_DIR = "/var/lib/omni"
HF_HOME_DIR = f"{HOME_DIR}/hf"
TMP_DIR = "/tmp"
SHM_DIR = "/dev/shm"
RESERVED_VOLUMES = ("omni-config", "omni-home", "omni-tmp", "omni-shm")
RESERVED_MOUNT_PATHS = (CONFIG_DIR, HOME_DIR, TMP_DIR, SHM_DIR)
# Variables the operator sets in the containers: the runtime depends on their values.
# OMNI_PIPELINE_REVISION is what routers compare to keep a request on one configuration:
# a value set by hand would pair stages the operator keeps apart.
RESERVED_ENV = (
    "HOME",
    "HF_HOME",
    "CUDA_VISIBLE_DEVICES",
    NAMESPACE_ENV,
    REVISION_ENV,
)
RESERVED_ENV_PREFIXES = (STAGE_CUDA_DEVICES_ENV_PREFIX,)
# Object names a placement group must not take: the router's are P-router.
# The router's objects and a managed video store's are named P-router and P-video-store.
RESERVED_GROUP_NAMES = ("router", "video-store")


@dataclass(frozen=True)
class PlacementGroup:
    """Stages that run in one pod."""

    name: str
    stages: tuple[StageSpec, ...]
    # The distinct GPU ids of the group's stages, in ascending order; () for CPU.
    gpu_ids: tuple[int, ...]

    @property
    def stage_ids(self) -> tuple[int, ...]:
        return tuple(stage.stage_id for stage in self.stages)

    @property
    def gpu_count(self) -> int:
        return len(self.gpu_ids)

    @property
    def replicas(self) -> int:
        # Checked equal within a group (check_spec); the first stage speaks for all.
        return self.stages[0].replicas

    @property
    def autoscaling(self) -> StageAutoscaling | None:
        # Equal within a group, as replicas are.
        return self.stages[0].autoscaling

    @property
    def max_replicas(self) -> int:
        """The most replicas the group may run: unbounded (as far as the operator knows)
        where another autoscaler sets them."""
        scaling = self.autoscaling
        if scaling is None:
            return self.replicas
        if scaling.mode == "external" or scaling.max_replicas is None:
            return EXTERNAL_MAX_REPLICAS
        return scaling.max_replicas

    def visible_devices(self, stage: StageSpec) -> str:
        """``stage``'s CUDA_VISIBLE_DEVICES inside the pod: its ids, renumbered; "" on CPU."""
        index = {gpu: position for position, gpu in enumerate(self.gpu_ids)}
        return ",".join(str(index[gpu]) for gpu in stage.gpu_ids)


def placement_groups(spec: OmniPipelineSpec) -> list[PlacementGroup]:
    """The groups of ``spec``, ordered by their lowest stage id; stages by id within."""
    stages = sorted(spec.stages, key=lambda s: s.stage_id)
    parent = list(range(len(stages)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner_of_gpu: dict[int, int] = {}
    for i, stage in enumerate(stages):
        for gpu in stage.gpu_ids:
            if gpu in owner_of_gpu:
                parent[root(i)] = root(owner_of_gpu[gpu])
            else:
                owner_of_gpu[gpu] = i
    members: dict[int, list[StageSpec]] = {}
    for i, stage in enumerate(stages):
        members.setdefault(root(i), []).append(stage)
    groups = [
        PlacementGroup(
            name="-".join(stage.name for stage in group),
            stages=tuple(group),
            gpu_ids=tuple(sorted({gpu for stage in group for gpu in stage.gpu_ids})),
        )
        for group in members.values()
    ]
    return sorted(groups, key=lambda g: g.stage_ids[0])


def group_of(groups: Sequence[PlacementGroup], stage_id: int) -> PlacementGroup:
    """The group that runs stage ``stage_id``."""
    for group in groups:
        if stage_id in group.stage_ids:
            return group
    raise KeyError(stage_id)


def check_spec(spec: OmniPipelineSpec) -> list[tuple[str, str]]:
    """What the CRD's rules cannot see, as (field path, message); empty when deployable.

    The CRD checks pairs of stages; these need the placement groups, which may chain through
    several stages, the merge of a group's placements, and the pod layout of render/pods.py.
    """
    groups = placement_groups(spec)
    index = {stage.stage_id: i for i, stage in enumerate(spec.stages)}
    issues: list[tuple[str, str]] = []
    issues.extend(_group_names(groups, index))
    for group in groups:
        issues.extend(_unequal_replicas(group, index))
        issues.extend(_unequal_autoscaling(group, index))
        issues.extend(_placement_conflicts(group, index))
        issues.extend(_unknown_mounts(group, index))
    issues.extend(_shared_memory_across_groups(spec, groups, index))
    for i, stage in enumerate(spec.stages):
        if stage.stage_id > MAX_STAGE_ID:
            issues.append(
                (
                    f"stages[{i}].stageId",
                    f"stage id {stage.stage_id} would listen on port "
                    f"{STAGE_PORT_BASE + stage.stage_id} ({STAGE_PORT_BASE} + id), above 65535; "
                    f"use ids up to {MAX_STAGE_ID}",
                )
            )
        issues.extend(_reserved(stage.placement, f"stages[{i}].placement"))
    issues.extend(_planner_needs_open_metrics(spec))
    issues.extend(_video_store(spec))
    issues.extend(_reserved(spec.router.placement, "router.placement"))
    issues.extend(_unknown_router_mounts(spec.router.placement))
    return issues


def _group_names(groups: Sequence[PlacementGroup], index: dict[int, int]) -> list[tuple[str, str]]:
    # A group's objects are named P-<group>: two groups of one name, or one named like the
    # router's objects, would be one Deployment fought over by two pod templates.
    issues: list[tuple[str, str]] = []
    seen: dict[str, PlacementGroup] = {}
    for group in groups:
        path = f"stages[{index[group.stages[0].stage_id]}].name"
        if group.name in RESERVED_GROUP_NAMES:
            issues.append(
                (
                    path,
                    f"placement group {group.name!r} would share its object names "
                    f"(<pipeline>-{group.name}) with the router's; rename the stage",
                )
            )
        other = seen.setdefault(group.name, group)
        if other is not group:
            issues.append(
                (
                    path,
                    f"placement groups of stages {_ids(other.stage_ids)} and "
                    f"{_ids(group.stage_ids)} are both named {group.name!r} (stage names "
                    "joined by '-'); rename a stage so that the names differ",
                )
            )
    return issues


def _unequal_replicas(group: PlacementGroup, index: dict[int, int]) -> list[tuple[str, str]]:
    first = group.stages[0]
    return [
        (
            f"stages[{index[stage.stage_id]}].replicas",
            f"stage {stage.name!r} shares a placement group (GPUs "
            f"{_ids(group.gpu_ids)}) with {first.name!r}, so it must have the same "
            f"replicas ({first.replicas}), not {stage.replicas}",
        )
        for stage in group.stages[1:]
        if stage.replicas != first.replicas
    ]


def _unequal_autoscaling(group: PlacementGroup, index: dict[int, int]) -> list[tuple[str, str]]:
    first = group.stages[0]
    return [
        (
            f"stages[{index[stage.stage_id]}].autoscaling",
            f"stage {stage.name!r} shares a placement group (GPUs {_ids(group.gpu_ids)}) "
            f"with {first.name!r}, so they scale together: give them equal autoscaling",
        )
        for stage in group.stages[1:]
        if stage.autoscaling != first.autoscaling
    ]


def _planner_needs_open_metrics(spec: OmniPipelineSpec) -> list[tuple[str, str]]:
    # The planner reads the routers' /metrics; the operator holds no API key (it may not
    # read Secrets), so a router that wants one there would leave the planner blind.
    planned = any(s.autoscaling and s.autoscaling.mode == "planner" for s in spec.stages)
    router = spec.router
    if not (planned and router.api_key_secret_ref and router.metrics_need_api_key):
        return []
    return [
        (
            "router.metricsNeedApiKey",
            "the autoscaling planner reads the routers' /metrics without an API key; unset "
            "metricsNeedApiKey, or scale with mode external",
        )
    ]


def _video_store(spec: OmniPipelineSpec) -> list[tuple[str, str]]:
    # One store for the jobs, and one where several routers serve them: without a Redis
    # each router replica keeps its own jobs, and a client polling through the Service
    # would reach replicas that never heard of its job.
    router = spec.router
    store_url = router.videos is not None and router.videos.store_url is not None
    if router.video_store is not None:
        if spec.video_recipe is None:
            return [
                (
                    "router.videoStore",
                    "the pipeline makes no videos (its family has no video recipe): a video "
                    "store would hold nothing; remove videoStore",
                )
            ]
        if store_url:
            return [
                (
                    "router.videoStore",
                    "videos.storeUrl already names a Redis: set one of videoStore (a Redis "
                    "the operator runs) or videos.storeUrl (your own), not both",
                )
            ]
        if router.video_store_password_secret_ref is not None:
            return [
                (
                    "router.videoStorePasswordSecretRef",
                    "the operator makes the password of the Redis that videoStore runs; "
                    "videoStorePasswordSecretRef is for a Redis that videos.storeUrl names",
                )
            ]
        return []
    if spec.video_recipe is None or router.replicas <= 1 or store_url:
        return []
    return [
        (
            "router.videos.storeUrl",
            f"the {router.replicas} router replicas of a video pipeline answer for each "
            "other's jobs only through a shared store: set videoStore (a Redis the operator "
            "runs), or storeUrl (your own Redis), or run one router replica",
        )
    ]


def _shared_memory_across_groups(
    spec: OmniPipelineSpec, groups: Sequence[PlacementGroup], index: dict[int, int]
) -> list[tuple[str, str]]:
    issues: list[tuple[str, str]] = []
    for stage in spec.stages:
        for upstream_id, connector in stage.input_stages.items():
            config = spec.connectors.get(connector)
            if config is None or config.name != SHARED_MEMORY_CONNECTOR:
                continue
            if upstream_id not in index:
                continue
            ours, theirs = group_of(groups, stage.stage_id), group_of(groups, upstream_id)
            if ours is not theirs:
                issues.append(
                    (
                        f"stages[{index[stage.stage_id]}].inputConnectors.from_stage_{upstream_id}",
                        f"connector {connector!r} is a SharedMemoryConnector, which only works "
                        f"inside one pod, but stage {upstream_id} runs in placement group "
                        f"{theirs.name!r} and stage {stage.stage_id} in {ours.name!r}; give "
                        "both stages a common GPU in devices, or use a TCPConnector or "
                        "MooncakeTransferEngineConnector",
                    )
                )
    return issues


def is_reserved_env(name: str) -> bool:
    """Whether the operator sets ``name`` itself in the containers it renders."""
    return name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES)


def _reserved(placement: Placement, path: str) -> list[tuple[str, str]]:
    """Where ``placement`` would redefine what the operator sets in every pod."""
    issues: list[tuple[str, str]] = []
    for kind in ("requests", "limits"):
        if GPU_RESOURCE in getattr(placement.resources, kind):
            issues.append(
                (
                    f"{path}.resources.{kind}",
                    f"{GPU_RESOURCE} is set by the operator from devices; remove it",
                )
            )
    for j, var in enumerate(placement.env):
        if var.name == DRAIN_TIMEOUT_ENV:
            issues.extend(_drain_timeout(var, f"{path}.env[{j}]"))
        elif var.name == REVISION_ENV:
            issues.append(
                (
                    f"{path}.env[{j}].name",
                    f"{var.name} is set by the operator from the pipeline's generation and "
                    "config hash (routers keep each request on one revision); remove it",
                )
            )
        elif is_reserved_env(var.name):
            issues.append(
                (
                    f"{path}.env[{j}].name",
                    f"{var.name} is set by the operator (HOME={HOME_DIR}, "
                    f"HF_HOME={HF_HOME_DIR}, CUDA_VISIBLE_DEVICES from devices); to keep "
                    f"models elsewhere, mount a volume at {HF_HOME_DIR} instead",
                )
            )
    for j, volume in enumerate(placement.volumes):
        if volume.get("name") in RESERVED_VOLUMES:
            issues.append(
                (
                    f"{path}.volumes[{j}].name",
                    f"{volume.get('name')!r} is the name of a volume the operator adds; "
                    f"reserved: {', '.join(RESERVED_VOLUMES)}",
                )
            )
    for j, mount in enumerate(placement.volume_mounts):
        mount_path = mount.mount_path.rstrip("/") or "/"
        if mount_path in RESERVED_MOUNT_PATHS or mount_path.startswith(CONFIG_DIR + "/"):
            issues.append(
                (
                    f"{path}.volumeMounts[{j}].mountPath",
                    f"{mount.mount_path} is where the operator mounts its own volume "
                    f"({', '.join(RESERVED_MOUNT_PATHS)} are taken, and {CONFIG_DIR} is "
                    "read-only); mount below "
                    f"{HOME_DIR} or elsewhere",
                )
            )
    return issues


def _drain_timeout(var: EnvVar, path: str) -> list[tuple[str, str]]:
    # The pod's terminationGracePeriodSeconds is sized from this value (render/pods.py): one the
    # operator cannot read, it cannot honour, and the runtime would refuse a bad one at
    # start anyway.
    if var.value_from is not None:
        return [
            (
                f"{path}.valueFrom",
                f"{var.name} must be a plain value: the operator sizes the pod's "
                "terminationGracePeriodSeconds from it",
            )
        ]
    try:
        parse_drain_timeout(var.value)
    except DrainTimeoutError as e:
        return [(f"{path}.value", str(e))]
    return []


def _unknown_mounts(group: PlacementGroup, index: dict[int, int]) -> list[tuple[str, str]]:
    # One pod: a stage may mount a volume that another stage of its group declares.
    declared = {volume.get("name") for stage in group.stages for volume in stage.placement.volumes}
    return [
        (
            f"stages[{index[stage.stage_id]}].placement.volumeMounts[{j}].name",
            _unknown_mount_message(mount.name, declared),
        )
        for stage in group.stages
        for j, mount in enumerate(stage.placement.volume_mounts)
        if mount.name not in declared
    ]


def _unknown_router_mounts(placement: Placement) -> list[tuple[str, str]]:
    declared = {volume.get("name") for volume in placement.volumes}
    return [
        (f"router.placement.volumeMounts[{j}].name", _unknown_mount_message(mount.name, declared))
        for j, mount in enumerate(placement.volume_mounts)
        if mount.name not in declared
    ]


def _unknown_mount_message(name: str, declared: set[Any]) -> str:
    known = ", ".join(sorted(str(n) for n in declared)) or "none"
    return f"no volume named {name!r} in the pod's placement volumes (declared: {known})"


def _placement_conflicts(group: PlacementGroup, index: dict[int, int]) -> list[tuple[str, str]]:
    issues: list[tuple[str, str]] = []
    if len(group.stages) < 2:
        return issues
    first = group.stages[0]

    def conflict(stage: StageSpec, field: str, what: str) -> None:
        issues.append(
            (
                f"stages[{index[stage.stage_id]}].placement.{field}",
                f"stage {stage.name!r} runs in one pod with {first.name!r} (placement group "
                f"{group.name!r}), so {what}",
            )
        )

    for field, label in (("image", "image"), ("image_pull_policy", "imagePullPolicy")):
        owner: StageSpec | None = None
        for stage in group.stages:
            value = getattr(stage.placement, field)
            if value is None:
                continue
            if owner is not None and getattr(owner.placement, field) != value:
                theirs = getattr(owner.placement, field)
                conflict(
                    stage, label, f"its {label} must be {owner.name}'s ({theirs}), not {value}"
                )
            owner = owner or stage

    seen_selector: dict[str, tuple[str, str]] = {}
    seen_env: dict[str, tuple[str, object]] = {}
    seen_volume: dict[str, tuple[str, object]] = {}
    seen_mount: dict[str, tuple[str, object]] = {}
    affinity_owner: StageSpec | None = None
    for stage in group.stages:
        placement: Placement = stage.placement
        for key, value in placement.node_selector.items():
            if key in seen_selector and seen_selector[key][1] != value:
                owner_name, other = seen_selector[key]
                conflict(
                    stage, "nodeSelector", f"{key}={value} conflicts with {owner_name}'s {other}"
                )
            seen_selector.setdefault(key, (stage.name, value))
        for var in placement.env:
            this = var.value_from if var.value_from is not None else var.value
            if var.name in seen_env and seen_env[var.name][1] != this:
                conflict(
                    stage,
                    "env",
                    f"{var.name} differs from {seen_env[var.name][0]}'s (one container has "
                    "one environment)",
                )
            seen_env.setdefault(var.name, (stage.name, this))
        for volume in placement.volumes:
            name = str(volume.get("name"))
            if name in seen_volume and seen_volume[name][1] != volume:
                conflict(
                    stage,
                    "volumes",
                    f"volume {name!r} differs from {seen_volume[name][0]}'s (one pod has one "
                    "volume of a name)",
                )
            seen_volume.setdefault(name, (stage.name, volume))
        for mount in placement.volume_mounts:
            if mount.mount_path in seen_mount and seen_mount[mount.mount_path][1] != mount:
                conflict(
                    stage,
                    "volumeMounts",
                    f"{mount.mount_path} is mounted differently by "
                    f"{seen_mount[mount.mount_path][0]} (one container has one mount there)",
                )
            seen_mount.setdefault(mount.mount_path, (stage.name, mount))
        if placement.affinity is not None:
            if affinity_owner is not None and affinity_owner.placement.affinity != (
                placement.affinity
            ):
                conflict(stage, "affinity", f"it must equal {affinity_owner.name}'s affinity")
            affinity_owner = affinity_owner or stage
    issues.extend(_partial_limits(group, index, first))
    return issues


def _partial_limits(
    group: PlacementGroup, index: dict[int, int], first: StageSpec
) -> list[tuple[str, str]]:
    # The pod's limit is the sum of its stages' limits, so a stage without one would be
    # squeezed under its neighbours' (and OOM-killed with them): all or none.
    limited = {resource for stage in group.stages for resource in stage.placement.resources.limits}
    issues: list[tuple[str, str]] = []
    for resource in sorted(limited - {GPU_RESOURCE}):
        having = [s.name for s in group.stages if resource in s.placement.resources.limits]
        for stage in group.stages:
            if resource not in stage.placement.resources.limits:
                issues.append(
                    (
                        f"stages[{index[stage.stage_id]}].placement.resources.limits",
                        f"stage {stage.name!r} runs in one pod with {first.name!r} (placement "
                        f"group {group.name!r}), whose limit is the sum of its stages', so it "
                        f"needs a {resource} limit too ({', '.join(having)} set one), or "
                        "none of them may",
                    )
                )
    return issues


def _ids(ids: Sequence[int]) -> str:
    return ",".join(map(str, ids))
