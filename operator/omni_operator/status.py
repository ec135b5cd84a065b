"""The OmniPipeline's status, computed from its Deployments: a pure function.

Phase, from the most to the least serious:
- Failed: the spec cannot be deployed (SpecValid=False); nothing was changed.
- Ready: every stage and the router have all their replicas ready, on the current spec.
- Degraded: it was serving, and now some replicas are missing (a pod died, went unready,
  or cannot be scheduled) while no rollout is under way.
- Progressing: on the way to Ready: a rollout (a Deployment has not caught up with its
  spec, or not every pod is of the current template), or pods still coming up.
- Pending: accepted, but no Deployment of it exists yet.

A stage counts as ready (the READY column, ready stages / stages) when all its replicas
are. Conditions keep their lastTransitionTime while their status stays the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omni_runtime.pod_contract import (
    all_replicas_ready,
    deployment_ready_replicas,
    deployment_replicas,
)

from .api import (
    Condition,
    ConditionStatus,
    OmniPipelineStatus,
    Phase,
    RouterStatus,
    StageScalingStatus,
    StageStatus,
)


@dataclass(frozen=True)
class DeploymentState:
    """What the status needs of one Deployment."""

    replicas: int
    ready_replicas: int
    updated_replicas: int
    available_replicas: int
    # The Deployment controller has seen the latest template.
    observed: bool

    @classmethod
    def of(
        cls, deployment: Mapping[str, Any], scaled_generation: int | None = None
    ) -> DeploymentState:
        """``scaled_generation``: the generation a scale by the planner gave it; a
        Deployment one generation behind that has only had its replicas changed."""
        status = deployment.get("status") or {}
        generation = int((deployment.get("metadata") or {}).get("generation", 0))
        observed_generation = int(status.get("observedGeneration", 0))
        scaled_only = generation == scaled_generation and observed_generation == generation - 1
        return cls(
            replicas=deployment_replicas(deployment),
            ready_replicas=deployment_ready_replicas(deployment),
            updated_replicas=int(status.get("updatedReplicas", 0)),
            available_replicas=int(status.get("availableReplicas", 0)),
            observed=observed_generation >= generation or scaled_only,
        )

    @property
    def rolling(self) -> bool:
        return not self.observed or self.updated_replicas < self.replicas

    @property
    def all_ready(self) -> bool:
        return all_replicas_ready(self.replicas, self.ready_replicas)


@dataclass(frozen=True)
class StagePlacement:
    """A stage and the Deployment (placement group) it runs in."""

    name: str
    stage_id: int
    group: str
    deployment: str


def invalid_status(
    message: str, generation: int, previous: OmniPipelineStatus | None, now: str
) -> OmniPipelineStatus:
    """The status of a spec the operator refuses: Failed, SpecValid=False with why."""
    base = previous or OmniPipelineStatus()
    conditions = _merge_conditions(
        base.conditions,
        [
            _condition("SpecValid", "False", "InvalidSpec", message, generation),
            _condition("Ready", "False", "InvalidSpec", "the spec cannot be deployed", generation),
        ],
        now,
    )
    return base.model_copy(
        update={"phase": "Failed", "observed_generation": generation, "conditions": conditions}
    )


def pipeline_status(
    *,
    stages: Sequence[StagePlacement],
    router_deployment: str,
    deployments: Mapping[str, Mapping[str, Any]],
    generation: int,
    endpoint: str,
    previous: OmniPipelineStatus | None,
    now: str,
    scaling: Mapping[str, StageScalingStatus] | None = None,
    scaled_up_from: Mapping[str, int] | None = None,
    scaled_generations: Mapping[str, int] | None = None,
    video_store_deployment: str | None = None,
) -> OmniPipelineStatus:
    """The status of a valid pipeline whose Deployments (by name) are ``deployments``;
    a Deployment not there yet counts as wanted but with nothing ready.

    ``scaling`` is the autoscaler's last word per stage (by name). ``scaled_up_from`` names
    the Deployments the planner scaled up, with the replicas they had: while their new
    pods come up, with at least as many ready as before, they are scaling (Progressing),
    not missing replicas (Degraded). ``scaled_generations`` are the generations the
    planner's last scales gave its Deployments: one not yet observed is scaling, not rolling
    out (a scale-down would otherwise flap the phase to Progressing and back).
    ``video_store_deployment`` names a managed video store's Deployment: without it ready
    the routers can take no video job, so it counts as the router does."""
    scaling = scaling or {}
    scaled_up_from = scaled_up_from or {}
    scaled_generations = scaled_generations or {}
    states = {
        name: DeploymentState.of(body, scaled_generations.get(name))
        for name, body in deployments.items()
    }
    missing = DeploymentState(0, 0, 0, 0, observed=False)
    stage_statuses: list[StageStatus] = []
    not_ready: list[str] = []
    rolling: list[str] = []
    for stage in sorted(stages, key=lambda s: s.stage_id):
        state = states.get(stage.deployment, missing)
        stage_statuses.append(
            StageStatus(
                name=stage.name,
                stage_id=stage.stage_id,
                placement_group=stage.group,
                replicas=state.replicas,
                ready_replicas=state.ready_replicas,
                updated_replicas=state.updated_replicas,
                autoscaling=scaling.get(stage.name),
            )
        )
        if _scaling_up(state, scaled_up_from.get(stage.deployment)):
            continue
        if not state.all_ready:
            not_ready.append(f"stage {stage.name}: {state.ready_replicas}/{state.replicas} ready")
    others = {router_deployment} | ({video_store_deployment} if video_store_deployment else set())
    for name in sorted({s.deployment for s in stages} | others):
        state = states.get(name, missing)
        if name not in states:
            rolling.append(f"{name}: not created yet")
        elif state.rolling:
            rolling.append(f"{name}: {state.updated_replicas}/{state.replicas} updated")
        elif _scaling_up(state, scaled_up_from.get(name)):
            rolling.append(
                f"{name}: scaling up from {scaled_up_from[name]} to {state.replicas}, "
                f"{state.ready_replicas} ready"
            )
    router = states.get(router_deployment, missing)
    if not router.all_ready:
        not_ready.append(f"router: {router.ready_replicas}/{router.replicas} ready")
    if video_store_deployment is not None:
        store = states.get(video_store_deployment, missing)
        if not store.all_ready:
            not_ready.append(f"video store: {store.ready_replicas}/{store.replicas} ready")
    ready_stages = sum(
        1 for s in stage_statuses if s.replicas > 0 and s.ready_replicas >= s.replicas
    )

    was_serving = previous is not None and previous.phase in ("Ready", "Degraded")
    phase: Phase
    if not not_ready and not rolling:
        phase = "Ready"
    elif was_serving and not rolling:
        phase = "Degraded"
    elif states:
        phase = "Progressing"
    else:
        phase = "Pending"

    def flag(value: bool) -> ConditionStatus:
        return "True" if value else "False"

    conditions = [
        _condition("SpecValid", "True", "Valid", "the spec is valid", generation),
        _condition(
            "Ready",
            flag(phase == "Ready"),
            "AllReplicasReady" if phase == "Ready" else "ReplicasNotReady",
            "; ".join(not_ready) or "every stage and the router are ready",
            generation,
        ),
        _condition(
            "Progressing",
            flag(bool(rolling)),
            "RollingOut" if rolling else "RolloutComplete",
            "; ".join(rolling) or "every Deployment runs the current spec",
            generation,
        ),
        _condition(
            "Degraded",
            flag(phase == "Degraded"),
            "ReplicasUnavailable" if phase == "Degraded" else "AsExpected",
            "; ".join(not_ready) if phase == "Degraded" else "",
            generation,
        ),
    ]
    return OmniPipelineStatus(
        phase=phase,
        observed_generation=generation,
        ready=f"{ready_stages}/{len(stage_statuses)}",
        endpoint=endpoint,
        conditions=_merge_conditions(previous.conditions if previous else [], conditions, now),
        stages=stage_statuses,
        router=RouterStatus(
            replicas=router.replicas,
            ready_replicas=router.ready_replicas,
            ready=router.ready_replicas > 0,
        ),
    )


def _scaling_up(state: DeploymentState, scaled_from: int | None) -> bool:
    return (
        scaled_from is not None
        and not state.all_ready
        and state.replicas > scaled_from
        and state.ready_replicas >= scaled_from
    )


def _condition(
    type_: str, status: ConditionStatus, reason: str, message: str, generation: int
) -> Condition:
    return Condition.model_validate(
        {
            "type": type_,
            "status": status,
            "reason": reason,
            "message": message,
            "observedGeneration": generation,
        }
    )


def _merge_conditions(
    previous: Sequence[Condition], current: Sequence[Condition], now: str
) -> list[Condition]:
    """``current`` with each lastTransitionTime kept from ``previous`` where the status did
    not change; conditions of ``previous`` that ``current`` does not mention stay."""
    before: dict[str, Condition] = {c.type: c for c in previous}
    merged = dict(before)
    for condition in current:
        old = before.get(condition.type)
        since = old.last_transition_time if old and old.status == condition.status else None
        merged[condition.type] = condition.model_copy(update={"last_transition_time": since or now})
    order = ("Ready", "Progressing", "Degraded", "SpecValid")
    return sorted(merged.values(), key=lambda c: order.index(c.type))


def status_body(status: OmniPipelineStatus) -> dict[str, Any]:
    """``status`` as the JSON the status subresource takes."""
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)
