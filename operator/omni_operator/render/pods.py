"""What every pod of a pipeline has in common: the merge of its components' placements,
the runtime container (security context, mounts, preStop, the drain timeout), the pod
spec and its grace period, and the Deployment and PodDisruptionBudget around it."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omni_runtime.pod_contract import (
    ANNOTATION_CONFIG_HASH,
    DEFAULT_DRAIN_TIMEOUT_S,
    DRAIN_TIMEOUT_ENV,
    REVISION_ENV,
    parse_drain_timeout,
)

from ..api import EnvVar, OmniPipelineSpec, Placement
from ..placement import (
    CONFIG_DIR,
    GPU_RESOURCE,
    HF_HOME_DIR,
    HOME_DIR,
    SHM_DIR,
    TMP_DIR,
    is_reserved_env,
)
from .context import RenderContext
from .names import config_map_name, selector
from .quantities import pod_resources
from .secrets import SecretVolume

# The runtime images run as this user (Dockerfile.runtime: USER 65532:65532).
RUNTIME_UID = 65532
PRESTOP_DELAY_S = 5
GRACE_MARGIN_S = 10
GPU_TOLERATION: dict[str, Any] = {
    "key": GPU_RESOURCE,
    "operator": "Exists",
    "effect": "NoSchedule",
}
# Short, so that a pod takes traffic (and a rollout moves on) within a moment of being
# able to: every pod a rollout replaces waits out what is left of a period. A probe is one
# local HTTP GET.
READINESS_PROBE_PERIOD_S = 2


@dataclass(frozen=True)
class PodPlacement:
    """The placements of a pod's components, merged into what one pod spec can say."""

    image: str
    image_pull_policy: str
    resources: dict[str, dict[str, str]]
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    affinity: dict[str, Any] | None
    env: list[dict[str, Any]]
    volumes: list[dict[str, Any]]
    volume_mounts: list[dict[str, Any]]


def merge_placements(
    placements: Sequence[Placement],
    spec: OmniPipelineSpec,
    default_image: str,
    *,
    gpu_count: int,
) -> PodPlacement:
    """The pod-level placement of ``placements`` (one pod's); ``default_image`` is the
    image for this pod's kind (GPU or CPU) when neither a placement nor the spec names one."""
    # check_spec refuses conflicting placements in one pod; the first one wins here.
    tolerations = [
        t.model_dump(mode="json", exclude_none=True) for p in placements for t in p.tolerations
    ]
    if gpu_count:
        tolerations.append(dict(GPU_TOLERATION))
    return PodPlacement(
        image=next((p.image for p in placements if p.image), spec.image or default_image),
        image_pull_policy=next(
            (p.image_pull_policy for p in placements if p.image_pull_policy),
            spec.image_pull_policy,
        ),
        resources=pod_resources(placements, gpu_count),
        node_selector=dict(
            sorted({k: v for p in reversed(placements) for k, v in p.node_selector.items()}.items())
        ),
        tolerations=_first_of_each(tolerations, lambda t: json.dumps(t, sort_keys=True)),
        affinity=copy.deepcopy(next((p.affinity for p in placements if p.affinity), None)),
        env=_first_of_each(
            # The operator's variables are not the placement's to set (see the docstring).
            [_env(var) for p in placements for var in p.env if not is_reserved_env(var.name)],
            lambda var: str(var["name"]),
        ),
        volumes=_first_of_each(
            [copy.deepcopy(volume) for p in placements for volume in p.volumes],
            lambda volume: str(volume.get("name")),
        ),
        volume_mounts=_first_of_each(
            [
                m.model_dump(mode="json", exclude_none=True)
                for p in placements
                for m in p.volume_mounts
            ],
            lambda mount: str(mount["mountPath"]),
        ),
    )


def _first_of_each(
    items: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], str]
) -> list[dict[str, Any]]:
    """``items`` in order, each key's first only."""
    seen: set[str] = set()
    result = []
    for item in items:
        if key(item) not in seen:
            seen.add(key(item))
            result.append(item)
    return result


def _env(var: EnvVar) -> dict[str, Any]:
    result: dict[str, Any] = {"name": var.name}
    if var.value_from is not None:
        result["valueFrom"] = copy.deepcopy(var.value_from)
    else:
        result["value"] = var.value or ""
    return result


def drain_timeout_s(env: Sequence[Mapping[str, Any]]) -> float:
    """The drain timeout a container's ``env`` gives its runtime, else the default;
    DrainTimeoutError for a value the runtime would refuse (``placement.check_spec``
    refuses the spec first)."""
    for var in env:
        if var.get("name") == DRAIN_TIMEOUT_ENV:
            return parse_drain_timeout(var.get("value"))
    return float(DEFAULT_DRAIN_TIMEOUT_S)


