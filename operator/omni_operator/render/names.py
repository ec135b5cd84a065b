"""What the operator calls its children and how it labels them: object names cut to DNS
labels, label values, the labels and owner reference every child carries, the field
managers, and the kinds it creates. Pure string work; every module of the renderer and
the reconciler names objects through these."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omni_runtime.config.names import is_dns_1035_label

from ..api import API_VERSION, GROUP, KIND
from ..placement import PlacementGroup

FIELD_MANAGER = "omni-operator"
# The field manager of the replicas of autoscaled Deployments (autoscaler.py), kept apart
# from FIELD_MANAGER so that applying the rest of a Deployment never moves them.
REPLICAS_FIELD_MANAGER = "omni-operator-autoscaler"
# The operator's own pods (manifests/base/deployment.yaml), let through to read /metrics.
OPERATOR_POD_LABEL = "app.kubernetes.io/name"
OPERATOR_POD_LABEL_VALUE = "omni-operator"
MANAGED_BY = "omni-operator"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_PIPELINE = f"{GROUP}/pipeline"
LABEL_COMPONENT = f"{GROUP}/component"
LABEL_GROUP = f"{GROUP}/placement-group"
LABEL_STAGES = f"{GROUP}/stages"
COMPONENT_CONFIG = "config"
COMPONENT_STAGES = "stages"
COMPONENT_ROUTER = "router"
COMPONENT_STAGE_KEYS = "stage-keys"
COMPONENT_VIDEO_STORE = "video-store"
# Redis's own port: a managed video store's Service and pod listen on it.
VIDEO_STORE_PORT = 6379
_MAX_NAME = 63
_HASH_CHARS = 8
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


@dataclass(frozen=True)
class ChildKind:
    """A kind of object the operator creates for a pipeline, as its API lists them."""

    api_version: str
    kind: str
    plural: str


CHILD_KINDS: tuple[ChildKind, ...] = (
    ChildKind("v1", "ConfigMap", "configmaps"),
    ChildKind("v1", "Service", "services"),
    ChildKind("apps/v1", "Deployment", "deployments"),
    ChildKind("v1", "ServiceAccount", "serviceaccounts"),
    ChildKind("rbac.authorization.k8s.io/v1", "Role", "roles"),
    ChildKind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    ChildKind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    ChildKind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
)


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_CHARS]


def object_name(*parts: str) -> str:
    """``parts`` joined by '-' as an RFC 1035 label (what a Service name must be): as is
    when it is one, else cleaned, cut, and suffixed with a hash of the full name."""
    full = "-".join(parts)
    if len(full) <= _MAX_NAME and is_dns_1035_label(full):
        return full
    cleaned = re.sub(r"[^a-z0-9-]+", "-", full.lower()).strip("-")
    if not cleaned[:1].isalpha():
        cleaned = f"p-{cleaned}".rstrip("-")
    head = cleaned[: _MAX_NAME - _HASH_CHARS - 1].rstrip("-")
    return f"{head}-{_short_hash(full)}"


def label_value(text: str) -> str:
    """``text`` as a label value (at most 63 characters): cut and hashed when too long."""
    if len(text) <= _MAX_NAME and _LABEL_VALUE.fullmatch(text):
        return text
    cleaned = re.sub(r"[^-A-Za-z0-9_.]+", "-", text)
    head = cleaned[: _MAX_NAME - _HASH_CHARS - 1].strip("-_.")
    return f"{head}-{_short_hash(text)}" if head else _short_hash(text)


def config_map_name(pipeline: str, config_hash: str) -> str:
    """The ConfigMap of one configuration: named by its hash (see the module docstring)."""
    return object_name(pipeline, "config", config_hash)


def group_object_name(pipeline: str, group: PlacementGroup | str) -> str:
    """The Deployment, Service and PodDisruptionBudget of a placement group."""
    return object_name(pipeline, group if isinstance(group, str) else group.name)


def router_object_name(pipeline: str) -> str:
    """The router's Deployment, ServiceAccount, Role, RoleBinding and PodDisruptionBudget."""
    return object_name(pipeline, "router")


def router_service_name(pipeline: str) -> str:
    """The pipeline's endpoint Service: the pipeline's own name."""
    return object_name(pipeline)


def stage_keys_secret_name(pipeline: str) -> str:
    return object_name(pipeline, "stage-keys")


def video_store_name(pipeline: str) -> str:
    """A managed video store's Deployment, Service, NetworkPolicy and password Secret."""
    return object_name(pipeline, "video-store")


def video_store_url(pipeline: str) -> str:
    """Where the routers reach a managed video store: its Service's short name, which the
    pods' DNS search path resolves within the namespace (the ConfigMap need not name it)."""
    return f"redis://{video_store_name(pipeline)}:{VIDEO_STORE_PORT}/0"


def endpoint_url(name: str, namespace: str, port: int) -> str:
    """The in-cluster URL of pipeline ``name``'s router."""
    return f"http://{router_service_name(name)}.{namespace}.svc:{port}"


def object_key(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    """(apiVersion, kind, name): what identifies a child within its namespace."""
    return (str(obj["apiVersion"]), str(obj["kind"]), str(obj["metadata"]["name"]))


def child_labels(
    pipeline: str, component: str, group: PlacementGroup | None = None
) -> dict[str, str]:
    labels = {
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_PART_OF: label_value(pipeline),
        LABEL_PIPELINE: label_value(pipeline),
        LABEL_COMPONENT: component,
    }
    if group is not None:
        labels[LABEL_GROUP] = label_value(group.name)
        labels[LABEL_STAGES] = label_value(".".join(stage.name for stage in group.stages))
    return dict(sorted(labels.items()))


def child_metadata(
    pipeline: str, namespace: str, uid: str, name: str, labels: Mapping[str, str]
) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": dict(labels),
        "ownerReferences": [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": pipeline,
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def selector(labels: Mapping[str, str]) -> dict[str, str]:
    # Only what never changes for a Deployment's life: its selector is immutable.
    return {
        key: labels[key] for key in (LABEL_COMPONENT, LABEL_GROUP, LABEL_PIPELINE) if key in labels
    }
