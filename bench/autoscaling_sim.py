"""The autoscaling planner's policy at fleet scale: a discrete-event simulation of a
two-stage pipeline under a load trace, scaled by the operator's own ``plan()``
(omni_operator.planner) and, for comparison, by a fixed fleet and by an HPA on utilisation.

No test cluster holds tens of GPU replicas, and none waits hours for a diurnal load: this
is the place where the policy's defaults meet such a fleet.

The model:

- Requests arrive as a Poisson process whose rate follows a trace, and go through the
  stages in series (the thinker, then the DiT). Each stage is its own placement group (its
  own Deployment). A replica serves up to ``concurrency`` requests at once (an LLM batches,
  a DiT serves one); a request's service time is lognormal (a mean and a coefficient of
  variation per stage) and does not depend on how full the replica is. A request that
  finds every replica of its stage full waits in the stage's FIFO queue; otherwise the
  router sends it to the least-loaded replica.
- A replica a policy adds is ready only after a start-up delay (lognormal, mean
  ``--startup-s``, 180 s by default: a GPU node, the image pull, the model load). A replica
  a policy removes is a starting one if any (newest first), else the newest ready one, as
  a ReplicaSet picks; a ready one stops taking requests at once and leaves when those it
  runs end (drain). Starting and draining replicas cost as much as serving ones.
- Every ``--interval-s`` (15 s, the operator's default) each policy looks at every stage
  and sets its replicas:
  - ``planner``: the operator's ``plan()``, one group per stage, with ``Autoscaling(min 1,
    max 1000, target_in_flight = the stage's concurrency x --target-in-flight,
    scale-up window 0, scale-down window --scale-down-window-s)``, or with a latency
    objective instead (``--latency-percentile``: that percentile of time in stage against
    ``--latency-multiple`` x the stage's mean service time). Its observations are built as
    the operator builds them: the simulated router's cumulative counters (requests finished,
    total time in stage, in flight now, and the replicas' reported execution time unless
    ``--no-execution-time``) scraped at each look and turned into a
    ``StageObservation`` by router_load's own ``observe()``; only the percentiles are exact
    (from the times of the requests finished in the interval) instead of a histogram's.
    What the planner remembers (recommendations, service times) is kept between calls as
    the operator keeps it.
  - ``static-peak``: the replicas the trace's peak rate needs at 80 % utilisation, from the
    start, never changing.
  - ``utilisation``: a Kubernetes HPA on a GPU-utilisation metric: utilisation = busy slots
    / (ready replicas x concurrency), averaged over the interval; desired = ceil(ready x
    utilisation / 0.7) with the HPA's 10 % tolerance, replicas still starting counted at 0 %
    when that would scale up (as the HPA treats pods not yet ready), its default scale-up
    rate (at most double or +4 a period), scale-down stabilised over 300 s, min 1.
  The scaling policies start with what the trace's first rate needs at 80 %, ready.
- Traces (requests/s at ``--scale`` 1, sized for the bagel profile so that the peak needs
  tens of DiT replicas): ``steady`` 3; ``step`` 1.5, x4 from a third of the run to two
  thirds; ``ramp`` 0.5 to 6 over the run; ``bursty`` a day compressed into the run (1 at
  the start and end, 3 at the middle) times bursts of 3-10 minutes at 2-3x, about one
  every 30 minutes. Arrivals stop at the end of the run; the requests in the pipeline then
  are still served and counted.
- Profiles: ``bagel`` (GPUs: thinker 0.6 s, cv 0.3, 8 at once; DiT 6.0 s, cv 0.2, 1 at
  once) and ``tiny`` (what the tiny CPU pipeline measured: thinker 0.008 s, DiT 0.124 s,
  one at a time each). The traces are the same: at ``--scale`` 1 the tiny pipeline needs
  one or two replicas; ``--scale 40 --hours 1`` gives it a fleet like bagel's.

Per trace and policy it prints: the requests; the p50 and p99 end-to-end latency; the SLO
attained (the fraction of requests done within ``--slo-s``, by default 3x the unloaded
end-to-end service time: 19.8 s for bagel); replica-hours per stage and in all (each
replica from when it is asked for until it has drained, over the run); the most replicas
each stage asked for; the DiT's scale-ups and scale-downs. For the step trace, the reaction:
seconds from the step up until each stage's ready replicas first reach what the new rate
needs (at 100 % utilisation). The same ``--seed`` gives the same figures; every policy of a
trace sees the same requests with the same service times.

What the figures mean: how the policies compare on one model of the load and the fleet,
and where a policy's rules misbehave (late, oscillating, over-provisioned). What they do
not mean: a measurement. Real service times depend on the batch, the prompt and the image
size. Here each replica's start-up is drawn on its own, so that asking for many more
replicas than needed brings the first of them sooner; real nodes come in batches, from a
quota, with a long tail (a node that does not come). A real router sends each request to
a replica at once (the queue is the replica's) and turns requests away beyond its limits
(``max_concurrent_requests``); here the queue is shared and without limit, so that a
backlog is served late rather than refused. The HPA's metric lags more than an exact
average does.

    .venv/bin/python bench/autoscaling_sim.py [--profile bagel|tiny] [--hours 6]
        [--startup-s 180] [--trace all|steady|step|ramp|bursty]
        [--policy all|planner|static-peak|utilisation] [--scale 1] [--seed 1]
        [--slo-s S] [--target-in-flight 1.0] [--scale-down-window-s 300]
        [--latency-percentile P [--latency-multiple 1.5]] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from omni_operator.planner import (
    Autoscaling,
    GroupState,
    LatencyObjective,
    Memory,
    StageObservation,
    plan,
)
from omni_operator.router_load import PERCENTILES, RouterScrape, StageCounters, observe

TRACES = ("steady", "step", "ramp", "bursty")
POLICIES = ("planner", "static-peak", "utilisation")
# What "needs" means for static-peak and for the fleet a run starts with: room to spare,
# since a fleet at 100 % utilisation queues without bound.
PROVISIONED_UTILISATION = 0.8
# The HPA's defaults and the usual GPU-utilisation target.
HPA_TARGET = 0.7
HPA_TOLERANCE = 0.1
HPA_SCALE_DOWN_WINDOW_S = 300.0
PLANNER_MAX_REPLICAS = 1000


@dataclass(frozen=True)
class StageModel:
    name: str
    mean_s: float
    cv: float
    # Requests one replica serves at once.
    concurrency: int


@dataclass(frozen=True)
class Profile:
    name: str
    stages: tuple[StageModel, ...]

    @property
    def unloaded_s(self) -> float:
        return sum(stage.mean_s for stage in self.stages)


PROFILES = {
    "bagel": Profile("bagel", (StageModel("thinker", 0.6, 0.3, 8), StageModel("dit", 6.0, 0.2, 1))),
    "tiny": Profile(
        "tiny", (StageModel("thinker", 0.008, 0.3, 1), StageModel("dit", 0.124, 0.2, 1))
    ),
}


@dataclass(frozen=True)
class Step:
    """The step trace's high period: when it starts and ends, and its rate."""

    up_at: float
    down_at: float
    rate: float


