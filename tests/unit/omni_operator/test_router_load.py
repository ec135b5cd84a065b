"""Each stage's load from the routers' /metrics (omni_operator.router_load), on the text a
real router's registry writes."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from omni_operator.router_load import (
    MetricsError,
    RouterScrape,
    observe,
    parse_router_metrics,
    quantile,
)
from omni_runtime.router.metrics import RouterMetrics


class FakePool:
    """What the metrics' collector reads of a stage's replica pool: in flight per replica,
    their work and the replica's cost fit."""

    def __init__(
        self, in_flight: int, work: float = 0.0, cost: tuple[float, float] | None = None
    ) -> None:
        self.in_flight = in_flight
        self.work = work
        self.cost = cost
        self.live_replica_count = 1

    def stats(self) -> list[object]:
        from types import SimpleNamespace

        return [
            SimpleNamespace(
                replica_id=0,
                address="tcp://10.0.0.1:9000",
                in_flight=self.in_flight,
                accepting=True,
                revision="1-abc",
                terminating=False,
                outstanding_work=self.work,
                cost=self.cost,
                max_adapters=0,
                running_adapters=(),
            )
        ]


def router_text(
    finished: dict[str, list[float]],
    in_flight: dict[str, int],
    executing: float = 0.0,
    work: float = 1.0,
    held_work: float = 0.0,
    cost: tuple[float, float] | None = None,
) -> str:
    """/metrics of a router whose stages finished requests taking ``finished`` seconds, of
    which the replicas said they worked ``executing`` (0: they said nothing), each of
    ``work`` units; the requests in flight hold ``held_work`` units on a replica whose fit
    is ``cost``."""
    pools = {name: FakePool(n, held_work, cost) for name, n in in_flight.items()}
    metrics = RouterMetrics(lambda: pools)  # type: ignore[arg-type, return-value]
    for stage, times in finished.items():
        for seconds in times:
            metrics.stage_request_done(stage, 0, seconds, False, executing, work)
    return generate_latest(metrics.registry).decode()


def test_a_routers_text_gives_each_stages_counts() -> None:
    text = router_text({"dit": [0.1, 0.2, 0.3], "thinker": [0.01]}, {"dit": 2, "thinker": 0})
    stages = parse_router_metrics(text)
    assert stages["dit"].finished == 3
    assert stages["dit"].time_count == 3
    assert stages["dit"].time_sum == pytest.approx(0.6)
    assert stages["dit"].in_flight == 2
    assert stages["dit"].buckets[-1] == (float("inf"), 3)
    assert stages["thinker"].finished == 1


def test_text_that_is_not_prometheus_is_refused() -> None:
    with pytest.raises(MetricsError, match="not Prometheus text"):
        parse_router_metrics("<html>502 Bad Gateway</html>\n")


def test_two_scrapes_give_arrival_rate_time_in_stage_and_percentiles() -> None:
    before = {
        "r0": RouterScrape(0.0, parse_router_metrics(router_text({"dit": [0.1]}, {"dit": 1})))
    }
    # 10 s later: 20 more finished (0.1 s each), and in flight grew from 1 to 5.
    after_text = router_text({"dit": [0.1] * 21}, {"dit": 5})
    after = {"r0": RouterScrape(10.0, parse_router_metrics(after_text))}
    (dit,), complete = observe(["dit"], before, after)
    assert complete
    assert dit.arrival_rate == pytest.approx((20 + 4) / 10)
    assert dit.time_in_stage == pytest.approx(0.1)
    assert dit.in_flight == 5
    assert 0.05 < dit.time_in_stage_percentiles[90] <= 0.1


def test_routers_are_summed_and_a_new_one_makes_it_incomplete() -> None:
    text = router_text({"dit": [0.2] * 10}, {"dit": 3})
    empty = router_text({}, {"dit": 0})
    before = {"r0": RouterScrape(0.0, parse_router_metrics(empty))}
    after = {
        "r0": RouterScrape(5.0, parse_router_metrics(text)),
        "r1": RouterScrape(5.0, parse_router_metrics(text)),  # no earlier scrape
    }
    (dit,), complete = observe(["dit"], before, after)
    assert not complete
    # r0: 10 finished + 3 more in flight over 5 s; r1 adds its requests in flight only.
    assert dit.arrival_rate == pytest.approx(13 / 5)
    assert dit.in_flight == 6


