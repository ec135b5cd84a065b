"""The pipeline's NetworkPolicies: who may reach its stage and router pods."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..placement import PlacementGroup
from .context import RenderContext
from .names import (
    COMPONENT_STAGES,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_PIPELINE,
    MANAGED_BY,
    OPERATOR_POD_LABEL,
    OPERATOR_POD_LABEL_VALUE,
    label_value,
    object_name,
    router_object_name,
    selector,
)


def network_policies(ctx: RenderContext, groups: Sequence[PlacementGroup]) -> list[dict[str, Any]]:
    """Who may reach the pipeline's pods (defence in depth: the stage sockets authenticate
    their peers either way, and only a network plugin that enforces NetworkPolicies
    applies these).

    - Stage pods: any port, but only from the pipeline's own pods: its routers (stage
      requests) and its stage pods (connector pulls, whose ports a pipeline may leave to
      the system to pick).
    - Router pods: the router's port, from ``router.allowedFrom`` (default: the pods of
      the pipeline's namespace), and from the operator's pods where a stage uses the
      planner (it reads /metrics) and the operator's namespace is known.

    Egress is not restricted: stages may need to reach model stores.
    """
    own_pods = {
        "podSelector": {
            "matchLabels": {
                LABEL_MANAGED_BY: MANAGED_BY,
                LABEL_PIPELINE: label_value(ctx.name),
            }
        }
    }
    stage_selector = {LABEL_COMPONENT: COMPONENT_STAGES, LABEL_PIPELINE: label_value(ctx.name)}
    router = ctx.spec.router
    allowed = router.allowed_from if router.allowed_from is not None else [{"podSelector": {}}]
    planned = any(g.autoscaling and g.autoscaling.mode == "planner" for g in groups)
    if planned and ctx.operator_namespace is not None:
        allowed = [*allowed, _operator_pods(ctx.operator_namespace)]
    policies = [
        _network_policy(
            ctx,
            object_name(ctx.name, "stages"),
            ctx.labels(COMPONENT_STAGES),
            stage_selector,
            [{"from": [own_pods]}],
        ),
        _network_policy(
            ctx,
            router_object_name(ctx.name),
            ctx.router_labels(),
            selector(ctx.router_labels()),
            [{"from": allowed, "ports": [{"protocol": "TCP", "port": router.port}]}],
        ),
    ]
    return policies if groups else policies[1:]


def _operator_pods(namespace: str) -> dict[str, Any]:
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "podSelector": {"matchLabels": {OPERATOR_POD_LABEL: OPERATOR_POD_LABEL_VALUE}},
    }


def _network_policy(
    ctx: RenderContext,
    name: str,
    labels: Mapping[str, str],
    selector: Mapping[str, str],
    ingress: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": ctx.metadata(name, labels),
        "spec": {
            "podSelector": {"matchLabels": dict(selector)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
