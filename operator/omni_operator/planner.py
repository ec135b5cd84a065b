"""The autoscaling planner's policy (issue 17): how many replicas each placement group needs,
from what its stages' load was. Pure: observations, settings and the past recommendations in;
decisions and the new recommendations out. Reading the routers' metrics and patching
Deployments are the caller's.

For each stage, the requests it must hold at once are the larger of those in it now and
what Little's law gives for the arrival rate (``arrival_rate * time_in_stage``); divided by
the requests one replica should hold (``target_in_flight``), that is the stage's need. A
placement group runs its stages in one pod, so it takes the largest need of its stages.

A change of the bounds applies at once. Otherwise stabilisation, as Kubernetes' HPA does
it: a group scales up to the smallest recommendation of the last ``scale_up_window_s``
seconds (0: at once) and down to the largest of the last ``scale_down_window_s`` (300 by
default: a burst that ends does not take replicas away until the window has seen no need
for them). Never below ``min_replicas`` nor above ``max_replicas``, and never down while
the observation is incomplete (a router replica missing from the scrape would make the load
look smaller than it is) or below what the requests in flight need now.

Not wired in yet: the operator does not call it (issue 17 goes on from here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageObservation:
    """One stage's load, summed over every router replica scraped."""

    stage: str
    # Requests that entered the stage per second, over the scrape window.
    arrival_rate: float
    # Mean seconds a request spent in the stage (queue and execution), over the window.
    time_in_stage: float
    # Requests in the stage at the scrape.
    in_flight: int


@dataclass(frozen=True)
class Autoscaling:
    """A placement group's settings (its stages' ``autoscaling``, equal within a group)."""

    min_replicas: int
    max_replicas: int
    # Requests one replica should hold at once.
    target_in_flight: float
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0


@dataclass(frozen=True)
class GroupState:
    """What the planner knows of one placement group now."""

    group: str
    replicas: int
    settings: Autoscaling
    stages: Sequence[StageObservation]
    # False when some router replica was not scraped: the load may be larger than seen.
    complete: bool = True


@dataclass(frozen=True)
class Recommendation:
    at: float
    replicas: int


@dataclass(frozen=True)
class Decision:
    group: str
    current: int
    desired: int
    # Why, in words, for the status and the Event.
    reason: str


def stage_need(stage: StageObservation, target_in_flight: float) -> tuple[int, str]:
    """The replicas ``stage`` needs for its load, and how that was found."""
    expected = stage.arrival_rate * stage.time_in_stage
    held = max(float(stage.in_flight), expected)
    need = math.ceil(held / target_in_flight - 1e-9) if held > 0 else 0
    reason = (
        f"{stage.stage}: {stage.in_flight} in flight, {stage.arrival_rate:.3g} req/s x "
        f"{stage.time_in_stage:.3g} s in stage = {expected:.3g} expected, "
        f"{target_in_flight:g} per replica -> {need}"
    )
    return need, reason


def plan(
    groups: Sequence[GroupState],
    now: float,
    history: Mapping[str, Sequence[Recommendation]],
) -> tuple[list[Decision], dict[str, list[Recommendation]]]:
    """Each group's decision, and the recommendations to keep for the next call."""
    decisions: list[Decision] = []
    kept: dict[str, list[Recommendation]] = {}
    for state in groups:
        settings = state.settings
        needs = [stage_need(stage, settings.target_in_flight) for stage in state.stages]
        need, why = max(needs, default=(0, "no load observed"))
        raw = min(max(need, settings.min_replicas), settings.max_replicas)
        horizon = max(settings.scale_up_window_s, settings.scale_down_window_s)
        past = [r for r in history.get(state.group, ()) if now - r.at <= horizon]
        recent = [*past, Recommendation(now, raw)]
        kept[state.group] = recent
        desired, reason = _stabilised(state, raw, recent, now, why)
        decisions.append(Decision(state.group, state.replicas, desired, reason))
    return decisions, kept


def _stabilised(
    state: GroupState, raw: int, recent: Sequence[Recommendation], now: float, why: str
) -> tuple[int, str]:
    settings, current = state.settings, state.replicas
    bounds = f"(min {settings.min_replicas}, max {settings.max_replicas})"
    # Bounds changed in the spec apply at once: they are the user's, not the load's.
    if current > settings.max_replicas:
        return settings.max_replicas, f"down to the maximum {bounds}"
    if current < settings.min_replicas and raw <= settings.min_replicas:
        return settings.min_replicas, f"up to the minimum {bounds}"
    if raw > current:
        window = [r.replicas for r in recent if now - r.at <= settings.scale_up_window_s]
        desired = max(current, min(window))
        if desired == current:
            return current, f"holding {current}: {why}; waiting out the scale-up window"
        return desired, f"scaling up {current} -> {desired} {bounds}: {why}"
    if raw < current:
        if not state.complete:
            return current, f"holding {current}: not every router was scraped"
        window = [r.replicas for r in recent if now - r.at <= settings.scale_down_window_s]
        desired = min(current, max(window))
        if desired == current:
            return current, f"holding {current}: {why}; waiting out the scale-down window"
        return desired, f"scaling down {current} -> {desired} {bounds}: {why}"
    return current, f"steady at {current} {bounds}: {why}"
