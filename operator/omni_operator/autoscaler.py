"""The autoscaling planner's I/O: read the routers, plan, scale the Deployments.

One ``tick`` per pipeline every ``interval`` seconds (handlers.py runs it):

1. find every router replica: the ready endpoints of the router Service's EndpointSlices;
2. read each one's /metrics (at once, each within ``SCRAPE_TIMEOUT_S``);
3. turn two rounds of those into each stage's load (router_load.py);
4. ask the policy (planner.py) what each planner-mode placement group needs;
5. set the replicas of the groups whose need changed, with server-side apply under a
   field manager of their own (``REPLICAS_FIELD_MANAGER``): the operator's apply of the
   rest of the Deployment leaves them out, so neither moves the other's fields;
6. say why, per stage: in the status (the reconciler writes it) and in an Event for each
   change.

Groups in mode ``external`` are only reported: their replicas are another autoscaler's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from omni_runtime.kube import KubeApiError, KubeClient, object_path
from omni_runtime.pod_contract import (
    deployment_is_ready,
    deployment_ready_replicas,
    endpoint_is_ready,
)

from .api import OmniPipelineSpec, StageAutoscaling, StageScalingStatus
from .placement import PlacementGroup, placement_groups
from .planner import (
    Autoscaling,
    Decision,
    GroupState,
    LatencyObjective,
    Memory,
    StageObservation,
    plan,
)
from .render.names import REPLICAS_FIELD_MANAGER, group_object_name, router_service_name
from .router_load import MetricsError, RouterScrape, observe, parse_router_metrics

logger = logging.getLogger("omni_operator")

# How often the planner looks, unless $OMNI_PLANNER_INTERVAL_SECONDS says otherwise: the
# HPA's default sync period.
DEFAULT_INTERVAL_S = 15.0
SCRAPE_TIMEOUT_S = 3.0
DEFAULT_TARGET_IN_FLIGHT = 1.0
DEFAULT_SCALE_DOWN_WINDOW_S = 300
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

# Posts a Kubernetes Event about the pipeline: (type Normal|Warning, reason, message).
EventSink = Callable[[str, str, str], None]


@dataclass(frozen=True)
class RouterEndpoint:
    """One router replica, as its Service's EndpointSlices show it."""

    key: str
    url: str


def settings_of(scaling: StageAutoscaling) -> Autoscaling:
    """The policy's settings for a planner-mode ``scaling``, its defaults filled in."""
    assert scaling.max_replicas is not None  # the CRD and StageAutoscaling require it
    target = scaling.target_in_flight
    if target is None and scaling.latency_objective is None:
        target = DEFAULT_TARGET_IN_FLIGHT
    objective = scaling.latency_objective
    return Autoscaling(
        min_replicas=scaling.min_replicas or 1,
        max_replicas=scaling.max_replicas,
        target_in_flight=target,
        scale_up_window_s=float(scaling.scale_up_window_seconds or 0),
        scale_down_window_s=float(
            DEFAULT_SCALE_DOWN_WINDOW_S
            if scaling.scale_down_window_seconds is None
            else scaling.scale_down_window_seconds
        ),
        latency=(
            LatencyObjective(objective.percentile, objective.seconds)
            if objective is not None
            else None
        ),
    )


def initial_replicas(group: PlacementGroup, live: int | None) -> int:
    """What an autoscaled group's Deployment should have when the operator (re)applies it:
    what it runs now, else the stage's replicas; within min/max in mode planner."""
    scaling = group.autoscaling
    assert scaling is not None
    wanted = live if live is not None else group.replicas
    if scaling.mode == "external":
        return wanted
    settings = settings_of(scaling)
    return min(max(wanted, settings.min_replicas), settings.max_replicas)


