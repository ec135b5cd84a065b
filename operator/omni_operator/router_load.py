"""Each stage's load, from what the pipeline's routers report on /metrics.

Every router replica counts the stage requests it sent (``omni_stage_requests``), how long
each took (``omni_stage_request_duration_seconds``: a histogram of the time in stage,
queue and execution) and how many are in each stage now (``omni_stage_in_flight``). Two
scrapes of one router give, per stage, the requests that entered (finished plus the growth
of those in flight) and the time they spent; summed over the routers, that is the stage's
arrival rate and mean time in stage that the planner (planner.py) sizes it from. Where the
replicas report the time they worked on each request (``omni_stage_execution_seconds``),
its mean is the stage's service time, free of the queue.

The same in units of work (``omni_stage_work_units``: steps x pixels x images for a
diffusion stage, as least-outstanding-work weighs a request): the work that finished and
the work in the stage now give the work that arrived, and each router's cost fit
(``omni_stage_seconds_per_request`` and ``omni_stage_seconds_per_work_unit``, from the
replicas' execution times) turns it into seconds. A burst of large images shows in the
work at once, where the requests' mean service time would learn it a look at a time.

Pure: text in, numbers out; fetching is the autoscaler's (autoscaler.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from .planner import StageObservation

FINISHED = "omni_stage_requests_total"
TIME_IN_STAGE = "omni_stage_request_duration_seconds"
IN_FLIGHT = "omni_stage_in_flight"
EXECUTION = "omni_stage_execution_seconds"
WORK = "omni_stage_work_units_total"
OUTSTANDING_WORK = "omni_stage_outstanding_work_units"
SECONDS_PER_REQUEST = "omni_stage_seconds_per_request"
SECONDS_PER_WORK = "omni_stage_seconds_per_work_unit"
PERCENTILES = (50, 90, 95, 99)


class MetricsError(ValueError):
    """A router's /metrics could not be read as Prometheus text."""


@dataclass(frozen=True)
class StageCounters:
    """One router's numbers for one stage: cumulative counts since it started, and the
    requests in the stage now."""

    finished: float = 0.0
    time_sum: float = 0.0
    time_count: float = 0.0
    # (upper bound, cumulative count), ascending; the last bound is +Inf.
    buckets: tuple[tuple[float, float], ...] = ()
    in_flight: float = 0.0
    execution_sum: float = 0.0
    execution_count: float = 0.0
    # Work of the requests finished; None from a router that exports no work.
    work: float | None = None
    outstanding_work: float = 0.0
    # (seconds per request, seconds per unit of work); None before a replica ran one.
    cost: tuple[float, float] | None = None


@dataclass(frozen=True)
class RouterScrape:
    """One router replica's /metrics at one moment (monotonic seconds)."""

    at: float
    stages: Mapping[str, StageCounters]


def parse_router_metrics(text: str) -> dict[str, StageCounters]:
    """Per stage, what a router's /metrics says of it."""
    finished: dict[str, float] = {}
    time_sum: dict[str, float] = {}
    time_count: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    in_flight: dict[str, float] = {}
    execution_sum: dict[str, float] = {}
    execution_count: dict[str, float] = {}
    work: dict[str, float] = {}
    outstanding_work: dict[str, float] = {}
    per_request: dict[str, float] = {}
    per_work: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise MetricsError(f"not Prometheus text: {e}") from None
    for family in families:
        for sample in family.samples:
            stage = sample.labels.get("stage")
            if stage is None:
                continue
            if sample.name == FINISHED:
                finished[stage] = finished.get(stage, 0.0) + sample.value
            elif sample.name == f"{TIME_IN_STAGE}_sum":
                time_sum[stage] = sample.value
            elif sample.name == f"{TIME_IN_STAGE}_count":
                time_count[stage] = sample.value
            elif sample.name == f"{TIME_IN_STAGE}_bucket":
                bound = float(sample.labels.get("le", "+Inf"))
                buckets.setdefault(stage, {})[bound] = sample.value
            elif sample.name == IN_FLIGHT:
                in_flight[stage] = sample.value
            elif sample.name == f"{EXECUTION}_sum":
                execution_sum[stage] = sample.value
            elif sample.name == f"{EXECUTION}_count":
                execution_count[stage] = sample.value
            elif sample.name == WORK:
                work[stage] = sample.value
            elif sample.name == OUTSTANDING_WORK:
                outstanding_work[stage] = sample.value
            elif sample.name == SECONDS_PER_REQUEST:
                per_request[stage] = sample.value
            elif sample.name == SECONDS_PER_WORK:
                per_work[stage] = sample.value
    names = set(finished) | set(time_count) | set(in_flight)
    return {
        name: StageCounters(
            finished=finished.get(name, 0.0),
            time_sum=time_sum.get(name, 0.0),
            time_count=time_count.get(name, 0.0),
            buckets=tuple(sorted(buckets.get(name, {}).items())),
            in_flight=in_flight.get(name, 0.0),
            execution_sum=execution_sum.get(name, 0.0),
            execution_count=execution_count.get(name, 0.0),
            work=work.get(name, 0.0) if name in work or name in outstanding_work else None,
            outstanding_work=outstanding_work.get(name, 0.0),
            cost=(per_request[name], per_work[name])
            if name in per_request and name in per_work
            else None,
        )
        for name in names
    }