@dataclass(frozen=True)
class Trace:
    name: str
    duration_s: float
    rate: Callable[[float], float]
    peak_rate: float
    step: Step | None = None


@dataclass(frozen=True)
class Burst:
    start: float
    end: float
    factor: float


@dataclass(frozen=True)
class Workload:
    """A trace's requests: when each arrives, and its service time in each stage."""

    arrivals: list[float]
    service_s: list[list[float]]


@dataclass(frozen=True)
class SimConfig:
    profile: Profile
    duration_s: float = 6 * 3600.0
    scale: float = 1.0
    startup_mean_s: float = 180.0
    startup_cv: float = 0.3
    interval_s: float = 15.0
    slo_s: float | None = None
    seed: int = 1
    # The planner's settings: target in flight as a multiple of the stage's concurrency,
    # its scale-down window, and a latency objective (percentile, multiple of the stage's
    # mean service time) that replaces the in-flight rule when set.
    target_in_flight: float = 1.0
    scale_down_window_s: float = 300.0
    drain_s: float = 60.0
    # Whether the simulated replicas report their execution time, as the runtime's do
    # (omni_stage_execution_seconds); without it the planner infers the service time.
    reports_execution: bool = True
    latency_percentile: int | None = None
    latency_multiple: float = 1.5

    @property
    def slo(self) -> float:
        return self.slo_s if self.slo_s is not None else 3 * self.profile.unloaded_s


# --- traces and requests ---------------------------------------------------------------


