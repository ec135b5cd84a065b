"""A placement group's objects: its headless Service (one port per stage, whose
EndpointSlices the router follows) and its Deployment, whose pod runs ``omni-runtime
stage`` for the group's stages in one container."""

from __future__ import annotations

from typing import Any

from omni_runtime.config import stage_port, stage_port_name
from omni_runtime.config.connectors import SHARED_MEMORY_CONNECTOR
from omni_runtime.config.credentials import KEYS_DIR_ENV, SERVER_FILES
from omni_runtime.pod_contract import HEALTH_PORT, REVISION_ENV, STAGE_CUDA_DEVICES_ENV_PREFIX

from ..api import OmniPipelineSpec
from ..placement import PlacementGroup
from ..revision_gate import READINESS_GATE
from .config import CONFIG_FILE, pipeline_revision
from .context import RenderContext
from .names import group_object_name, selector
from .pods import (
    READINESS_PROBE_PERIOD_S,
    deployment_of,
    home_env,
    http_probe,
    merge_placements,
    pod_spec,
    rollout_strategy,
    runtime_container,
)
from .secrets import STAGE_KEYS_DIR, stage_keys_volume

STAGE_CONTAINER = "stages"
# How long one stage of a pod may take to load its model (a 7B checkpoint fetched from the
# hub can take many minutes); the pod's startup probe allows that for each of its stages.
STAGE_STARTUP_TIMEOUT_S = 840
# Short periods, so that a pod takes traffic (and a rollout moves on) within a moment of
# being able to: every pod a rollout replaces waits out what is left of a period, twice
# (startup, then readiness). A probe is one local HTTP GET.
_STARTUP_PROBE_PERIOD_S = 2


def group_service(ctx: RenderContext, group: PlacementGroup) -> dict[str, Any]:
    labels = ctx.group_labels(group)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ctx.metadata(group_object_name(ctx.name, group), labels),
        "spec": {
            # Headless: the router picks replicas itself, from the EndpointSlices.
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": selector(labels),
            "ports": [
                {
                    "name": stage_port_name(stage_id),
                    "port": stage_port(stage_id),
                    "targetPort": stage_port(stage_id),
                    "protocol": "TCP",
                }
                for stage_id in group.stage_ids
            ],
        },
    }


def group_deployment(ctx: RenderContext, group: PlacementGroup) -> dict[str, Any]:
    labels = ctx.group_labels(group)
    placement = merge_placements(
        [stage.placement for stage in group.stages],
        ctx.spec,
        ctx.default_gpu_image if group.gpu_count else ctx.default_image,
        gpu_count=group.gpu_count,
    )
    shm = _needs_shm(group, ctx.spec)
    secrets = [stage_keys_volume(ctx, SERVER_FILES)]
    ports = [
        {"name": stage_port_name(i), "containerPort": stage_port(i), "protocol": "TCP"}
        for i in group.stage_ids
    ]
    container = runtime_container(
        STAGE_CONTAINER,
        placement,
        args=_stage_args(group),
        env=[
            *_stage_env(group),
            {
                "name": REVISION_ENV,
                "value": pipeline_revision(ctx.config_generation, ctx.config_hash),
            },
            {"name": KEYS_DIR_ENV, "value": STAGE_KEYS_DIR},
        ],
        ports=[*ports, {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"}],
        probes=_stage_probes(len(group.stages)),
        shm=shm,
        secrets=secrets,
    )
    pod = pod_spec(ctx, placement, container, shm=shm, service_account=None, secrets=secrets)
    # Ready (traffic, and the rollout's progress) waits until this pod's revision has a
    # ready pod in every placement group: see revision_gate.py.
    pod["readinessGates"] = [{"conditionType": READINESS_GATE}]
    name = group_object_name(ctx.name, group)
    replicas = None if group.autoscaling is not None else group.replicas
    return deployment_of(ctx, name, labels, replicas, rollout_strategy(group.gpu_count > 0), pod)


def _stage_args(group: PlacementGroup) -> list[str]:
    args = ["stage", "-f", CONFIG_FILE, "--stages", ",".join(map(str, group.stage_ids))]
    for stage_id in group.stage_ids:
        args += ["--port", f"{stage_id}={stage_port(stage_id)}"]
    return [
        *args,
        "--health-port",
        str(HEALTH_PORT),
        "--startup-timeout",
        str(STAGE_STARTUP_TIMEOUT_S),
    ]


def _stage_env(group: PlacementGroup) -> list[dict[str, Any]]:
    env = home_env()
    if not group.gpu_count:
        # No GPU in the pod: CUDA libraries in the image see none rather than probe for one.
        return [*env, {"name": "CUDA_VISIBLE_DEVICES", "value": ""}]
    return env + [
        {
            "name": f"{STAGE_CUDA_DEVICES_ENV_PREFIX}{stage.stage_id}",
            "value": group.visible_devices(stage),
        }
        for stage in group.stages
    ]


def _stage_probes(stages: int) -> dict[str, Any]:
    # The probe port opens once every stage has loaded its model, one stage after the
    # other. The window is a minute beyond the stage process's own startup timeouts, so
    # that a stage that cannot start exits saying why rather than being killed unheard.
    window = STAGE_STARTUP_TIMEOUT_S * stages + 60
    return {
        "startupProbe": http_probe(
            "/livez",
            "health",
            period=_STARTUP_PROBE_PERIOD_S,
            failures=-(-window // _STARTUP_PROBE_PERIOD_S),
        ),
        "livenessProbe": http_probe("/livez", "health", period=10, failures=3),
        "readinessProbe": http_probe(
            "/readyz", "health", period=READINESS_PROBE_PERIOD_S, failures=3
        ),
    }


def _needs_shm(group: PlacementGroup, spec: OmniPipelineSpec) -> bool:
    """Whether the group's pod needs a real /dev/shm (a container's default is 64 MiB)."""
    ids = set(group.stage_ids)
    for stage in group.stages:
        # vLLM's workers of one engine talk through shared memory.
        if stage.tensor_parallel_size * stage.data_parallel_size > 1:
            return True
        for upstream, connector in stage.input_stages.items():
            config = spec.connectors.get(connector)
            if upstream in ids and config is not None and config.name == SHARED_MEMORY_CONNECTOR:
                return True
    return False
