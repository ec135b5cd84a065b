"""The autoscaling planner's policy on synthetic observations (omni_operator.planner)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from omni_operator.planner import (
    Autoscaling,
    Decision,
    GroupState,
    LatencyObjective,
    Memory,
    Recommendation,
    StageObservation,
    plan,
)

DIT = Autoscaling(min_replicas=1, max_replicas=8, target_in_flight=2, scale_down_window_s=300)


def dit(
    rate: float,
    in_flight: int = 0,
    replicas: int = 1,
    settings: Autoscaling = DIT,
    complete: bool = True,
) -> GroupState:
    # The DiT of the tiny pipeline: 124 ms a request.
    stage = StageObservation("dit", rate, 0.124, in_flight)
    return GroupState("dit", replicas, settings, [stage], complete)


def run(
    states: Sequence[GroupState], now: float, history: dict[str, list[Recommendation]]
) -> list[Decision]:
    """One look, with ``history`` as the recommendations remembered (updated in place)."""
    decisions, kept = plan(states, now, Memory(recommendations=history))
    history.clear()
    history.update({group: list(r) for group, r in kept.recommendations.items()})
    return decisions


def test_a_step_up_scales_at_once_to_littles_law() -> None:
    # 40 req/s x 0.124 s = 4.96 requests held, 2 per replica -> 3.
    (decision,) = run([dit(40.0)], 0.0, {})
    assert (decision.current, decision.desired) == (1, 3)
    assert "scaling up 1 -> 3" in decision.reason
    assert "40 req/s" in decision.reason


def test_a_backlog_adds_the_replicas_that_drain_it_within_the_drain_time() -> None:
    gpu_dit = Autoscaling(1, 100, target_in_flight=1, scale_down_window_s=0, drain_s=120)
    # 1 req/s x 6 s = 6 replicas serving; 100 in flight on 4 ready: 96 queued x 6 s of
    # work over 120 s = 4.8 more.
    stage = StageObservation("dit", 1.0, 6.0, in_flight=100)
    (decision,) = run([GroupState("dit", 4, gpu_dit, [stage])], 0.0, {})
    assert decision.desired == 11
    assert "96 queued over 120 s = 4.8" in decision.reason


def test_requests_in_flight_hold_the_replicas_that_hold_them() -> None:
    quick = Autoscaling(1, 8, target_in_flight=2, scale_down_window_s=0)
    # Nothing arrives any more, but 9 requests are in the stage: 5 replicas hold them.
    (decision,) = run([dit(0.0, in_flight=9, replicas=6, settings=quick)], 0.0, {})
    assert decision.desired == 5
    assert "the requests in flight need them" in decision.reason
    (decision,) = run([dit(0.0, in_flight=9, replicas=5, settings=quick)], 0.0, {})
    assert decision.desired == 5


def test_the_service_time_is_remembered_from_looks_without_a_backlog() -> None:
    gpu_dit = Autoscaling(1, 1000, target_in_flight=1, scale_down_window_s=300, drain_s=120)
    # Steady: 3 req/s, 6 s each, 18 in flight on 24 replicas: no backlog, so 6 s is the
    # service time.
    calm = StageObservation("dit", 3.0, 6.0, in_flight=18)
    decisions, memory = plan([GroupState("dit", 24, gpu_dit, [calm])], 0.0, Memory())
    assert memory.service_time == {"dit": 6.0}
    # The load doubles: the queue grows while new replicas start, and the time in stage
    # (30 s) is mostly that queue. Sized from it, 6 x 30 = 180 replicas; from the service
    # time, 6 x 6 = 36 serving and 276 queued x 6 s over 120 s = 13.8 draining.
    busy = StageObservation("dit", 6.0, 30.0, in_flight=300)
    decisions, memory = plan([GroupState("dit", 24, gpu_dit, [busy])], 15.0, memory)
    assert decisions[0].desired == 50
    assert memory.service_time == {"dit": 6.0}  # a backlog teaches nothing of it
    # Unqueued again, a slower service time moves the memory part of the way.
    slower = StageObservation("dit", 3.0, 8.0, in_flight=20)
    _, memory = plan([GroupState("dit", 50, gpu_dit, [slower])], 30.0, memory)
    assert memory.service_time["dit"] == pytest.approx(6.6)


def test_a_need_within_ten_percent_of_the_replicas_keeps_them() -> None:
    # 40 req/s x 0.124 s / 0.5 = 9.92: within 10 % of 10, so 10 stay (and 9 would go up).
    half = Autoscaling(1, 20, target_in_flight=0.5, scale_down_window_s=0)
    assert run([dit(40.0, replicas=10, settings=half)], 0.0, {})[0].desired == 10
    assert run([dit(40.0, replicas=11, settings=half)], 0.0, {})[0].desired == 11
    assert run([dit(40.0, replicas=8, settings=half)], 0.0, {})[0].desired == 10


def test_a_step_down_waits_out_the_window_then_goes() -> None:
    history: dict[str, list[Recommendation]] = {}
    assert run([dit(40.0, replicas=1)], 0.0, history)[0].desired == 3
    # The load stops: for the window, the burst's recommendation holds the replicas.
    for t in (10.0, 100.0, 299.0):
        (decision,) = run([dit(0.0, replicas=3)], t, history)
        assert decision.desired == 3, t
        assert "scale-down window" in decision.reason
    (decision,) = run([dit(0.0, replicas=3)], 301.0, history)
    assert (decision.desired, decision.reason.startswith("scaling down 3 -> 1")) == (1, True)


def test_noise_within_the_window_scales_down_only_to_its_peak() -> None:
    history: dict[str, list[Recommendation]] = {}
    rates = [40.0, 10.0, 30.0, 5.0]  # needs 3, 1, 2, 1
    replicas = 1
    for t, rate in enumerate(rates):
        replicas = run([dit(rate, replicas=replicas)], float(t), history)[0].desired
    assert replicas == 3  # never down within the window: its peak was 3
    replicas = run([dit(5.0, replicas=replicas)], 302.0, history)[0].desired
    assert replicas == 2  # the 30 req/s of t=2 is still in the window (300 s)


def test_max_and_min_hold_and_bound_changes_apply_at_once() -> None:
    (decision,) = run([dit(1000.0)], 0.0, {})
    assert decision.desired == DIT.max_replicas
    (decision,) = run([dit(0.0, replicas=1)], 0.0, {})
    assert decision.desired == DIT.min_replicas
    lowered = Autoscaling(min_replicas=1, max_replicas=2, target_in_flight=2)
    (decision,) = run([dit(40.0, replicas=6, settings=lowered)], 0.0, {})
    assert decision.desired == 2
    raised = Autoscaling(min_replicas=4, max_replicas=8, target_in_flight=2)
    (decision,) = run([dit(0.0, replicas=1, settings=raised)], 0.0, {})
    assert decision.desired == 4


def test_a_group_takes_the_largest_need_of_its_stages() -> None:
    thinker = StageObservation("thinker", 40.0, 0.008, 0)  # 0.32 held -> 1
    dit_stage = StageObservation("dit", 40.0, 0.124, 0)  # 4.96 held -> 3
    state = GroupState("thinker-dit", 1, DIT, [thinker, dit_stage])
    (decision,) = run([state], 0.0, {})
    assert decision.desired == 3
    assert decision.reason.count("dit:") == 1


def test_a_router_missing_from_the_scrape_never_scales_down() -> None:
    history: dict[str, list[Recommendation]] = {}
    (decision,) = run([dit(0.0, replicas=3, complete=False)], 1000.0, history)
    assert decision.desired == 3
    assert "not every router" in decision.reason
    # It may still scale up: what was seen is a lower bound on the load.
    (decision,) = run([dit(80.0, replicas=3, complete=False)], 1001.0, history)
    assert decision.desired == 5


def test_an_up_window_takes_the_smallest_recent_need() -> None:
    slow_up = Autoscaling(1, 8, 2, scale_up_window_s=30, scale_down_window_s=300)
    history: dict[str, list[Recommendation]] = {}
    assert run([dit(0.0, settings=slow_up)], 0.0, history)[0].desired == 1
    (decision,) = run([dit(40.0, settings=slow_up)], 10.0, history)
    assert decision.desired == 1  # the need of t=0 is still in the 30 s window
    assert "scale-up window" in decision.reason
    assert run([dit(40.0, settings=slow_up)], 41.0, history)[0].desired == 3


def test_old_recommendations_are_dropped_but_the_newest_shows_how_long_it_watched() -> None:
    history: dict[str, list[Recommendation]] = {
        "dit": [Recommendation(0.0, 8), Recommendation(500.0, 8)]
    }
    (decision,) = run([dit(0.0, replicas=3)], 1000.0, history)
    # The 8s are older than the window: they neither count nor hold the replicas up.
    assert decision.desired == 1
    assert [r.at for r in history["dit"]] == [500.0, 1000.0]


def test_a_planner_that_just_started_does_not_scale_down_before_a_whole_window() -> None:
    # An operator restarted mid-burst has no history: the window's peak is unknown.
    history: dict[str, list[Recommendation]] = {}
    (decision,) = run([dit(0.0, replicas=4)], 1000.0, history)
    assert decision.desired == 4
    assert "watched 0 s of the 300 s scale-down window" in decision.reason
    assert run([dit(0.0, replicas=4)], 1299.0, history)[0].desired == 4
    assert run([dit(0.0, replicas=4)], 1300.0, history)[0].desired == 1
    # Scaling up needs no history.
    assert run([dit(80.0, replicas=1)], 0.0, {})[0].desired == 5


LATENCY = Autoscaling(
    min_replicas=1,
    max_replicas=10,
    target_in_flight=None,
    scale_down_window_s=0,
    latency=LatencyObjective(percentile=90, seconds=1.0),
)


def timed(
    p90: float | None, replicas: int, ready: int | None = None, in_flight: int = 0
) -> GroupState:
    percentiles = {} if p90 is None else {90: p90, 50: p90 / 2}
    stage = StageObservation("dit", 10.0, 0.5, in_flight, percentiles)
    return GroupState("dit", replicas, LATENCY, [stage], ready_replicas=ready)


def test_a_latency_objective_scales_by_how_far_the_percentile_is_from_it() -> None:
    (decision,) = run([timed(2.5, replicas=2)], 0.0, {})
    assert decision.desired == 5  # 2 x 2.5 s / 1 s
    assert "p90 2.5 s in stage against 1 s on 2 ready of 2 -> 5" in decision.reason
    # At most double or +4 a look, as the HPA: 2 x 10 = 20 would overshoot.
    assert run([timed(10.0, replicas=2)], 0.0, {})[0].desired == 6
    # Well under the objective: fewer replicas would do.
    assert run([timed(0.4, replicas=5)], 0.0, {})[0].desired == 2
    # Within the tolerance: nothing moves.
    assert run([timed(1.08, replicas=3)], 0.0, {})[0].desired == 3
    assert run([timed(0.92, replicas=3)], 0.0, {})[0].desired == 3


def test_a_latency_objective_waits_for_the_replicas_still_starting() -> None:
    # 4 wanted, 2 ready: the latency is what 2 give; the 2 starting will lower it.
    assert run([timed(2.0, replicas=4, ready=2)], 0.0, {})[0].desired == 4
    # Down it goes from the ready ones: 2 ready x 0.4 = 1.
    assert run([timed(0.4, replicas=4, ready=2)], 0.0, {})[0].desired == 1


def test_with_nothing_finished_requests_in_flight_hold_the_replicas() -> None:
    assert run([timed(None, replicas=3, in_flight=2)], 0.0, {})[0].desired == 3
    assert run([timed(None, replicas=3, in_flight=0)], 0.0, {})[0].desired == 1


def test_both_targets_take_the_larger_need() -> None:
    both = Autoscaling(1, 10, 2, scale_down_window_s=0, latency=LatencyObjective(90, 1.0))
    # Little's law: 10 req/s x 0.5 s = 5 held, 2 per replica -> 3; latency on 2 ready -> 2.
    stage = StageObservation("dit", 10.0, 0.5, 0, {90: 1.0})
    (decision,) = run([GroupState("dit", 2, both, [stage])], 0.0, {})
    assert decision.desired == 3


def test_a_reported_execution_time_is_the_service_time_even_under_a_backlog() -> None:
    gpu_dit = Autoscaling(1, 1000, target_in_flight=1, scale_down_window_s=300, drain_s=120)
    # No calm look yet, but the replicas say 6 s of the 30 s in stage was their work.
    busy = StageObservation("dit", 6.0, 30.0, in_flight=300, execution_time=6.0)
    decisions, memory = plan([GroupState("dit", 24, gpu_dit, [busy])], 0.0, Memory())
    assert decisions[0].desired == 50  # 6 x 6 = 36, + 276 x 6 / 120 = 13.8
    assert memory.service_time == {"dit": 6.0}


def test_a_queue_that_stands_asks_for_what_holds_it() -> None:
    # A closed loop of 5 clients on one DiT: it serves at its capacity (8 req/s x 0.124 s
    # = 1 replica busy), and 4 wait. The rate alone asks for nothing more.
    settings = Autoscaling(1, 8, target_in_flight=1, scale_down_window_s=300)
    loop = StageObservation("dit", 8.0, 0.62, in_flight=5, execution_time=0.124)
    decisions, memory = plan([GroupState("dit", 1, settings, [loop])], 0.0, Memory())
    assert decisions[0].desired == 1  # once may be a burst
    decisions, memory = plan([GroupState("dit", 1, settings, [loop])], 15.0, memory)
    assert decisions[0].desired == 5
    assert "5 in flight on 1 ready, 1 per replica, not fewer than the 5" in decisions[0].reason
    # While the new replicas start, or once the queue drains, it asks nothing more.
    starting = GroupState("dit", 5, settings, [loop], ready_replicas=1)
    assert plan([starting], 30.0, memory)[0][0].desired == 5
    fewer = StageObservation("dit", 8.0, 0.3, in_flight=3, execution_time=0.124)
    decisions, _ = plan([GroupState("dit", 2, settings, [fewer])], 30.0, memory)
    assert decisions[0].desired == 2


def test_work_sizes_a_change_of_mix_at_the_first_look() -> None:
    gpu_dit = Autoscaling(1, 1000, target_in_flight=1, scale_down_window_s=300, drain_s=120)
    # Replicas fitted at 0.5 s per request + 2 s per unit (one 1024x1024 step). Small
    # images (256x256, 4 steps: 1/4 unit, 1 s each) at 2 req/s keep 2 replicas busy.
    cost = (0.5, 2.0)
    small = StageObservation(
        "dit", 2.0, 1.0, 2, execution_time=1.0, work_rate=0.5, outstanding_work=0.5, cost=cost
    )
    decisions, memory = plan([GroupState("dit", 2, gpu_dit, [small])], 0.0, Memory())
    assert decisions[0].desired == 2
    assert "0.5 units of work/s and 2 req/s = 2 s/s" in decisions[0].reason
    # The same rate of large ones (1024x1024, 50 steps: 50 units, 100.5 s each), none
    # finished yet: 2 x 0.5 + 100 x 2 = 201 s of work a second, and 28 queued x 100.5 s
    # over 120 s = 23.45 more.
    large = StageObservation(
        "dit", 2.0, 1.0, 30, execution_time=1.0, work_rate=100.0, outstanding_work=1500.0,
        cost=cost,
    )  # fmt: skip
    decisions, _ = plan([GroupState("dit", 2, gpu_dit, [large])], 15.0, memory)
    assert decisions[0].desired == 225
    # Without the work, the service time the small ones taught asks for 3.
    blind = StageObservation("dit", 2.0, 1.0, 30, execution_time=1.0)
    decisions, _ = plan([GroupState("dit", 2, gpu_dit, [blind])], 15.0, memory)
    assert decisions[0].desired == 3


def test_work_without_a_cost_fit_leaves_the_request_rule() -> None:
    # Routers that count work but whose replicas have run nothing yet: no seconds per unit.
    stage = StageObservation("dit", 40.0, 0.124, 0, work_rate=10.0, outstanding_work=0.0)
    (decision,) = run([GroupState("dit", 1, DIT, [stage])], 0.0, {})
    assert decision.desired == 3
    assert "40 req/s x 0.124 s" in decision.reason
