"""The autoscaling simulator (bench/autoscaling_sim.py) on short runs: the operator's
planner against a fixed fleet on a step of load, determinism, and real queueing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_simulator() -> ModuleType:
    # bench/ is not a package; the module must be in sys.modules before it runs, as its
    # dataclasses look their module up there.
    path = REPO / "bench" / "autoscaling_sim.py"
    spec = importlib.util.spec_from_file_location("autoscaling_sim", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


sim = _load_simulator()

# Two simulated hours: the step's low thirds must be long enough that a fleet sized to the
# load pays for the transient after the step (40 minutes is not: there the burst of
# replicas started while the queue grows outweighs the low periods). Half the default
# rates (1.5 -> 3 req/s: the DiT needs 18 replicas at the step) and a 60 s start-up keep a
# run under a second.
STEP = sim.SimConfig(
    sim.PROFILES["bagel"], duration_s=7200.0, scale=0.5, startup_mean_s=60.0, seed=1
)


@pytest.fixture(scope="module")
def step_runs() -> dict[str, Any]:
    return {name: sim.simulate(STEP, "step", name) for name in ("planner", "static-peak")}


def test_the_planner_meets_the_step_for_less_than_the_peak_fleet(
    step_runs: dict[str, Any],
) -> None:
    planner, static = step_runs["planner"], step_runs["static-peak"]
    assert planner.requests == static.requests > 10_000
    # Measured over seeds 1-8: reaction 62-72 s (the first look, then a 60 s start-up);
    # SLO attained 0.981-0.994 (the queue that builds while the replicas start); DiT
    # replica-hours 35-42 against the fixed 46. The bounds leave room for the model's
    # noise, not for a planner that waits out a window or never reaches the need.
    reaction = planner.reaction_s["dit"]
    assert reaction is not None
    assert 0 < reaction < 180
    assert planner.slo_attained >= 0.95
    assert planner.replica_hours["dit"] < 0.95 * static.replica_hours["dit"]
    assert planner.total_replica_hours < static.total_replica_hours
    # It scaled both ways: up for the step, down after it.
    assert planner.scale_ups["dit"] > 0
    assert planner.scale_downs["dit"] > 0
    # The fixed fleet has what the peak needs from the start.
    assert static.reaction_s["dit"] == 0
    assert static.slo_attained == 1.0


def test_the_same_seed_gives_the_same_figures(step_runs: dict[str, Any]) -> None:
    assert sim.simulate(STEP, "step", "planner") == step_runs["planner"]
    other = sim.SimConfig(
        sim.PROFILES["bagel"], duration_s=7200.0, scale=0.5, startup_mean_s=60.0, seed=2
    )
    assert sim.simulate(other, "step", "planner") != step_runs["planner"]


def test_one_replica_that_never_scales_misses_the_objective() -> None:
    config = sim.SimConfig(sim.PROFILES["bagel"], duration_s=1200.0, scale=0.5, seed=1)
    # 1.5 req/s against a DiT that serves 1/6 req/s: the queue grows for the whole run.
    one = sim.simulate(config, "steady", sim.StaticPolicy("one", [1, 1]))
    assert one.slo_attained < 0.05
    assert one.p50_s > 100 * config.profile.unloaded_s
    # Enough replicas: the latency is the service time's.
    peak = sim.simulate(config, "steady", "static-peak")
    assert peak.slo_attained > 0.99
    assert peak.p50_s == pytest.approx(config.profile.unloaded_s, rel=0.1)