def test_a_restarted_router_counts_from_zero() -> None:
    busy = router_text({"dit": [0.2] * 50}, {"dit": 0})
    restarted = router_text({"dit": [0.2] * 4}, {"dit": 0})
    before = {"r0": RouterScrape(0.0, parse_router_metrics(busy))}
    after = {"r0": RouterScrape(2.0, parse_router_metrics(restarted))}
    (dit,), _ = observe(["dit"], before, after)
    assert dit.arrival_rate == pytest.approx(2.0)  # 4 over 2 s, not -46


def test_a_stage_the_routers_do_not_report_is_idle() -> None:
    (vae,), complete = observe(["vae"], {}, {})
    assert complete
    assert (vae.arrival_rate, vae.in_flight, vae.time_in_stage_percentiles) == (0.0, 0, {})


def test_quantile_interpolates_within_a_bucket_as_prometheus_does() -> None:
    buckets = [(0.1, 0.0), (0.5, 10.0), (1.0, 20.0), (float("inf"), 20.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.5)
    assert quantile(0.75, buckets) == pytest.approx(0.75)
    assert quantile(0.25, buckets) == pytest.approx(0.3)
    assert quantile(0.9, [(1.0, 1.0), (float("inf"), 10.0)]) == 1.0
    assert quantile(0.9, [(1.0, 0.0), (float("inf"), 0.0)]) is None


def test_the_replicas_own_time_is_the_execution_time_free_of_the_queue() -> None:
    before = {"r0": RouterScrape(0.0, parse_router_metrics(router_text({}, {"dit": 0})))}
    # 10 requests, 2 s each in the stage, of which 0.5 s the replica worked on them.
    text = router_text({"dit": [2.0] * 10}, {"dit": 0}, executing=0.5)
    after = {"r0": RouterScrape(10.0, parse_router_metrics(text))}
    (dit,), _ = observe(["dit"], before, after)
    assert dit.time_in_stage == pytest.approx(2.0)
    assert dit.execution_time == pytest.approx(0.5)
    # A router whose replicas report nothing: no execution time, not a zero one.
    silent = {"r0": RouterScrape(10.0, parse_router_metrics(router_text({"dit": [2.0]}, {})))}
    (dit,), _ = observe(["dit"], before, silent)
    assert dit.execution_time is None


def test_the_work_that_arrived_and_the_routers_cost_fit() -> None:
    empty = router_text({}, {"dit": 0})
    before = {"r0": RouterScrape(0.0, parse_router_metrics(empty))}
    # 10 s later: 4 requests of 12.5 units finished, and 30 units are in the stage.
    text = router_text({"dit": [1.0] * 4}, {"dit": 2}, work=12.5, held_work=30, cost=(0.5, 2))
    other = router_text({}, {"dit": 0}, cost=(1.5, 4.0))
    after = {
        "r0": RouterScrape(10.0, parse_router_metrics(text)),
        "r1": RouterScrape(10.0, parse_router_metrics(other)),
    }
    before["r1"] = RouterScrape(0.0, parse_router_metrics(empty))
    (dit,), _ = observe(["dit"], before, after)
    assert dit.work_rate == pytest.approx((4 * 12.5 + 30) / 10)
    assert dit.outstanding_work == 30
    assert dit.cost == pytest.approx((1.0, 3.0))  # the routers' mean


def test_a_router_that_counts_no_work_leaves_the_stage_without_it() -> None:
    text = router_text({"dit": [1.0]}, {"dit": 0})
    lines = [line for line in text.splitlines() if "work_units" not in line]
    before = {"r0": RouterScrape(0.0, parse_router_metrics("\n".join(lines) + "\n"))}
    after = {"r0": RouterScrape(10.0, parse_router_metrics("\n".join(lines) + "\n"))}
    (dit,), _ = observe(["dit"], before, after)
    assert (dit.work_rate, dit.outstanding_work, dit.cost) == (None, None, None)