def build_trace(name: str, duration_s: float, scale: float, seed: int) -> Trace:
    if name == "steady":
        rate = 3.0 * scale
        return Trace(name, duration_s, lambda t: rate, rate)
    if name == "step":
        low, step = 1.5 * scale, Step(duration_s / 3, 2 * duration_s / 3, 6.0 * scale)
        return Trace(
            name,
            duration_s,
            lambda t: step.rate if step.up_at <= t < step.down_at else low,
            step.rate,
            step,
        )
    if name == "ramp":
        start, end = 0.5 * scale, 6.0 * scale
        return Trace(name, duration_s, lambda t: start + (end - start) * t / duration_s, end)
    if name == "bursty":
        return _bursty(duration_s, scale, random.Random(f"{seed}/bursts"))
    raise ValueError(f"unknown trace {name!r}; one of {', '.join(TRACES)}")


def _bursty(duration_s: float, scale: float, rng: random.Random) -> Trace:
    mean, swing = 2.0 * scale, 0.5

    def diurnal(t: float) -> float:
        # A trough at the start and the end, the crest in the middle.
        return mean * (1 - swing * math.cos(2 * math.pi * t / duration_s))

    bursts: list[Burst] = []
    at = rng.expovariate(1 / 1800)
    while at < duration_s:
        length = rng.uniform(180, 600)
        bursts.append(Burst(at, at + length, rng.uniform(2, 3)))
        at += length + rng.expovariate(1 / 1800)

    def rate(t: float) -> float:
        factor = max((b.factor for b in bursts if b.start <= t < b.end), default=1.0)
        return diurnal(t) * factor

    # The diurnal part rises to the middle and falls after it: its highest point within a
    # burst is the one nearest the middle.
    middle = duration_s / 2
    peaks = [diurnal(middle)]
    peaks += [b.factor * diurnal(min(max(middle, b.start), b.end)) for b in bursts]
    return Trace("bursty", duration_s, rate, max(peaks))


def lognormal(rng: random.Random, mean: float, cv: float) -> float:
    sigma2 = math.log1p(cv * cv)
    return rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))


def generate_workload(profile: Profile, trace: Trace, seed: int) -> Workload:
    """Poisson arrivals at the trace's rate (thinned from its peak), each with its service
    times drawn up front, so that every policy serves the very same requests."""
    arriving = random.Random(f"{seed}/{trace.name}/arrivals")
    serving = random.Random(f"{seed}/{trace.name}/service")
    arrivals: list[float] = []
    service: list[list[float]] = [[] for _ in profile.stages]
    bound = trace.peak_rate
    at = 0.0
    while bound > 0:
        at += arriving.expovariate(bound)
        if at >= trace.duration_s:
            break
        if arriving.random() * bound > trace.rate(at):
            continue
        arrivals.append(at)
        for times, stage in zip(service, profile.stages, strict=True):
            times.append(lognormal(serving, stage.mean_s, stage.cv))
    return Workload(arrivals, service)


def replicas_needed(rate: float, stage: StageModel, utilisation: float) -> int:
    """Replicas that serve ``rate`` with each slot busy ``utilisation`` of the time."""
    return max(1, math.ceil(rate * stage.mean_s / stage.concurrency / utilisation - 1e-9))


# --- policies -------------------------------------------------------------------------


@dataclass(frozen=True)
class StageView:
    """What a policy sees of one stage at a look."""

    model: StageModel
    # Asked for (the Deployment's spec.replicas): starting and ready, not draining.
    replicas: int
    ready: int
    observation: StageObservation
    # Slots busy on ready replicas, averaged over the interval since the last look.
    busy_mean: float


class Policy(Protocol):
    name: str

    def initial_replicas(self) -> list[int]: ...

    def desired(self, now: float, views: Sequence[StageView]) -> list[int]: ...


@dataclass
class StaticPolicy:
    name: str
    replicas: list[int]

    def initial_replicas(self) -> list[int]:
        return list(self.replicas)

    def desired(self, now: float, views: Sequence[StageView]) -> list[int]:
        return list(self.replicas)