def router_endpoints(slices: Sequence[Mapping[str, Any]]) -> list[RouterEndpoint]:
    """The ready router replicas in ``slices`` (EndpointSlices of the router Service)."""
    found: dict[str, RouterEndpoint] = {}
    for body in slices:
        if body.get("addressType") not in ("IPv4", "IPv6"):
            continue
        ports = [p for p in body.get("ports") or [] if p.get("port")]
        port = next((p["port"] for p in ports if p.get("name") == "http"), None)
        if port is None and ports:
            port = ports[0]["port"]
        if port is None:
            continue
        for endpoint in body.get("endpoints") or []:
            if not endpoint_is_ready(endpoint):
                continue
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            host = addresses[0]
            if body.get("addressType") == "IPv6":
                host = f"[{host}]"
            target = endpoint.get("targetRef") or {}
            key = str(target.get("name") or addresses[0])
            found[key] = RouterEndpoint(key, f"http://{host}:{port}/metrics")
    return sorted(found.values(), key=lambda e: e.key)


@dataclass(frozen=True)
class TickResult:
    """What the status should say: per stage (by name), and the Deployments scaled up
    whose new pods are not all ready yet, with the replicas they had (status.py)."""

    stages: dict[str, StageScalingStatus]
    scaled_up_from: dict[str, int]
    # Per Deployment: the generation the planner's last scale gave it. Until the
    # Deployment controller has observed it, that change is a scale, not a rollout.
    scaled_generations: dict[str, int]


@dataclass
class _PipelineState:
    scrapes: dict[str, RouterScrape] = field(default_factory=dict)
    memory: Memory = field(default_factory=Memory)
    last_scale: dict[str, str] = field(default_factory=dict)
    scaled_up_from: dict[str, int] = field(default_factory=dict)
    scaled_generations: dict[str, int] = field(default_factory=dict)
    unreachable: frozenset[str] = frozenset()