def grace_period_s(drain_timeout: float) -> int:
    """terminationGracePeriodSeconds for a pod whose runtime drains for ``drain_timeout``."""
    return PRESTOP_DELAY_S + math.ceil(drain_timeout) + GRACE_MARGIN_S


def home_env() -> list[dict[str, Any]]:
    return [{"name": "HOME", "value": HOME_DIR}, {"name": "HF_HOME", "value": HF_HOME_DIR}]


def http_probe(path: str, port: int | str, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def runtime_container(
    name: str,
    placement: PodPlacement,
    *,
    args: list[str],
    env: list[dict[str, Any]],
    ports: list[dict[str, Any]],
    probes: dict[str, Any],
    shm: bool,
    secrets: Sequence[SecretVolume] = (),
) -> dict[str, Any]:
    # The operator's variables win: a placement's copy of one is dropped (a duplicate
    # name in a container's env is refused by server-side apply).
    ours = {var["name"] for var in env}
    extra_env = [var for var in placement.env if var["name"] not in ours | {REVISION_ENV}]
    if not any(var["name"] == DRAIN_TIMEOUT_ENV for var in extra_env):
        env = [*env, {"name": DRAIN_TIMEOUT_ENV, "value": str(DEFAULT_DRAIN_TIMEOUT_S)}]
    mounts: list[dict[str, Any]] = [
        {"name": "omni-config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "omni-home", "mountPath": HOME_DIR},
        {"name": "omni-tmp", "mountPath": TMP_DIR},
    ]
    if shm:
        mounts.append({"name": "omni-shm", "mountPath": SHM_DIR})
    mounts += [
        {"name": secret.volume["name"], "mountPath": secret.mount_path, "readOnly": True}
        for secret in secrets
    ]
    container: dict[str, Any] = {
        "name": name,
        "image": placement.image,
        "imagePullPolicy": placement.image_pull_policy,
        "command": ["omni-runtime"],
        "args": args,
        "env": env + extra_env,
        "ports": ports,
        "volumeMounts": mounts + placement.volume_mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
        },
        # While it sleeps, the terminating pod leaves its EndpointSlices and those who
        # follow them stop sending it work; SIGTERM (the drain) comes after.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_DELAY_S}}},
        **probes,
    }
    if placement.resources:
        container["resources"] = placement.resources
    return container


def pod_spec(
    ctx: RenderContext,
    placement: PodPlacement,
    container: dict[str, Any],
    *,
    shm: bool,
    service_account: str | None,
    secrets: Sequence[SecretVolume] = (),
) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [
        {
            "name": "omni-config",
            "configMap": {"name": config_map_name(ctx.name, ctx.config_hash)},
        },
        {"name": "omni-home", "emptyDir": {}},
        {"name": "omni-tmp", "emptyDir": {}},
    ]
    if shm:
        volumes.append({"name": "omni-shm", "emptyDir": {"medium": "Memory"}})
    volumes += [secret.volume for secret in secrets]
    pod: dict[str, Any] = {
        "containers": [container],
        # Service links would put <SERVICE>_PORT variables of every Service in the
        # namespace into the environment, where they could shadow the runtime's OMNI_*.
        "enableServiceLinks": False,
        "automountServiceAccountToken": service_account is not None,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUNTIME_UID,
            "runAsGroup": RUNTIME_UID,
            "fsGroup": RUNTIME_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # Never SIGKILL a drain that is within its timeout.
        "terminationGracePeriodSeconds": grace_period_s(drain_timeout_s(container["env"])),
        "volumes": volumes + placement.volumes,
    }
    if service_account is not None:
        pod["serviceAccountName"] = service_account
    if placement.node_selector:
        pod["nodeSelector"] = placement.node_selector
    if placement.tolerations:
        pod["tolerations"] = placement.tolerations
    if placement.affinity is not None:
        pod["affinity"] = placement.affinity
    return pod


def deployment_of(
    ctx: RenderContext,
    name: str,
    labels: dict[str, str],
    replicas: int | None,
    strategy: dict[str, Any],
    pod: dict[str, Any],
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": ctx.metadata(name, labels),
        "spec": {
            **({"replicas": replicas} if replicas is not None else {}),
            "revisionHistoryLimit": 3,
            "strategy": strategy,
            "selector": {"matchLabels": selector(labels)},
            "template": {
                "metadata": {
                    "labels": dict(labels),
                    "annotations": {ANNOTATION_CONFIG_HASH: ctx.config_hash},
                },
                "spec": pod,
            },
        },
    }


def disruption_budget(ctx: RenderContext, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": ctx.metadata(name, labels),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(labels)}},
    }


def rollout_strategy(gpu: bool) -> dict[str, Any]:
    if gpu:
        # No spare GPUs for a surge pod: replace one pod at a time.
        return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}