@dataclass
class PlannerPolicy:
    """The operator's policy, each stage a placement group of its own."""

    settings: list[Autoscaling]
    start: list[int]
    name: str = "planner"
    memory: Memory = field(default_factory=Memory)

    def initial_replicas(self) -> list[int]:
        return list(self.start)

    def desired(self, now: float, views: Sequence[StageView]) -> list[int]:
        groups = [
            GroupState(
                group=view.model.name,
                replicas=view.replicas,
                settings=settings,
                stages=[view.observation],
                ready_replicas=view.ready,
            )
            for view, settings in zip(views, self.settings, strict=True)
        ]
        decisions, self.memory = plan(groups, now, self.memory)
        return [decision.desired for decision in decisions]


@dataclass
class UtilisationPolicy:
    """An HPA on each stage's utilisation, with the HPA's default behaviour."""

    start: list[int]
    name: str = "utilisation"
    # Per stage: (when, recommended replicas), for the scale-down stabilisation.
    recommendations: list[list[tuple[float, int]]] = field(default_factory=list)

    def initial_replicas(self) -> list[int]:
        return list(self.start)

    def desired(self, now: float, views: Sequence[StageView]) -> list[int]:
        if not self.recommendations:
            self.recommendations = [[] for _ in views]
        return [
            self._stabilised(now, view, past)
            for view, past in zip(views, self.recommendations, strict=True)
        ]

    def _stabilised(self, now: float, view: StageView, past: list[tuple[float, int]]) -> int:
        raw = max(1, hpa_recommendation(view))
        past.append((now, raw))
        while now - past[0][0] > HPA_SCALE_DOWN_WINDOW_S:
            past.pop(0)
        if raw > view.replicas:
            # The HPA's default scale-up policies: +100 % or +4 pods a period, the larger.
            return min(raw, max(2 * view.replicas, view.replicas + 4))
        return min(view.replicas, max(replicas for _, replicas in past))


def hpa_recommendation(view: StageView) -> int:
    """What the HPA's replica calculator makes of the stage's utilisation."""
    current, ready, slots = view.replicas, view.ready, view.model.concurrency
    if ready == 0:
        return current
    ratio = min(1.0, view.busy_mean / (ready * slots)) / HPA_TARGET
    if abs(ratio - 1) <= HPA_TOLERANCE:
        return current
    starting = current - ready
    if ratio > 1 and starting > 0:
        # Pods not ready yet count as idle when scaling up, so that a scale-up already
        # under way is not repeated.
        ratio = view.busy_mean / (current * slots) / HPA_TARGET
        if ratio <= 1 + HPA_TOLERANCE:
            return current
        return math.ceil(ratio * current - 1e-9)
    return math.ceil(ratio * ready - 1e-9)


def make_policy(name: str, config: SimConfig, trace: Trace) -> Policy:
    stages = config.profile.stages
    start = [replicas_needed(trace.rate(0.0), s, PROVISIONED_UTILISATION) for s in stages]
    if name == "planner":
        return PlannerPolicy([planner_settings(s, config) for s in stages], start)
    if name == "static-peak":
        peak = [replicas_needed(trace.peak_rate, s, PROVISIONED_UTILISATION) for s in stages]
        return StaticPolicy("static-peak", peak)
    if name == "utilisation":
        return UtilisationPolicy(start)
    raise ValueError(f"unknown policy {name!r}; one of {', '.join(POLICIES)}")


def planner_settings(stage: StageModel, config: SimConfig) -> Autoscaling:
    if config.latency_percentile is not None:
        objective = LatencyObjective(
            config.latency_percentile, config.latency_multiple * stage.mean_s
        )
        target = None
    else:
        objective, target = None, stage.concurrency * config.target_in_flight
    return Autoscaling(
        min_replicas=1,
        max_replicas=PLANNER_MAX_REPLICAS,
        target_in_flight=target,
        scale_up_window_s=0.0,
        scale_down_window_s=config.scale_down_window_s,
        latency=objective,
        drain_s=config.drain_s,
    )


# --- the simulation --------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class Replica:
    stage: int
    requested_at: float
    ready_at: float | None = None
    left_at: float | None = None
    draining: bool = False
    busy: int = 0


