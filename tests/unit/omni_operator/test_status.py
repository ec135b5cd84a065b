"""The OmniPipeline status as a pure function of its Deployments."""

from __future__ import annotations

from typing import Any

from omni_operator.api import OmniPipelineStatus
from omni_operator.status import StagePlacement, invalid_status, pipeline_status

STAGES = [
    StagePlacement(name="thinker", stage_id=0, group="thinker-dit", deployment="p-thinker-dit"),
    StagePlacement(name="dit", stage_id=1, group="thinker-dit", deployment="p-thinker-dit"),
    StagePlacement(name="vae", stage_id=2, group="vae", deployment="p-vae"),
]


def deployment(
    replicas: int = 1,
    ready: int = 1,
    updated: int | None = None,
    generation: int = 1,
    observed: int | None = None,
    component: str = "stages",
) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation, "labels": {"omni.dev/component": component}},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": generation if observed is None else observed,
            "replicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
        },
    }


def status_of(
    deployments: dict[str, dict[str, Any]],
    previous: OmniPipelineStatus | None = None,
    **autoscaling: Any,
) -> OmniPipelineStatus:
    """The status of ``deployments``; ``autoscaling``: pipeline_status's autoscaler inputs."""
    return pipeline_status(
        stages=STAGES,
        router_deployment="p-router",
        deployments=deployments,
        generation=4,
        endpoint="http://p.ns.svc:8000",
        previous=previous,
        now="2026-11-30T00:00:00Z",
        **autoscaling,
    )


def conditions(status: OmniPipelineStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}


def all_ready() -> dict[str, dict[str, Any]]:
    return {
        "p-thinker-dit": deployment(),
        "p-vae": deployment(replicas=2, ready=2),
        "p-router": deployment(component="router"),
    }


