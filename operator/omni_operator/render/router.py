"""The router's objects: its ServiceAccount, Role and RoleBinding (it follows the stages'
EndpointSlices, nothing else), its Deployment running ``omni-runtime router``, and the
Service that is the pipeline's endpoint."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omni_runtime.config import VIDEO_STORE_PASSWORD_ENV
from omni_runtime.config.credentials import CLIENT_FILES, KEYS_DIR_ENV
from omni_runtime.pod_contract import NAMESPACE_ENV

from ..placement import PlacementGroup
from .config import CONFIG_FILE
from .context import RenderContext
from .names import (
    group_object_name,
    router_object_name,
    router_service_name,
    selector,
    video_store_name,
)
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
from .secrets import API_KEYS_DIR, API_KEYS_FILE, STAGE_KEYS_DIR, api_keys_volume, stage_keys_volume
from .video_store import VIDEO_STORE_PASSWORD_KEY

ROUTER_CONTAINER = "router"


def router_rbac(ctx: RenderContext) -> list[dict[str, Any]]:
    name, labels = router_object_name(ctx.name), ctx.router_labels()
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": ctx.metadata(name, labels)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": ctx.metadata(name, labels),
            "rules": [
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": ctx.metadata(name, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ctx.namespace}],
        },
    ]


def router_service(ctx: RenderContext) -> dict[str, Any]:
    labels = ctx.router_labels()
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ctx.metadata(router_service_name(ctx.name), labels),
        "spec": {
            "type": ctx.spec.router.service_type,
            "selector": selector(labels),
            "ports": [
                {
                    "name": "http",
                    "port": ctx.spec.router.port,
                    "targetPort": "http",
                    "protocol": "TCP",
                }
            ],
        },
    }


def router_deployment(ctx: RenderContext, groups: Sequence[PlacementGroup]) -> dict[str, Any]:
    router = ctx.spec.router
    placement = merge_placements([router.placement], ctx.spec, ctx.default_image, gpu_count=0)
    args = ["router", "-f", CONFIG_FILE, "--port", str(router.port)]
    args += ["--discover-namespace", f"$({NAMESPACE_ENV})"]
    services = {i: group_object_name(ctx.name, group) for group in groups for i in group.stage_ids}
    for stage_id, service in sorted(services.items()):
        args += ["--stage-service", f"{stage_id}={service}"]
    secrets = [stage_keys_volume(ctx, CLIENT_FILES)]
    if router.api_key_secret_ref is not None:
        secrets.append(api_keys_volume(router.api_key_secret_ref))
        args += ["--api-key-file", f"{API_KEYS_DIR}/{API_KEYS_FILE}"]
    namespace_env = {
        "name": NAMESPACE_ENV,
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
    }
    env = [namespace_env, *home_env(), {"name": KEYS_DIR_ENV, "value": STAGE_KEYS_DIR}]
    password: tuple[str, str] | None = None
    if router.video_store is not None:
        password = (video_store_name(ctx.name), VIDEO_STORE_PASSWORD_KEY)
    elif (ref := router.video_store_password_secret_ref) is not None:
        password = (ref.name, ref.key)
    if password is not None:
        secret, key = password
        env.append(
            {
                "name": VIDEO_STORE_PASSWORD_ENV,
                "valueFrom": {"secretKeyRef": {"name": secret, "key": key}},
            }
        )
    container = runtime_container(
        ROUTER_CONTAINER,
        placement,
        args=args,
        env=env,
        ports=[{"name": "http", "containerPort": router.port, "protocol": "TCP"}],
        probes={
            # /health answers 503 until every stage has a live replica: not ready, alive.
            "readinessProbe": http_probe(
                "/health", "http", period=READINESS_PROBE_PERIOD_S, failures=3
            ),
            "livenessProbe": http_probe("/livez", "http", period=10, failures=3),
        },
        shm=False,
        secrets=secrets,
    )
    name = router_object_name(ctx.name)
    pod = pod_spec(ctx, placement, container, shm=False, service_account=name, secrets=secrets)
    return deployment_of(
        ctx, name, ctx.router_labels(), router.replicas, rollout_strategy(False), pod
    )
