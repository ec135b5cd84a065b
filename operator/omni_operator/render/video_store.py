"""A managed video store (``router.videoStore``): the Redis where the pipeline's router
replicas share their video jobs, run by the operator beside them.

Objects, all named ``P-video-store``: a Deployment of one Redis pod, its ClusterIP Service
(the routers' ``videos.storeUrl``, render/config.py), and a NetworkPolicy that lets only
the pipeline's router pods reach it. Its password is a Secret of the same name that the
reconciler creates once (secrets.py), as it does the stage keys.

Decisions:

- One replica, replaced by Recreate: two Redis pods behind one Service would split the
  jobs between them, and two on one volume would corrupt its file.
- No config hash on the pod template: a pipeline change must not restart the store and
  drop what it holds. The pod changes only when ``videoStore`` does.
- Append-only file on (fsync every second), on the claim the pipeline names or an
  emptyDir: with a claim the jobs outlive the pod; without one they still outlive a
  container restart (an OOM kill, a failed liveness probe).
- ``maxmemory`` is three quarters of the pod's memory, with ``noeviction``: Redis refuses
  writes past it (the routers answer 503) rather than evicting a job or a video nobody has
  fetched, and the rest of the memory is its own overhead and the append-only file's
  rewrite (a fork).
- The password reaches redis-server as a config file from the Secret, never as an
  argument (which the pod spec and /proc would show).
"""

from __future__ import annotations

import secrets
from decimal import Decimal
from typing import Any

from ..api import VideoStoreSpec
from .context import RenderContext
from .names import (
    COMPONENT_VIDEO_STORE,
    VIDEO_STORE_PORT,
    selector,
    video_store_name,
)
from .pods import RUNTIME_UID
from .quantities import read_quantity
from .secrets import credentials_secret

VIDEO_STORE_CONFIG_KEY = "redis.conf"
VIDEO_STORE_PASSWORD_KEY = "password"
_CONFIG_DIR = "/etc/omni/video-store"
_DATA_DIR = "/data"
# Redis's share of the pod's memory; the rest is its overhead (see the module docstring).
_MAXMEMORY_SHARE = Decimal(3) / Decimal(4)


def video_store_objects(ctx: RenderContext) -> list[dict[str, Any]]:
    """The managed video store's objects, or none when the pipeline names no videoStore."""
    store = ctx.spec.router.video_store
    if store is None:
        return []
    return [_service(ctx), _deployment(ctx, store), _network_policy(ctx)]


def video_store_secret(name: str, namespace: str, uid: str, password: str) -> dict[str, Any]:
    """The Secret of pipeline ``name``'s managed video store: the password the routers
    send, and the redis.conf that sets it. Like the stage keys (secrets.py), not among
    ``render``'s objects: the reconciler creates it once and never applies it again, as a
    new password would lock every router out; immutable and owned by the pipeline."""
    data = {
        VIDEO_STORE_PASSWORD_KEY: password,
        # Only the password; the rest is in the pod's arguments.
        VIDEO_STORE_CONFIG_KEY: f"requirepass {password}\n",
    }
    return credentials_secret(
        name, namespace, uid, video_store_name(name), COMPONENT_VIDEO_STORE, data
    )


def generate_video_store_password() -> str:
    # Hex: nothing a redis.conf line would need quoted.
    return secrets.token_hex(32)


def maxmemory_bytes(memory: int | str) -> int | None:
    """Redis's maxmemory for a pod of ``memory`` (a quantity); None when it does not parse
    (the apiserver then refuses the Deployment's limit, and says why)."""
    read = read_quantity(memory)
    if read is None:
        return None
    return int(read.value * _MAXMEMORY_SHARE)


def _service(ctx: RenderContext) -> dict[str, Any]:
    labels = ctx.labels(COMPONENT_VIDEO_STORE)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ctx.metadata(video_store_name(ctx.name), labels),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(labels),
            "ports": [
                {
                    "name": "redis",
                    "port": VIDEO_STORE_PORT,
                    "targetPort": "redis",
                    "protocol": "TCP",
                }
            ],
        },
    }


def _deployment(ctx: RenderContext, store: VideoStoreSpec) -> dict[str, Any]:
    labels = ctx.labels(COMPONENT_VIDEO_STORE)
    name = video_store_name(ctx.name)
    args = [
        f"{_CONFIG_DIR}/{VIDEO_STORE_CONFIG_KEY}",
        "--port", str(VIDEO_STORE_PORT),
        "--dir", _DATA_DIR,
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        # No snapshots: the append-only file is the one copy on disk.
        "--save", "",
        "--maxmemory-policy", "noeviction",
    ]  # fmt: skip
    if (maxmemory := maxmemory_bytes(store.memory)) is not None:
        args += ["--maxmemory", str(maxmemory)]
    tcp = {"tcpSocket": {"port": "redis"}}
    container: dict[str, Any] = {
        "name": "redis",
        "image": store.image,
        "imagePullPolicy": store.image_pull_policy or ctx.spec.image_pull_policy,
        # Not the image's entrypoint: the official one changes owners as root first.
        "command": ["redis-server", *args],
        "ports": [{"name": "redis", "containerPort": VIDEO_STORE_PORT, "protocol": "TCP"}],
        "readinessProbe": {**tcp, "periodSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {**tcp, "periodSeconds": 10, "failureThreshold": 3},
        "resources": {
            "requests": {"cpu": str(store.cpu), "memory": str(store.memory)},
            "limits": {"memory": str(store.memory)},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": _CONFIG_DIR, "readOnly": True},
            {"name": "data", "mountPath": _DATA_DIR},
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
        },
    }
    data: dict[str, Any] = (
        {"persistentVolumeClaim": {"claimName": store.persistent_volume_claim}}
        if store.persistent_volume_claim is not None
        else {"emptyDir": {}}
    )
    pod: dict[str, Any] = {
        "containers": [container],
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUNTIME_UID,
            "runAsGroup": RUNTIME_UID,
            "fsGroup": RUNTIME_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumes": [
            {
                "name": "config",
                "secret": {
                    "secretName": name,
                    "items": [{"key": VIDEO_STORE_CONFIG_KEY, "path": VIDEO_STORE_CONFIG_KEY}],
                    "defaultMode": 0o440,
                },
            },
            {"name": "data", **data},
        ],
    }
    if store.node_selector:
        pod["nodeSelector"] = dict(store.node_selector)
    if store.tolerations:
        pod["tolerations"] = [
            t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in store.tolerations
        ]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": ctx.metadata(name, labels),
        "spec": {
            "replicas": 1,
            "revisionHistoryLimit": 3,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector(labels)},
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
        },
    }


def _network_policy(ctx: RenderContext) -> dict[str, Any]:
    labels = ctx.labels(COMPONENT_VIDEO_STORE)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": ctx.metadata(video_store_name(ctx.name), labels),
        "spec": {
            "podSelector": {"matchLabels": selector(labels)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": selector(ctx.router_labels())}}],
                    "ports": [{"protocol": "TCP", "port": VIDEO_STORE_PORT}],
                }
            ],
        },
    }