def test_everything_ready_is_ready_with_counts_per_stage() -> None:
    status = status_of(all_ready())
    assert status.phase == "Ready"
    assert status.ready == "3/3"
    assert status.observed_generation == 4
    assert status.endpoint == "http://p.ns.svc:8000"
    assert [(s.name, s.placement_group, s.replicas, s.ready_replicas) for s in status.stages] == [
        ("thinker", "thinker-dit", 1, 1),
        ("dit", "thinker-dit", 1, 1),
        ("vae", "vae", 2, 2),
    ]
    assert status.router is not None
    assert status.router.ready
    assert conditions(status) == {
        "Ready": ("True", "AllReplicasReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
        "SpecValid": ("True", "Valid"),
    }


def test_nothing_yet_is_pending_then_progressing_while_pods_come_up() -> None:
    status = status_of({})
    assert status.phase == "Pending"
    rolling = next(c for c in status.conditions if c.type == "Progressing")
    assert rolling.status == "True"
    assert "p-vae: not created yet" in rolling.message
    created = status_of({k: deployment(ready=0) for k in ("p-thinker-dit", "p-vae", "p-router")})
    assert created.phase == "Progressing"
    assert created.ready == "0/3"


def test_losing_a_replica_after_serving_is_degraded_and_names_the_stage() -> None:
    ready = status_of(all_ready())
    broken = all_ready()
    broken["p-vae"] = deployment(replicas=2, ready=1)
    status = status_of(broken, previous=ready)
    assert status.phase == "Degraded"
    assert status.ready == "2/3"
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert degraded.status == "True"
    assert "stage vae: 1/2 ready" in degraded.message
    # The same loss before the pipeline ever served is still on its way, not Degraded.
    assert status_of(broken).phase == "Progressing"


def test_a_rollout_is_progressing_until_the_controller_catches_up() -> None:
    rolling = all_ready()
    rolling["p-thinker-dit"] = deployment(generation=2, observed=1)
    assert status_of(rolling).phase == "Progressing"
    rolling["p-thinker-dit"] = deployment(replicas=2, ready=2, updated=1)
    status = status_of(rolling)
    assert status.phase == "Progressing"
    assert conditions(status)["Progressing"] == ("True", "RollingOut")


def test_a_router_without_ready_pods_keeps_the_pipeline_from_ready() -> None:
    deployments = all_ready()
    deployments["p-router"] = deployment(ready=0, component="router")
    status = status_of(deployments)
    assert status.phase == "Progressing"
    assert status.ready == "3/3"  # the stages are; the router is not
    message = next(c for c in status.conditions if c.type == "Ready").message
    assert "router: 0/1 ready" in message


def test_transition_times_move_only_when_a_condition_changes() -> None:
    first = status_of(all_ready())
    later = pipeline_status(
        stages=STAGES,
        router_deployment="p-router",
        deployments=all_ready(),
        generation=5,
        endpoint="http://p.ns.svc:8000",
        previous=first,
        now="2026-12-01T00:00:00Z",
    )
    times = {c.type: c.last_transition_time for c in later.conditions}
    assert set(times.values()) == {"2026-11-30T00:00:00Z"}
    broken = all_ready()
    broken["p-vae"] = deployment(replicas=2, ready=0)
    degraded = pipeline_status(
        stages=STAGES,
        router_deployment="p-router",
        deployments=broken,
        generation=5,
        endpoint="http://p.ns.svc:8000",
        previous=later,
        now="2026-12-02T00:00:00Z",
    )
    times = {c.type: c.last_transition_time for c in degraded.conditions}
    assert times["Ready"] == times["Degraded"] == "2026-12-02T00:00:00Z"
    assert times["SpecValid"] == times["Progressing"] == "2026-11-30T00:00:00Z"


def test_an_invalid_spec_fails_and_keeps_the_last_counts() -> None:
    ready = status_of(all_ready())
    failed = invalid_status("spec.stages[1].replicas: must equal 1", 6, ready, "later")
    assert failed.phase == "Failed"
    assert failed.observed_generation == 6
    assert failed.stages == ready.stages
    spec_valid = next(c for c in failed.conditions if c.type == "SpecValid")
    assert (spec_valid.status, spec_valid.reason) == ("False", "InvalidSpec")
    assert "stages[1].replicas" in spec_valid.message


def test_a_planner_scale_up_is_progress_not_a_degraded_pipeline() -> None:
    from omni_operator.api import StageScalingStatus

    serving = status_of(all_ready())
    assert serving.phase == "Ready"
    scaled = {**all_ready(), "p-vae": deployment(replicas=5, ready=2)}
    why = StageScalingStatus(mode="planner", desired_replicas=5, reason="scaling up 2 -> 5")
    status = status_of(
        scaled,
        serving,
        scaling={"vae": why},
        scaled_up_from={"p-vae": 2},
    )
    assert status.phase == "Progressing"
    assert conditions(status)["Degraded"][0] == "False"
    progressing = next(c for c in status.conditions if c.type == "Progressing")
    assert "p-vae: scaling up from 2 to 5, 2 ready" in progressing.message
    vae = next(s for s in status.stages if s.name == "vae")
    assert vae.autoscaling == why
    # Fewer ready than before the scale-up: replicas were lost, whatever the planner did.
    lost = {**scaled, "p-vae": deployment(replicas=5, ready=1)}
    status = status_of(
        lost,
        serving,
        scaled_up_from={"p-vae": 2},
    )
    assert status.phase == "Degraded"


def test_a_planner_scale_down_not_yet_observed_is_not_a_rollout() -> None:
    serving = status_of(all_ready())
    # The planner took p-vae from 2 to 1: generation 2, which the controller has not seen.
    scaled = {**all_ready(), "p-vae": deployment(replicas=1, ready=2, generation=2, observed=1)}

    def status(generations: dict[str, int]) -> OmniPipelineStatus:
        return status_of(
            scaled,
            serving,
            scaled_generations=generations,
        )

    assert status({"p-vae": 2}).phase == "Ready"
    # Anyone else's change of generation 2 (a template, say) is a rollout until observed.
    assert status({}).phase == "Progressing"
    assert status({"p-vae": 3}).phase == "Progressing"


def test_a_managed_video_store_counts_as_the_router_does() -> None:
    # Without its Redis the routers take no video job: the pipeline is not Ready.
    store = {"video_store_deployment": "p-video-store"}
    deployments = all_ready()
    assert status_of(deployments, **store).phase == "Progressing"  # not created yet
    deployments["p-video-store"] = deployment(ready=1, component="video-store")
    ready = status_of(deployments, **store)
    assert ready.phase == "Ready"
    deployments["p-video-store"] = deployment(ready=0, component="video-store")
    lost = status_of(deployments, previous=ready, **store)
    assert lost.phase == "Degraded"
    assert "video store: 0/1 ready" in next(c for c in lost.conditions if c.type == "Ready").message
    # Its stage counts are the stages' alone.
    assert lost.ready == "3/3"
