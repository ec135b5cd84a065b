"""The router's Prometheus metrics, in a registry of its own (one per app).

Counters and histograms are updated as requests end; per-stage gauges (requests in flight,
live replicas) are read from the pools when Prometheus scrapes, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from omni_runtime.engine.stage.stage_replica_pool import StageReplicaPool

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    """Everything /metrics shows."""

    def __init__(self, pools: Callable[[], Mapping[str, StageReplicaPool]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "omni_router_requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.request_latency = Histogram(
            "omni_router_request_duration_seconds",
            "Time from a request's arrival to its last byte, by endpoint.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        # Read when scraped (the app sets the function): 0 once every request has ended,
        # however it ended, as a test or an operator draining the router can check.
        self.router_in_flight = Gauge(
            "omni_router_in_flight",
            "Requests the router has admitted and not yet finished (streams included).",
            registry=self.registry,
        )
        self.stage_requests = Counter(
            "omni_stage_requests",
            "Stage requests finished, by stage, replica and outcome (ok or error).",
            ["stage", "replica", "outcome"],
            registry=self.registry,
        )
        self.stage_latency = Histogram(
            "omni_stage_request_duration_seconds",
            "Time a stage replica took for one request, by stage.",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.stage_execution = Histogram(
            "omni_stage_execution_seconds",
            "Time a stage replica said it worked on a request, by stage: its engine's time, "
            "without the replica's own queue for a diffusion stage (an LLM stage's includes "
            "the wait for a batch slot). Requests that finished without error.",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.retries = Counter(
            "omni_router_retries",
            "Stage requests the router sent again, invisibly to the caller, by stage and "
            "reason: handed_back (a draining replica returned it unstarted), replica_lost, "
            "revision_gone or input_lost (the request restarted from the first stage).",
            ["stage", "reason"],
            registry=self.registry,
        )
        self.served = Counter(
            "omni_stage_served",
            "Stage requests a replica answered in full, by stage, replica and the pipeline "
            "revision the request ran on.",
            ["stage", "replica", "revision"],
            registry=self.registry,
        )
        self.revision_requests = Counter(
            "omni_router_revision_requests",
            "Requests that completed, by the pipeline revision all their stages ran on.",
            ["revision"],
            registry=self.registry,
        )
        self.registry.register(_PoolCollector(pools))

    def retried(self, stage: str, reason: str) -> None:
        self.retries.labels(stage, reason).inc()

    def stage_served(self, stage: str, replica_id: int, revision: str) -> None:
        self.served.labels(stage, str(replica_id), revision).inc()

    def request_revision(self, revision: str) -> None:
        self.revision_requests.labels(revision).inc()

    def stage_request_done(
        self, stage: str, replica_id: int, latency: float, failed: bool, execute_s: float = 0.0
    ) -> None:
        """The pools' per-request hook."""
        outcome = "error" if failed else "ok"
        self.stage_requests.labels(stage, str(replica_id), outcome).inc()
        self.stage_latency.labels(stage).observe(latency)
        if execute_s > 0 and not failed:
            self.stage_execution.labels(stage).observe(execute_s)


class _PoolCollector(Collector):
    def __init__(self, pools: Callable[[], Mapping[str, StageReplicaPool]]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            "omni_stage_in_flight",
            "Requests a stage is working on (its queue depth), by stage.",
            labels=["stage"],
        )
        replica_in_flight = GaugeMetricFamily(
            "omni_stage_replica_in_flight",
            "Requests in flight on each replica of a stage.",
            labels=["stage", "replica", "address"],
        )
        live = GaugeMetricFamily(
            "omni_stage_live_replicas",
            "Replicas of a stage that take requests.",
            labels=["stage"],
        )
        draining = GaugeMetricFamily(
            "omni_stage_replica_draining",
            "1 for a replica that takes no new requests (it said it is draining, or the "
            "router is removing it), else 0; with the revision it advertised.",
            labels=["stage", "replica", "address", "revision"],
        )
        terminating = GaugeMetricFamily(
            "omni_stage_replica_terminating",
            "1 for a replica whose pod is terminating but still serves (used only where no "
            "revision is complete without it), else 0.",
            labels=["stage", "replica", "address"],
        )
        for name, pool in self._pools().items():
            stats = pool.stats()
            in_flight.add_metric([name], sum(s.in_flight for s in stats))
            live.add_metric([name], pool.live_replica_count)
            for s in stats:
                replica = [name, str(s.replica_id), s.address]
                replica_in_flight.add_metric(replica, s.in_flight)
                draining.add_metric([*replica, s.revision], 0 if s.accepting else 1)
                terminating.add_metric(replica, 1 if s.terminating else 0)
        yield in_flight
        yield replica_in_flight
        yield live
        yield draining
        yield terminating
