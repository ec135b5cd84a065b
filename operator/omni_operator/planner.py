"""The autoscaling planner's policy: how many replicas each placement group needs, from
what its stages' load was. Pure: observations, settings and the past recommendations in;
decisions and the new recommendations out. Reading the routers' metrics and scaling
Deployments are the caller's (autoscaler.py).

A stage's need is the larger of two rules, each where its target is set:

- in flight: the requests it must hold at once are the larger of those in it now and what
  Little's law gives for the arrival rate (``arrival_rate * time_in_stage``); divided by
  the requests one replica should hold (``target_in_flight``), that is its need. Never
  below what the requests in flight need now.
- latency: the ready replicas scaled by how far the observed percentile of time in stage
  is from the objective (``ready * observed / objective``), as Kubernetes' HPA scales on a
  metric, and with its 10 % tolerance so that noise around the objective moves nothing.

A placement group runs its stages in one pod, so it takes the largest need of its stages.

A change of the bounds applies at once. Otherwise stabilisation, as the HPA does it: a
group scales up to the smallest recommendation of the last ``scale_up_window_s`` seconds
(0: at once) and down to the largest of the last ``scale_down_window_s`` (300 by default:
a burst that ends does not take replicas away until the window has seen no need for them).
A planner that has watched a group for less than the down window (it just started) does
not scale it down: it cannot know the window's peak. Never below ``min_replicas`` nor
above ``max_replicas``, and never down while the observation is incomplete (a router
replica missing from the scrape would make the load look smaller than it is).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# As the HPA's: a latency ratio within 10 % of 1 changes nothing.
LATENCY_TOLERANCE = 0.1


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
    # Percentile (50, 90, ...) -> seconds in stage, over the window; empty when no request
    # finished in it.
    time_in_stage_percentiles: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LatencyObjective:
    percentile: int
    seconds: float


@dataclass(frozen=True)
class Autoscaling:
    """A placement group's settings (its stages' ``autoscaling``, equal within a group)."""

    min_replicas: int
    max_replicas: int
    # Requests one replica should hold at once; None: no in-flight rule.
    target_in_flight: float | None
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    latency: LatencyObjective | None = None


@dataclass(frozen=True)
class GroupState:
    """What the planner knows of one placement group now."""

    group: str
    replicas: int
    settings: Autoscaling
    stages: Sequence[StageObservation]
    # False when some router replica was not scraped: the load may be larger than seen.
    complete: bool = True
    # Pods ready to serve; the latency rule scales from these. None: as many as replicas.
    ready_replicas: int | None = None


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


def stage_need(stage: StageObservation, settings: Autoscaling, ready: int) -> tuple[int, str]:
    """The replicas ``stage`` needs for its load, and how that was found."""
    needs: list[tuple[int, str]] = []
    if settings.target_in_flight is not None:
        needs.append(_in_flight_need(stage, settings.target_in_flight))
    if settings.latency is not None:
        needs.append(_latency_need(stage, settings.latency, ready))
    return max(needs, default=(0, f"{stage.stage}: no target"))


def _in_flight_need(stage: StageObservation, target: float) -> tuple[int, str]:
    expected = stage.arrival_rate * stage.time_in_stage
    held = max(float(stage.in_flight), expected)
    need = math.ceil(held / target - 1e-9) if held > 0 else 0
    return need, (
        f"{stage.stage}: {stage.in_flight} in flight, {stage.arrival_rate:.3g} req/s x "
        f"{stage.time_in_stage:.3g} s in stage = {expected:.3g} expected, "
        f"{target:g} per replica -> {need}"
    )


def _latency_need(
    stage: StageObservation, objective: LatencyObjective, ready: int
) -> tuple[int, str]:
    name = f"p{objective.percentile}"
    observed = stage.time_in_stage_percentiles.get(objective.percentile)
    if observed is None:
        # Nothing finished in the window: requests still in the stage keep what serves them.
        need = ready if stage.in_flight > 0 else 0
        return need, f"{stage.stage}: no request finished, {stage.in_flight} in flight -> {need}"
    ratio = observed / objective.seconds
    within = abs(ratio - 1) <= LATENCY_TOLERANCE
    need = ready if within else math.ceil(ready * ratio - 1e-9)
    return need, (
        f"{stage.stage}: {name} {observed:.3g} s in stage against {objective.seconds:g} s "
        f"on {ready} ready -> {need}"
    )


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
        ready = state.replicas if state.ready_replicas is None else state.ready_replicas
        needs = [stage_need(stage, settings, ready) for stage in state.stages]
        need, why = max(needs, default=(0, "no load observed"))
        raw = min(max(need, settings.min_replicas), settings.max_replicas)
        horizon = max(settings.scale_up_window_s, settings.scale_down_window_s)
        past = list(history.get(state.group, ()))
        inside = [r for r in past if now - r.at <= horizon]
        # The newest one older than every window: not counted, but it shows how long the
        # group has been watched.
        older = [r for r in past if now - r.at > horizon][-1:]
        recent = [*older, *inside, Recommendation(now, raw)]
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
        watched = now - recent[0].at
        if watched < settings.scale_down_window_s:
            return current, (
                f"holding {current}: {why}; watched {watched:.0f} s of the "
                f"{settings.scale_down_window_s:g} s scale-down window"
            )
        window = [r.replicas for r in recent if now - r.at <= settings.scale_down_window_s]
        desired = min(current, max(window))
        if desired == current:
            return current, f"holding {current}: {why}; waiting out the scale-down window"
        return desired, f"scaling down {current} -> {desired} {bounds}: {why}"
    return current, f"steady at {current} {bounds}: {why}"