@dataclass(eq=False, slots=True)
class StageSim:
    model: StageModel
    index: int
    starting: list[Replica] = field(default_factory=list)
    # Ready and taking requests, in the order they became ready.
    serving: list[Replica] = field(default_factory=list)
    # Serving replicas by the requests they run (the index), each an insertion-ordered set:
    # the least-loaded one with room is found in at most ``concurrency`` looks.
    by_load: list[dict[Replica, None]] = field(default_factory=list)
    every_replica: list[Replica] = field(default_factory=list)
    # (request, when it entered the stage)
    queue: deque[tuple[int, float]] = field(default_factory=deque)
    # The router's counters: cumulative, as on its /metrics.
    finished: int = 0
    time_sum: float = 0.0
    in_flight: int = 0
    # What the replicas report they worked on the finished requests (their service times).
    execution_sum: float = 0.0
    # Times in stage of the requests finished since the last look.
    window_times: list[float] = field(default_factory=list)
    busy_serving: int = 0
    busy_area: float = 0.0
    area_at: float = 0.0
    peak_asked: int = 0
    scale_ups: int = 0
    scale_downs: int = 0
    reached_at: float | None = None

    def __post_init__(self) -> None:
        self.by_load = [{} for _ in range(self.model.concurrency + 1)]

    @property
    def asked(self) -> int:
        return len(self.starting) + len(self.serving)

    def least_loaded(self) -> Replica | None:
        for bucket in self.by_load[: self.model.concurrency]:
            if bucket:
                return next(iter(bucket))
        return None

    def move(self, replica: Replica, busy: int) -> None:
        del self.by_load[replica.busy][replica]
        replica.busy = busy
        self.by_load[busy][replica] = None

    def count_busy(self, now: float, change: int) -> None:
        self.busy_area += self.busy_serving * (now - self.area_at)
        self.area_at = now
        self.busy_serving += change


@dataclass(frozen=True, slots=True)
class Completion:
    replica: Replica
    request: int
    entered_at: float


@dataclass(frozen=True, slots=True)
class ReplicaReady:
    replica: Replica


@dataclass(frozen=True, slots=True)
class Look:
    """A policy's look at the stages (every interval)."""


@dataclass(frozen=True, slots=True)
class StepUp:
    """The step trace's rise: where its reaction time starts."""


Event = Completion | ReplicaReady | Look | StepUp


@dataclass(frozen=True)
class RunResult:
    trace: str
    policy: str
    requests: int
    p50_s: float
    p99_s: float
    slo_attained: float
    replica_hours: dict[str, float]
    peak_replicas: dict[str, int]
    scale_ups: dict[str, int]
    scale_downs: dict[str, int]
    # The step trace only: seconds from the step up until the stage's ready replicas reach
    # what the new rate needs; None when they never do while the step lasts.
    reaction_s: dict[str, float | None]

    @property
    def total_replica_hours(self) -> float:
        return sum(self.replica_hours.values())