@dataclass
class Autoscaler:
    """The planner's loop state for every pipeline; one per operator process."""

    kube: KubeClient
    http: httpx.AsyncClient
    clock: Callable[[], float] = time.monotonic
    _pipelines: dict[tuple[str, str], _PipelineState] = field(default_factory=dict)

    def forget(self, namespace: str, name: str) -> None:
        self._pipelines.pop((namespace, name), None)

    async def tick(
        self,
        namespace: str,
        name: str,
        spec: OmniPipelineSpec,
        deployments: Mapping[str, Mapping[str, Any]],
        event: EventSink,
    ) -> TickResult:
        """Look once and act; returns what to report.

        ``deployments`` are the pipeline's Deployments as last seen, by name."""
        groups = [g for g in placement_groups(spec) if g.autoscaling is not None]
        statuses: dict[str, StageScalingStatus] = {}
        planned: list[PlacementGroup] = []
        for group in groups:
            live = _replicas(deployments.get(group_object_name(name, group)))
            scaling = group.autoscaling
            assert scaling is not None
            if scaling.mode == "external":
                why = f"replicas are another autoscaler's (now {live if live is not None else '?'})"
                for stage in group.stages:
                    statuses[stage.name] = StageScalingStatus(mode="external", reason=why)
            else:
                planned.append(group)
        if not planned:
            self.forget(namespace, name)
            return TickResult(statuses, {}, {})
        state = self._pipelines.setdefault((namespace, name), _PipelineState())
        scrapes, complete = await self._scrape(namespace, name, state, event)
        before, state.scrapes = state.scrapes, scrapes
        stage_names = [stage.name for group in planned for stage in group.stages]
        observations, whole = observe(stage_names, before, scrapes)
        by_stage = {o.stage: o for o in observations}
        now = self.clock()
        group_states = []
        for group in planned:
            body = deployments.get(group_object_name(name, group))
            replicas = _replicas(body)
            if body is None or replicas is None:
                # Not made yet (or not seen yet): converge gives it its first replicas.
                continue
            scaling = group.autoscaling
            assert scaling is not None
            group_states.append(
                GroupState(
                    group=group.name,
                    replicas=replicas,
                    settings=settings_of(scaling),
                    stages=[by_stage.get(s.name, _idle(s.name)) for s in group.stages],
                    complete=complete and whole and bool(scrapes),
                    ready_replicas=deployment_ready_replicas(body),
                )
            )
        decisions, state.memory = plan(group_states, now, state.memory)
        for decision in decisions:
            group = next(g for g in planned if g.name == decision.group)
            deployment = group_object_name(name, group)
            if deployment_is_ready(deployments.get(deployment)):
                state.scaled_up_from.pop(deployment, None)
            if decision.desired != decision.current:
                generation = await self._scale(namespace, name, group, decision, event)
                state.scaled_generations[deployment] = generation
                state.last_scale[group.name] = _now()
                if decision.desired > decision.current:
                    state.scaled_up_from.setdefault(deployment, decision.current)
                else:
                    state.scaled_up_from.pop(deployment, None)
            for stage in group.stages:
                statuses[stage.name] = StageScalingStatus(
                    mode="planner",
                    desired_replicas=decision.desired,
                    reason=decision.reason,
                    last_scale_time=state.last_scale.get(group.name),
                )
        return TickResult(statuses, dict(state.scaled_up_from), dict(state.scaled_generations))

    async def _scrape(
        self, namespace: str, name: str, state: _PipelineState, event: EventSink
    ) -> tuple[dict[str, RouterScrape], bool]:
        """Every router replica's /metrics now, and whether each one answered."""
        listed = await self.kube.list(
            object_path("discovery.k8s.io/v1", "endpointslices", namespace),
            label_selector=f"{SERVICE_NAME_LABEL}={router_service_name(name)}",
        )
        endpoints = router_endpoints(listed.get("items", []))
        results = await asyncio.gather(*(self._read(e) for e in endpoints))
        scrapes = {
            e.key: r for e, r in zip(endpoints, results, strict=True) if isinstance(r, RouterScrape)
        }
        failed = {e.key: r for e, r in zip(endpoints, results, strict=True) if isinstance(r, str)}
        unreachable = frozenset(failed)
        newly = unreachable - state.unreachable
        if newly:
            detail = "; ".join(f"{key}: {failed[key]}" for key in sorted(newly))
            event(
                "Warning",
                "MetricsUnreadable",
                f"the planner could not read router /metrics ({detail}); it will not scale "
                "down until it can",
            )
        state.unreachable = unreachable
        return scrapes, not failed and bool(endpoints)

    async def _read(self, endpoint: RouterEndpoint) -> RouterScrape | str:
        try:
            response = await self.http.get(endpoint.url, timeout=SCRAPE_TIMEOUT_S)
        except httpx.HTTPError as e:
            return f"{endpoint.url}: {type(e).__name__}: {e}"
        at = self.clock()
        if response.status_code != 200:
            return f"{endpoint.url}: HTTP {response.status_code}"
        try:
            return RouterScrape(at, parse_router_metrics(response.text))
        except MetricsError as e:
            return f"{endpoint.url}: {e}"

    async def _scale(
        self,
        namespace: str,
        name: str,
        group: PlacementGroup,
        decision: Decision,
        event: EventSink,
    ) -> int:
        """Set the group's replicas; returns the Deployment's generation after."""
        deployment = group_object_name(name, group)
        try:
            body = await set_replicas(
                self.kube, namespace, deployment, decision.desired, force=True
            )
        except KubeApiError as e:
            event("Warning", "ScaleFailed", f"Deployment {deployment}: {e}")
            raise
        reason = "ScaledUp" if decision.desired > decision.current else "ScaledDown"
        event("Normal", reason, f"Deployment {deployment}: {decision.reason}")
        return int((body.get("metadata") or {}).get("generation") or 0)


async def set_replicas(
    kube: KubeClient, namespace: str, deployment: str, replicas: int, *, force: bool
) -> dict[str, Any]:
    """Server-side apply of ``replicas`` alone, under the autoscaler's field manager."""
    body = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": deployment, "namespace": namespace},
        "spec": {"replicas": replicas},
    }
    return await kube.apply(body, field_manager=REPLICAS_FIELD_MANAGER, force=force)


def _idle(stage: str) -> StageObservation:
    return StageObservation(stage, 0.0, 0.0, 0)


def _replicas(deployment: Mapping[str, Any] | None) -> int | None:
    if deployment is None:
        return None
    value = (deployment.get("spec") or {}).get("replicas")
    return int(value) if value is not None else None


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
