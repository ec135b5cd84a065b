"""The router's Prometheus metrics, in a registry of its own (one per app).

Counters and histograms are updated as requests end; per-stage gauges (requests in flight,
live replicas) are read from the pools when Prometheus scrapes, so they are never stale.

The pipeline's queue is also exported under the names vLLM's server gives its own
(``vllm:num_requests_running`` and ``vllm:num_requests_waiting``, labelled ``model_name``),
so that what reads vLLM's endpoints (KEDA queries, llm-d's and the Gateway API inference
extension's endpoint pickers, dashboards) reads a pipeline's router the same way. Their
sum is the router's requests in flight, as vLLM's sum is its engine's: a request counts as
running while some stage replica works on it in one of its batch slots, and as waiting
otherwise (behind a replica's full batch, or between stages).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from omni_runtime.config import StageConfig
from omni_runtime.router.stage_replica_pool import StageReplicaPool

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    """Everything /metrics shows."""

    def __init__(
        self,
        pools: Callable[[], Mapping[str, StageReplicaPool]],
        *,
        model_name: str = "",
        batch_slots: Mapping[str, int | None] | None = None,
    ) -> None:
        """``batch_slots``: requests one replica of each stage runs at once (None: as many
        as it is sent, an LLM stage without ``maxNumSeqs``)."""
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
        # Read when scraped (the app sets ``in_flight``): 0 once every request has ended,
        # however it ended, as a test or an operator draining the router can check.
        self.in_flight: Callable[[], int] = lambda: 0
        self.router_in_flight = Gauge(
            "omni_router_in_flight",
            "Requests the router has admitted and not yet finished (streams included).",
            registry=self.registry,
        )
        self.router_in_flight.set_function(self.read_in_flight)
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
        self.stage_work = Counter(
            "omni_stage_work_units",
            "Work of the stage requests finished (ok or error), by stage: steps x pixels (in "
            "1024x1024 images) x images x frames for a diffusion stage, 1 per request where "
            "a stage has no estimate. With omni_stage_outstanding_work_units, the work that "
            "arrived, which the autoscaler sizes a stage from.",
            ["stage"],
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
        self.adapter_requests = Counter(
            "omni_adapter_requests",
            "Stage requests with a LoRA adapter, by stage, adapter and placement: held (sent "
            "to a replica that held the adapter loaded) or load (the replica loads it first). "
            "held / (held + load) is the router's adapter affinity hit rate.",
            ["stage", "adapter", "placement"],
            registry=self.registry,
        )
        self.registry.register(_PoolCollector(pools))
        self.registry.register(
            _VllmQueueCollector(pools, self.read_in_flight, model_name, dict(batch_slots or {}))
        )

    def read_in_flight(self) -> int:
        return self.in_flight()

    def retried(self, stage: str, reason: str) -> None:
        self.retries.labels(stage, reason).inc()

    def stage_served(self, stage: str, replica_id: int, revision: str) -> None:
        self.served.labels(stage, str(replica_id), revision).inc()

    def request_revision(self, revision: str) -> None:
        self.revision_requests.labels(revision).inc()

    def adapter_placed(self, stage: str, adapter: str, held: bool) -> None:
        """The pools' hook for each request with an adapter they place."""
        self.adapter_requests.labels(stage, adapter, "held" if held else "load").inc()

    def stage_request_done(
        self,
        stage: str,
        replica_id: int,
        latency: float,
        failed: bool,
        execute_s: float = 0.0,
        work: float = 1.0,
    ) -> None:
        """The pools' per-request hook."""
        outcome = "error" if failed else "ok"
        self.stage_requests.labels(stage, str(replica_id), outcome).inc()
        self.stage_latency.labels(stage).observe(latency)
        self.stage_work.labels(stage).inc(work)
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
        outstanding_work = GaugeMetricFamily(
            "omni_stage_outstanding_work_units",
            "Work of the requests a stage is working on, by stage (omni_stage_work_units' "
            "units): what least-outstanding-work weighs.",
            labels=["stage"],
        )
        per_request = GaugeMetricFamily(
            "omni_stage_seconds_per_request",
            "A stage's fixed cost of a request, fitted to its replicas' execution times "
            "(their mean; absent until one has run a request).",
            labels=["stage"],
        )
        per_work = GaugeMetricFamily(
            "omni_stage_seconds_per_work_unit",
            "A stage's cost of one unit of work, fitted with omni_stage_seconds_per_request.",
            labels=["stage"],
        )
        terminating = GaugeMetricFamily(
            "omni_stage_replica_terminating",
            "1 for a replica whose pod is terminating but still serves (used only where no "
            "revision is complete without it), else 0.",
            labels=["stage", "replica", "address"],
        )
        # vLLM's: an endpoint picker built for vLLM (the Gateway API inference extension)
        # reads which adapters a server runs and how many it holds from its labels; the
        # value is when it was said. Per stage replica here, for stages that take adapters.
        lora_info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters of the requests each stage replica runs now (running_lora_adapters), "
            "and the most it holds loaded (max_lora); the value is the time of this scrape "
            "(vLLM's metric, per stage replica).",
            labels=[
                "max_lora",
                "running_lora_adapters",
                "waiting_lora_adapters",
                "stage",
                "replica",
            ],
        )
        now = time.time()
        for name, pool in self._pools().items():
            stats = pool.stats()
            in_flight.add_metric([name], sum(s.in_flight for s in stats))
            outstanding_work.add_metric([name], sum(s.outstanding_work for s in stats))
            if fits := [s.cost for s in stats if s.cost is not None]:
                per_request.add_metric([name], sum(f[0] for f in fits) / len(fits))
                per_work.add_metric([name], sum(f[1] for f in fits) / len(fits))
            live.add_metric([name], pool.live_replica_count)
            for s in stats:
                replica = [name, str(s.replica_id), s.address]
                replica_in_flight.add_metric(replica, s.in_flight)
                draining.add_metric([*replica, s.revision], 0 if s.accepting else 1)
                terminating.add_metric(replica, 1 if s.terminating else 0)
                if s.max_adapters or s.running_adapters:
                    lora_info.add_metric(
                        [
                            str(s.max_adapters),
                            ",".join(s.running_adapters),
                            "",
                            name,
                            str(s.replica_id),
                        ],
                        now,
                    )
        yield lora_info
        yield in_flight
        yield outstanding_work
        yield per_request
        yield per_work
        yield replica_in_flight
        yield live
        yield draining
        yield terminating