class Simulation:
    def __init__(self, config: SimConfig, trace: Trace, workload: Workload, policy: Policy):
        self.config, self.trace, self.workload, self.policy = config, trace, workload, policy
        self.stages = [StageSim(model, i) for i, model in enumerate(config.profile.stages)]
        self.startup = random.Random(f"{config.seed}/{trace.name}/{policy.name}/startup")
        self.events: list[tuple[float, int, Event]] = []
        self.sequence = 0
        self.latencies: list[float] = []
        self.last_scrape = self._scrape(0.0)
        self.step_needs = (
            [replicas_needed(trace.step.rate, m, 1.0) for m in config.profile.stages]
            if trace.step is not None
            else []
        )

    def run(self) -> RunResult:
        for stage, replicas in zip(self.stages, self.policy.initial_replicas(), strict=True):
            for _ in range(replicas):
                self._make_ready(self._new_replica(stage, 0.0), 0.0)
            stage.peak_asked = stage.asked
        self._push(self.config.interval_s, Look())
        if self.trace.step is not None:
            self._push(self.trace.step.up_at, StepUp())
        arrivals, total = self.workload.arrivals, len(self.workload.arrivals)
        next_request = 0
        while len(self.latencies) < total:
            if next_request < total and (
                not self.events or arrivals[next_request] < self.events[0][0]
            ):
                self._arrive(0, next_request, arrivals[next_request])
                next_request += 1
                continue
            now, _, event = heapq.heappop(self.events)
            self._handle(event, now)
        return self._result()

    def _push(self, at: float, event: Event) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (at, self.sequence, event))

    def _handle(self, event: Event, now: float) -> None:
        if isinstance(event, Completion):
            self._complete(event, now)
        elif isinstance(event, ReplicaReady):
            if event.replica.left_at is None:
                self._make_ready(event.replica, now)
        elif isinstance(event, Look):
            self._look(now)
            self._push(now + self.config.interval_s, Look())
        else:
            self._check_reached(now)

    # Requests.

    def _arrive(self, index: int, request: int, now: float) -> None:
        stage = self.stages[index]
        stage.in_flight += 1
        replica = stage.least_loaded()
        if replica is None:
            stage.queue.append((request, now))
        else:
            self._start(stage, replica, request, now, now)

    def _start(
        self, stage: StageSim, replica: Replica, request: int, entered_at: float, now: float
    ) -> None:
        stage.move(replica, replica.busy + 1)
        stage.count_busy(now, 1)
        service = self.workload.service_s[replica.stage][request]
        self._push(now + service, Completion(replica, request, entered_at))

    def _complete(self, event: Completion, now: float) -> None:
        replica = event.replica
        stage = self.stages[replica.stage]
        spent = now - event.entered_at
        stage.finished += 1
        stage.time_sum += spent
        stage.execution_sum += self.workload.service_s[replica.stage][event.request]
        stage.window_times.append(spent)
        stage.in_flight -= 1
        if replica.draining:
            replica.busy -= 1
            if replica.busy == 0:
                replica.left_at = now
        else:
            stage.move(replica, replica.busy - 1)
            stage.count_busy(now, -1)
        self._serve_queue(stage, now)
        if replica.stage + 1 < len(self.stages):
            self._arrive(replica.stage + 1, event.request, now)
        else:
            self.latencies.append(now - self.workload.arrivals[event.request])

    def _serve_queue(self, stage: StageSim, now: float) -> None:
        while stage.queue:
            replica = stage.least_loaded()
            if replica is None:
                return
            request, entered_at = stage.queue.popleft()
            self._start(stage, replica, request, entered_at, now)

    # Replicas.

    def _new_replica(self, stage: StageSim, now: float) -> Replica:
        replica = Replica(stage.index, requested_at=now)
        stage.every_replica.append(replica)
        stage.starting.append(replica)
        return replica

    def _make_ready(self, replica: Replica, now: float) -> None:
        stage = self.stages[replica.stage]
        stage.starting.remove(replica)
        replica.ready_at = now
        stage.serving.append(replica)
        stage.by_load[0][replica] = None
        self._serve_queue(stage, now)
        self._check_reached(now)

    def _scale(self, stage: StageSim, desired: int, now: float) -> None:
        change = desired - stage.asked
        if change > 0:
            stage.scale_ups += 1
            for _ in range(change):
                replica = self._new_replica(stage, now)
                delay = lognormal(self.startup, self.config.startup_mean_s, self.config.startup_cv)
                self._push(now + delay, ReplicaReady(replica))
        elif change < 0:
            stage.scale_downs += 1
            for _ in range(-change):
                self._remove_one(stage, now)
        stage.peak_asked = max(stage.peak_asked, stage.asked)

    def _remove_one(self, stage: StageSim, now: float) -> None:
        # As a ReplicaSet chooses: a pod not ready yet first, else the newest ready one.
        if stage.starting:
            stage.starting.pop().left_at = now
            return
        replica = stage.serving.pop()
        del stage.by_load[replica.busy][replica]
        stage.count_busy(now, -replica.busy)
        replica.draining = True
        if replica.busy == 0:
            replica.left_at = now

    # Looks.

    def _scrape(self, now: float) -> RouterScrape:
        counters = {
            s.model.name: StageCounters(
                finished=s.finished,
                time_sum=s.time_sum,
                time_count=s.finished,
                in_flight=s.in_flight,
                execution_sum=s.execution_sum if self.config.reports_execution else 0.0,
                execution_count=s.finished if self.config.reports_execution else 0.0,
            )
            for s in self.stages
        }
        return RouterScrape(now, counters)

    def _look(self, now: float) -> None:
        scrape = self._scrape(now)
        names = [s.model.name for s in self.stages]
        observations, _ = observe(names, {"router": self.last_scrape}, {"router": scrape})
        elapsed = now - self.last_scrape.at
        self.last_scrape = scrape
        views = [
            self._view(stage, seen, now, elapsed)
            for stage, seen in zip(self.stages, observations, strict=True)
        ]
        for stage, desired in zip(self.stages, self.policy.desired(now, views), strict=True):
            self._scale(stage, desired, now)

    def _view(
        self, stage: StageSim, seen: StageObservation, now: float, elapsed: float
    ) -> StageView:
        stage.count_busy(now, 0)
        busy_mean = stage.busy_area / elapsed
        stage.busy_area = 0.0
        times = sorted(stage.window_times)
        stage.window_times.clear()
        exact = {p: percentile(times, p) for p in PERCENTILES} if times else {}
        return StageView(
            model=stage.model,
            replicas=stage.asked,
            ready=len(stage.serving),
            observation=dataclasses.replace(seen, time_in_stage_percentiles=exact),
            busy_mean=busy_mean,
        )

    def _check_reached(self, now: float) -> None:
        step = self.trace.step
        if step is None or not step.up_at <= now < step.down_at:
            return
        for stage, need in zip(self.stages, self.step_needs, strict=True):
            if stage.reached_at is None and len(stage.serving) >= need:
                stage.reached_at = now

    def _result(self) -> RunResult:
        latencies = sorted(self.latencies)
        end = self.config.duration_s
        names = [s.model.name for s in self.stages]
        step = self.trace.step
        return RunResult(
            trace=self.trace.name,
            policy=self.policy.name,
            requests=len(latencies),
            p50_s=percentile(latencies, 50) if latencies else 0.0,
            p99_s=percentile(latencies, 99) if latencies else 0.0,
            slo_attained=(
                sum(1 for x in latencies if x <= self.config.slo) / len(latencies)
                if latencies
                else 1.0
            ),
            replica_hours={s.model.name: replica_hours(s, end) for s in self.stages},
            peak_replicas={s.model.name: s.peak_asked for s in self.stages},
            scale_ups={s.model.name: s.scale_ups for s in self.stages},
            scale_downs={s.model.name: s.scale_downs for s in self.stages},
            reaction_s=(
                {
                    name: None if s.reached_at is None else s.reached_at - step.up_at
                    for name, s in zip(names, self.stages, strict=True)
                }
                if step is not None
                else {}
            ),
        )