def observe(
    stages: Sequence[str],
    before: Mapping[str, RouterScrape],
    after: Mapping[str, RouterScrape],
) -> tuple[list[StageObservation], bool]:
    """Each stage's load between two rounds of scrapes (router -> scrape), and whether it
    is whole: False when a router has no earlier scrape to compare with (it just appeared),
    so that its arrivals are unknown and only its requests in flight count."""
    complete = True
    totals = {name: _Window() for name in stages}
    for router, now in after.items():
        then = before.get(router)
        if then is None or now.at <= then.at:
            complete = False
        for name, window in totals.items():
            counters = now.stages.get(name, StageCounters())
            window.hold(counters)
            if then is None or now.at <= then.at:
                continue
            earlier = then.stages.get(name, StageCounters())
            window.add(_delta(earlier, counters), now.at - then.at)
    return [window.observation(name) for name, window in totals.items()], complete


@dataclass
class _Delta:
    finished: float
    time_sum: float
    time_count: float
    buckets: tuple[tuple[float, float], ...]
    in_flight_change: float
    execution_sum: float
    execution_count: float
    # None where either scrape has no work (a router of an older revision).
    work: float | None
    outstanding_work_change: float


def _delta(then: StageCounters, now: StageCounters) -> _Delta:
    # A counter that went down belongs to a restarted router: all of it is new.
    restarted = now.finished < then.finished or now.time_count < then.time_count
    base = StageCounters(in_flight=then.in_flight) if restarted else then
    earlier = dict(base.buckets)
    work = None
    if now.work is not None and (base.work is not None or restarted):
        work = now.work - (base.work or 0.0)
    return _Delta(
        finished=now.finished - base.finished,
        time_sum=now.time_sum - base.time_sum,
        time_count=now.time_count - base.time_count,
        buckets=tuple((bound, count - earlier.get(bound, 0.0)) for bound, count in now.buckets),
        in_flight_change=now.in_flight - then.in_flight,
        execution_sum=now.execution_sum - base.execution_sum,
        execution_count=now.execution_count - base.execution_count,
        work=work,
        outstanding_work_change=now.outstanding_work - then.outstanding_work,
    )


@dataclass
class _Window:
    arrival_rate: float = 0.0
    time_sum: float = 0.0
    time_count: float = 0.0
    in_flight: float = 0.0
    buckets: dict[float, float] | None = None
    execution_sum: float = 0.0
    execution_count: float = 0.0
    # None once a router in the window had no work to tell.
    work_rate: float | None = 0.0
    outstanding_work: float | None = 0.0
    costs: list[tuple[float, float]] | None = None

    def hold(self, counters: StageCounters) -> None:
        """What one router has in the stage now."""
        self.in_flight += counters.in_flight
        if counters.work is None or self.outstanding_work is None:
            self.outstanding_work = None
        else:
            self.outstanding_work += counters.outstanding_work
        if counters.cost is not None:
            self.costs = [*(self.costs or []), counters.cost]

    def add(self, delta: _Delta, seconds: float) -> None:
        entered = max(0.0, delta.finished + delta.in_flight_change)
        self.arrival_rate += entered / seconds
        if delta.work is None or self.work_rate is None:
            self.work_rate = None
        else:
            self.work_rate += max(0.0, delta.work + delta.outstanding_work_change) / seconds
        self.time_sum += delta.time_sum
        self.time_count += delta.time_count
        self.execution_sum += delta.execution_sum
        self.execution_count += delta.execution_count
        merged = self.buckets if self.buckets is not None else {}
        for bound, count in delta.buckets:
            merged[bound] = merged.get(bound, 0.0) + count
        self.buckets = merged

    def observation(self, stage: str) -> StageObservation:
        mean = self.time_sum / self.time_count if self.time_count > 0 else 0.0
        buckets = sorted((self.buckets or {}).items())
        percentiles = {p: q for p in PERCENTILES if (q := quantile(p / 100, buckets)) is not None}
        execution = self.execution_sum / self.execution_count if self.execution_count > 0 else None
        costs = self.costs or []
        cost = (
            (sum(c[0] for c in costs) / len(costs), sum(c[1] for c in costs) / len(costs))
            if costs
            else None
        )
        return StageObservation(
            stage=stage,
            arrival_rate=self.arrival_rate,
            time_in_stage=mean,
            in_flight=round(self.in_flight),
            time_in_stage_percentiles=percentiles,
            execution_time=execution,
            work_rate=self.work_rate,
            outstanding_work=self.outstanding_work,
            cost=cost,
        )


def quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a cumulative histogram ((upper bound, count) ascending, the
    last +Inf), interpolating linearly within the bucket it falls in, as Prometheus'
    histogram_quantile does; None for an empty one. In the +Inf bucket: the highest finite
    bound (the histogram knows no more)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound
