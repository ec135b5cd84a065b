"""The autoscaling planner's policy: how many replicas each placement group needs, from
what its stages' load was. Pure: observations, settings and the past recommendations in;
decisions and the new recommendations out. Reading the routers' metrics and scaling
Deployments are the caller's (autoscaler.py).

A stage's need is the larger of two rules, each where its target is set:

- in flight: the replicas that serve the arrival rate, each holding ``target_in_flight``
  requests at once (Little's law: ``arrival_rate * service_time / target``), plus those
  that drain the backlog (requests beyond what the ready replicas hold) within
  ``drain_s``. The service time is what the replicas report they worked on a request
  (``execution_time``), else the stage's time in stage when it is not queueing; the
  planner remembers it (a moving average), because under a backlog the time in stage is
  mostly queue, and sizing from it would ask one replica per queued request while new
  ones start (minutes on GPU nodes), hundreds too many (bench/autoscaling_sim.py measured
  578 for 45). Within 10 % of the replicas there are, it keeps them, so that noise moves
  nothing. A queue that stands (every replica ready, more in flight than they hold by
  over 10 % at this look and the last, and no fewer than then: a closed loop of clients at
  the stage's capacity, which a rate alone never shows) asks for ``in_flight / target``,
  at most double or +4 a look.

  Where the routers count the stage's work (a diffusion stage: steps x pixels x images, the
  unit least-outstanding-work weighs replicas by) and its replicas' cost fit, the rule
  reads work instead of requests: the seconds that arrive each second are ``arrival_rate
  x seconds_per_request + work_rate x seconds_per_unit``, and a queued request costs what
  the requests in the stage cost on average. A mean service time remembered across looks
  lags a change of mix: when 1024x1024 50-step images follow 256x256 4-step ones at the
  same rate, it would ask for a fortieth of the replicas at the first look; the work asks
  for them at once.
- latency: the ready replicas scaled by how far the observed percentile of time in stage
  is from the objective (``ready * observed / objective``), as Kubernetes' HPA scales on a
  metric, with its 10 % tolerance, and up by at most double or +4 a look (the HPA's
  default). While replicas are still starting it does not scale up again: the latency
  those will lower is what it sees.

A placement group runs its stages in one pod, so it takes the largest need of its stages.

A change of the bounds applies at once. Otherwise stabilisation, as the HPA does it: a
group scales up to the smallest recommendation of the last ``scale_up_window_s`` seconds
(0: at once) and down to the largest of the last ``scale_down_window_s`` (300 by default:
a burst that ends does not take replicas away until the window has seen no need for them).
A planner that has watched a group for less than the down window (it just started) does
not scale it down: it cannot know the window's peak. Never below ``min_replicas`` nor
above ``max_replicas``, never down while the observation is incomplete (a router replica
missing from the scrape would make the load look smaller than it is), and never down below
what the requests in flight now need (``in_flight / target_in_flight``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# As the HPA's: a need within 10 % of the replicas there are changes nothing.
TOLERANCE = 0.1
# How much of a new look's service time the remembered one takes in.
SERVICE_TIME_WEIGHT = 0.3


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
    # Mean seconds the replicas said they worked on a request (no queue), over the window;
    # None where they report none or none finished.
    execution_time: float | None = None
    # Units of work (router_load's) that entered per second, the work in the stage at the
    # scrape, and the replicas' (seconds per request, seconds per unit) fit; None where the
    # routers report none. With all three, the in-flight rule sizes the stage from work.
    work_rate: float | None = None
    outstanding_work: float | None = None
    cost: tuple[float, float] | None = None


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
    # Seconds the in-flight rule gives extra replicas to clear a backlog. Longer asks for
    # fewer and clears it later; bench/autoscaling_sim.py: 60 s against 120 s, with GPU pods
    # that take 3 minutes to start, kept 1-2 % more requests within the objective under
    # bursts for ~5 % more replica-hours.
    drain_s: float = 60.0


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
class Memory:
    """What the planner keeps between looks."""

    # Per group: its recent recommendations, oldest first.
    recommendations: Mapping[str, Sequence[Recommendation]] = field(default_factory=dict)
    # Per stage: seconds a request takes in it without queueing (see the module docstring).
    service_time: Mapping[str, float] = field(default_factory=dict)
    # Per stage: the requests in it at the last look.
    in_flight: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    group: str
    current: int
    desired: int
    # Why, in words, for the status and the Event.
    reason: str


def stage_need(
    stage: StageObservation,
    settings: Autoscaling,
    current: int,
    ready: int,
    service_time: float | None,
    in_flight_before: int | None = None,
) -> tuple[int, str]:
    """The replicas ``stage`` needs for its load, and how that was found. ``service_time``
    is the remembered one (None: not known yet, the time in stage stands in);
    ``in_flight_before`` the requests in the stage at the last look."""
    needs: list[tuple[int, str]] = []
    if settings.target_in_flight is not None:
        target = settings.target_in_flight
        needs.append(_in_flight_need(stage, target, current, ready, service_time, settings.drain_s))
        standing = _standing_queue_need(stage, target, current, ready, in_flight_before)
        if standing is not None:
            needs.append(standing)
    if settings.latency is not None:
        needs.append(_latency_need(stage, settings.latency, current, ready))
    return max(needs, default=(0, f"{stage.stage}: no target"))


def _in_flight_need(
    stage: StageObservation,
    target: float,
    current: int,
    ready: int,
    service_time: float | None,
    drain_s: float,
) -> tuple[int, str]:
    backlog = max(0.0, stage.in_flight - ready * target)
    work = _work_load(stage)
    if work is not None:
        busy, service = work
        serving = busy / target
        why = (
            f"{stage.stage}: {stage.work_rate:.3g} units of work/s and "
            f"{stage.arrival_rate:.3g} req/s = {busy:.3g} s/s / {target:g} per replica = "
            f"{serving:.3g}"
        )
    else:
        service = stage.time_in_stage if service_time is None else service_time
        serving = stage.arrival_rate * service / target
        why = (
            f"{stage.stage}: {stage.arrival_rate:.3g} req/s x {service:.3g} s / {target:g} "
            f"per replica = {serving:.3g}"
        )
    draining = backlog * service / (target * drain_s) if drain_s > 0 else 0.0
    wanted = serving + draining
    if current > 0 and abs(wanted / current - 1) <= TOLERANCE:
        need = current
    else:
        need = math.ceil(wanted - 1e-9) if wanted > 0 else 0
    if backlog:
        why += f", + {backlog:.0f} queued over {drain_s:g} s = {draining:.3g}"
    return need, f"{why} ({stage.in_flight} in flight) -> {need}"


def _work_load(stage: StageObservation) -> tuple[float, float] | None:
    """From the stage's work: the replica-seconds that arrive each second, and what one
    request in the stage now costs on average (what a queued one will take); None where the
    routers report no work or no cost fit."""
    if stage.work_rate is None or stage.outstanding_work is None or stage.cost is None:
        return None
    per_request, per_work = stage.cost
    busy = stage.arrival_rate * per_request + stage.work_rate * per_work
    held = stage.in_flight * per_request + stage.outstanding_work * per_work
    return busy, held / stage.in_flight if stage.in_flight > 0 else per_request


def _standing_queue_need(
    stage: StageObservation, target: float, current: int, ready: int, before: int | None
) -> tuple[int, str] | None:
    over = ready * target * (1 + TOLERANCE)
    if before is None or ready < current or min(stage.in_flight, before) <= over:
        return None  # not over at this look and the last
    if stage.in_flight < before:
        return None  # draining: the replicas there are catching up
    need = min(math.ceil(stage.in_flight / target - 1e-9), max(2 * current, current + 4))
    return need, (
        f"{stage.stage}: {stage.in_flight} in flight on {ready} ready, {target:g} per replica, "
        f"not fewer than the {before} of the last look -> {need}"
    )


def _latency_need(
    stage: StageObservation, objective: LatencyObjective, current: int, ready: int
) -> tuple[int, str]:
    name = f"p{objective.percentile}"
    observed = stage.time_in_stage_percentiles.get(objective.percentile)
    if observed is None:
        # Nothing finished in the window: requests still in the stage keep what serves them.
        need = current if stage.in_flight > 0 else 0
        return need, f"{stage.stage}: no request finished, {stage.in_flight} in flight -> {need}"
    ratio = observed / objective.seconds
    if abs(ratio - 1) <= TOLERANCE:
        need = current
    elif ratio > 1 and ready < current:
        # The replicas still starting are what will lower it; asking more now would
        # count the same latency twice.
        need = current
    else:
        need = math.ceil(ready * ratio - 1e-9)
        need = min(need, max(2 * current, current + 4))
    return need, (
        f"{stage.stage}: {name} {observed:.3g} s in stage against {objective.seconds:g} s "
        f"on {ready} ready of {current} -> {need}"
    )


def remembered_service_time(
    stage: StageObservation, target: float | None, ready: int, before: float | None
) -> float | None:
    """The stage's service time after this look: moved toward the execution time the
    replicas reported, else toward the time in stage of a look without a backlog (requests
    finished, and no more in flight than the ready replicas hold at ``target`` each), else
    kept."""
    if stage.execution_time is not None and stage.execution_time > 0:
        seen = stage.execution_time
    else:
        queued = target is None or ready <= 0 or stage.in_flight > ready * target
        if queued or stage.time_in_stage <= 0:
            return before
        seen = stage.time_in_stage
    if before is None:
        return seen
    return before + SERVICE_TIME_WEIGHT * (seen - before)


def plan(groups: Sequence[GroupState], now: float, memory: Memory) -> tuple[list[Decision], Memory]:
    """Each group's decision, and what to remember for the next look."""
    decisions: list[Decision] = []
    kept: dict[str, list[Recommendation]] = {}
    service_time = dict(memory.service_time)
    in_flight = dict(memory.in_flight)
    for state in groups:
        settings = state.settings
        ready = state.replicas if state.ready_replicas is None else state.ready_replicas
        needs = []
        floor = 0
        for stage in state.stages:
            known = service_time.get(stage.stage)
            known = remembered_service_time(stage, settings.target_in_flight, ready, known)
            if known is not None:
                service_time[stage.stage] = known
            before = in_flight.get(stage.stage)
            in_flight[stage.stage] = stage.in_flight
            needs.append(stage_need(stage, settings, state.replicas, ready, known, before))
            if settings.target_in_flight is not None:
                held = stage.in_flight / settings.target_in_flight
                floor = max(floor, math.ceil(held - 1e-9))
        need, why = max(needs, default=(0, "no load observed"))
        raw = min(max(need, settings.min_replicas), settings.max_replicas)
        horizon = max(settings.scale_up_window_s, settings.scale_down_window_s)
        past = list(memory.recommendations.get(state.group, ()))
        inside = [r for r in past if now - r.at <= horizon]
        # The newest one older than every window: not counted, but it shows how long the
        # group has been watched.
        older = [r for r in past if now - r.at > horizon][-1:]
        recent = [*older, *inside, Recommendation(now, raw)]
        kept[state.group] = recent
        desired, reason = _stabilised(state, raw, recent, now, why)
        if desired < state.replicas:
            # Requests in flight keep the replicas that hold them.
            held = min(state.replicas, floor, settings.max_replicas)
            if held > desired:
                desired = held
                reason = f"holding {held}: the requests in flight need them; {why}"
        decisions.append(Decision(state.group, state.replicas, desired, reason))
    return decisions, Memory(kept, service_time, in_flight)


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