def replica_hours(stage: StageSim, end: float) -> float:
    """Each replica's time from when it was asked for until it left, within the run."""
    seconds = sum(
        max(0.0, min(end, r.left_at if r.left_at is not None else end) - r.requested_at)
        for r in stage.every_replica
    )
    return seconds / 3600


def percentile(ordered: Sequence[float], p: float) -> float:
    """The ``p`` percentile of ascending ``ordered``, interpolating between neighbours."""
    position = (len(ordered) - 1) * p / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def simulate(config: SimConfig, trace_name: str, policy: Policy | str) -> RunResult:
    """One run of one trace under one policy (by name, or a policy of the caller's)."""
    trace = build_trace(trace_name, config.duration_s, config.scale, config.seed)
    workload = generate_workload(config.profile, trace, config.seed)
    chosen = make_policy(policy, config, trace) if isinstance(policy, str) else policy
    return Simulation(config, trace, workload, chosen).run()


def simulate_all(
    config: SimConfig, traces: Sequence[str], policies: Sequence[str]
) -> list[RunResult]:
    results = []
    for trace_name in traces:
        trace = build_trace(trace_name, config.duration_s, config.scale, config.seed)
        workload = generate_workload(config.profile, trace, config.seed)
        for name in policies:
            policy = make_policy(name, config, trace)
            results.append(Simulation(config, trace, workload, policy).run())
    return results


# --- output ----------------------------------------------------------------------------