def batch_slots(stage: StageConfig) -> int | None:
    """Requests one replica of ``stage`` runs at once: a diffusion stage runs one request at
    a time; an LLM stage batches up to its ``maxNumSeqs`` (None: vLLM's default, far more
    than a router sends one replica)."""
    return 1 if stage.type == "diffusion" else stage.max_num_seqs


def pipeline_running(
    in_flight: int, replica_in_flight: Mapping[str, list[int]], slots: Mapping[str, int | None]
) -> int:
    """How many of the router's ``in_flight`` requests a stage replica is running in a batch
    slot: each replica runs up to its stage's slots of what it holds (the rest wait in its
    queue), and no more than the router holds in all (a request's companions, such as its
    negative prompt, may run beside it in a stage)."""
    running = 0
    for stage, counts in replica_in_flight.items():
        limit = slots.get(stage)
        running += sum(n if limit is None else min(n, limit) for n in counts)
    return min(running, in_flight)


class _VllmQueueCollector(Collector):
    def __init__(
        self,
        pools: Callable[[], Mapping[str, StageReplicaPool]],
        in_flight: Callable[[], int],
        model_name: str,
        slots: Mapping[str, int | None],
    ) -> None:
        self._pools = pools
        self._in_flight = in_flight
        self._model_name = model_name
        self._slots = slots

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = self._in_flight()
        counts = {name: [s.in_flight for s in pool.stats()] for name, pool in self._pools().items()}
        running = pipeline_running(in_flight, counts, self._slots)
        gauges = (
            (
                "vllm:num_requests_running",
                "Requests a stage replica of the pipeline runs "
                "now, in one of its batch slots (vLLM's name).",
                running,
            ),
            (
                "vllm:num_requests_waiting",
                "Requests the router holds that no stage replica "
                "runs now: queued behind a replica's batch, or between stages (vLLM's name).",
                in_flight - running,
            ),
        )
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
            gauge.add_metric([self._model_name], value)
            yield gauge