def markdown(config: SimConfig, results: Sequence[RunResult]) -> str:
    names = [s.name for s in config.profile.stages]
    last = names[-1]
    lines: list[str] = []
    for trace_name in dict.fromkeys(r.trace for r in results):
        rows = [r for r in results if r.trace == trace_name]
        lines += [
            f"### {trace_name} ({config.profile.name}, {config.duration_s / 3600:g} h, "
            f"scale {config.scale:g}, start-up {config.startup_mean_s:g} s, "
            f"SLO {config.slo:.3g} s)",
            "",
            "| policy | requests | p50 s | p99 s | SLO attained | replica-hours "
            f"({', '.join(names)}, total) | most replicas ({', '.join(names)}) | "
            f"{last} scale-ups / downs |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            hours = ", ".join(f"{r.replica_hours[n]:.1f}" for n in names)
            peaks = ", ".join(str(r.peak_replicas[n]) for n in names)
            lines.append(
                f"| {r.policy} | {r.requests} | {r.p50_s:.1f} | {r.p99_s:.1f} | "
                f"{r.slo_attained:.3f} | {hours}, {r.total_replica_hours:.1f} | {peaks} | "
                f"{r.scale_ups[last]} / {r.scale_downs[last]} |"
            )
        if any(r.reaction_s for r in rows):
            lines += ["", *_reaction_lines(config, rows, names)]
        lines.append("")
    return "\n".join(lines)


def _reaction_lines(config: SimConfig, rows: Sequence[RunResult], names: list[str]) -> list[str]:
    trace = build_trace(rows[0].trace, config.duration_s, config.scale, config.seed)
    assert trace.step is not None
    needs = [replicas_needed(trace.step.rate, s, 1.0) for s in config.profile.stages]
    wanted = ", ".join(f"{n} {k}" for n, k in zip(names, needs, strict=True))
    lines = [
        f"Step reaction: seconds from the step up until the ready replicas reach what "
        f"{trace.step.rate:g} req/s needs ({wanted}); - : not while the step lasts.",
        "",
        f"| policy | {' | '.join(names)} |",
        "|---|" + "---|" * len(names),
    ]
    for r in rows:
        cells = ["-" if r.reaction_s[n] is None else f"{r.reaction_s[n]:.0f}" for n in names]
        lines.append(f"| {r.policy} | {' | '.join(cells)} |")
    return lines


def as_json(config: SimConfig, results: Sequence[RunResult], seconds: float) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "profile": config.profile.name,
        "hours": config.duration_s / 3600,
        "scale": config.scale,
        "startup_s": config.startup_mean_s,
        "slo_s": config.slo,
        "seed": config.seed,
        "wall_s": seconds,
        "runs": {},
    }
    for r in results:
        run = dataclasses.asdict(r)
        run["total_replica_hours"] = r.total_replica_hours
        figures["runs"].setdefault(r.trace, {})[r.policy] = run
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="bagel")
    parser.add_argument("--hours", type=float, default=6.0)
    parser.add_argument("--startup-s", type=float, default=180.0)
    parser.add_argument("--startup-cv", type=float, default=0.3)
    parser.add_argument("--trace", choices=("all", *TRACES), default="all")
    parser.add_argument("--policy", choices=("all", *POLICIES), default="all")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the traces' rates")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--interval-s", type=float, default=15.0)
    parser.add_argument("--slo-s", type=float, help="default: 3x the unloaded service time")
    parser.add_argument(
        "--target-in-flight",
        type=float,
        default=1.0,
        help="the planner's target in flight, as a multiple of the stage's concurrency",
    )
    parser.add_argument("--scale-down-window-s", type=float, default=300.0)
    parser.add_argument(
        "--drain-s",
        type=float,
        default=60.0,
        help="the planner's backlog drain time (Autoscaling.drain_s)",
    )
    parser.add_argument(
        "--latency-percentile",
        type=int,
        choices=PERCENTILES,
        help="the planner scales on this percentile of time in stage instead of in flight",
    )
    parser.add_argument(
        "--latency-multiple",
        type=float,
        default=1.5,
        help="the latency objective, as a multiple of the stage's mean service time",
    )
    parser.add_argument(
        "--no-execution-time",
        action="store_true",
        help="the replicas report no execution time: the planner infers the service time",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    config = SimConfig(
        profile=PROFILES[args.profile],
        duration_s=args.hours * 3600,
        scale=args.scale,
        startup_mean_s=args.startup_s,
        startup_cv=args.startup_cv,
        interval_s=args.interval_s,
        slo_s=args.slo_s,
        seed=args.seed,
        target_in_flight=args.target_in_flight,
        scale_down_window_s=args.scale_down_window_s,
        drain_s=args.drain_s,
        reports_execution=not args.no_execution_time,
        latency_percentile=args.latency_percentile,
        latency_multiple=args.latency_multiple,
    )
    traces = TRACES if args.trace == "all" else (args.trace,)
    policies = POLICIES if args.policy == "all" else (args.policy,)
    started = time.monotonic()
    results = simulate_all(config, traces, policies)
    seconds = time.monotonic() - started
    if args.json:
        print(json.dumps(as_json(config, results, seconds), indent=2))
    else:
        print(markdown(config, results))
        print(f"Simulated in {seconds:.1f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
