"""Which DiT replica a request goes to, simulated: request counts against work.

A diffusion stage's replicas run one request at a time each (maxNumSeqs 1, the seed's DiT),
so a request waits behind whatever its replica holds. Under a mix of small and large
requests (a 256x256 4-step image is 1/200 of a 1024x1024 50-step one) a choice by request
count puts small requests behind large ones; least-outstanding-work weighs each request by
steps x pixels (replica_policies.diffusion_work) and each replica by its own measured
seconds per unit. The choices are the router's own (replica_policies.choose_replica); the
replicas and the clock are simulated, so thousands of requests take a second.

Open loop: Poisson arrivals at a share of the replicas' capacity; latency percentiles,
all requests and the small ones apart. Closed loop: a fixed number of clients, each
sending its next request when its last is answered; images per second.

    .venv/bin/python bench/replica_choice_sim.py [--replicas 2] [--load 0.7] [--requests 20000]
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from dataclasses import dataclass, field
from typing import get_args

from _load import markdown_table
from omni_runtime.config import RouterPolicy
from omni_runtime.router.replica_policies import (
    PolicyState,
    ReplicaCandidate,
    WorkCalibration,
    calibrated,
    choose_replica,
    costs,
    diffusion_work,
)

SMALL = {"height": 256, "width": 256, "num_inference_steps": 4}
LARGE = {"height": 1024, "width": 1024, "num_inference_steps": 50}
# Seconds per unit of work (one 1024x1024 step): an H200-class GPU on a 20B MMDiT takes
# about 0.4 s a step with guidance; the ratio between requests is what matters here.
SECONDS_PER_WORK = 0.4
POLICIES = [p for p in get_args(RouterPolicy) if p != "sticky"]


@dataclass
class Replica:
    replica_id: int
    # Its speed against the nominal one, and what it holds: (work, arrival, large?) each,
    # the one running first.
    speed: float = 1.0
    held: list[tuple[float, float, bool]] = field(default_factory=list)
    calibration: WorkCalibration | None = None

    def seconds(self, work: float) -> float:
        return work * SECONDS_PER_WORK / self.speed


def simulate(
    policy: RouterPolicy, arrivals: list[tuple[float, bool]], speeds: list[float]
) -> tuple[list[tuple[bool, float]], float]:
    """(large?, latency) per request of ``arrivals`` ((time, large?) in time order), on a
    replica per entry of ``speeds``, chosen as the router's pool chooses; and when the
    last one finished."""
    pool = [Replica(i, speed) for i, speed in enumerate(speeds)]
    state = PolicyState()
    # (finish time, replica id) of each replica's running request.
    running: list[tuple[float, int]] = []
    results: list[tuple[bool, float]] = []
    last_done = [0.0]

    def finish_until(now: float) -> None:
        while running and running[0][0] <= now:
            done_at, replica_id = heapq.heappop(running)
            replica = pool[replica_id]
            work, arrived, large = replica.held.pop(0)
            replica.calibration = calibrated(replica.calibration, replica.seconds(work), work)
            results.append((large, done_at - arrived))
            last_done[0] = done_at
            if replica.held:
                heapq.heappush(running, (done_at + replica.seconds(replica.held[0][0]), replica_id))

    for now, large in arrivals:
        finish_until(now)
        work = diffusion_work(LARGE if large else SMALL)
        fitted = costs([r.calibration for r in pool])
        candidates = [
            ReplicaCandidate(
                r.replica_id,
                len(r.held),
                outstanding_work=sum(held[0] for held in r.held),
                seconds_per_request=per_request,
                seconds_per_work=per_work,
            )
            for r, (per_request, per_work) in zip(pool, fitted, strict=True)
        ]
        chosen, state = choose_replica(policy, candidates, state)
        replica = pool[chosen]
        replica.held.append((work, now, large))
        if len(replica.held) == 1:
            heapq.heappush(running, (now + replica.seconds(work), chosen))
    finish_until(float("inf"))
    return results, last_done[0]


def poisson_arrivals(
    n: int, rate: float, large_share: float, seed: int
) -> list[tuple[float, bool]]:
    rng = random.Random(seed)
    now, arrivals = 0.0, []
    for _ in range(n):
        now += rng.expovariate(rate)
        arrivals.append((now, rng.random() < large_share))
    return arrivals


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--load", type=float, default=0.7, help="share of the capacity")
    parser.add_argument("--large-share", type=float, default=0.2)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    small, large = diffusion_work(SMALL), diffusion_work(LARGE)
    mean_s = ((1 - args.large_share) * small + args.large_share * large) * SECONDS_PER_WORK
    rate = args.load * args.replicas / mean_s
    print(
        f"{args.replicas} replicas, one request at a time each; {1 - args.large_share:.0%} "
        f"256x256 4-step ({small * SECONDS_PER_WORK:.2f} s), {args.large_share:.0%} "
        f"1024x1024 50-step ({large * SECONDS_PER_WORK:.1f} s); Poisson arrivals at "
        f"{args.load:.0%} of capacity ({rate:.2f}/s), {args.requests} requests\n"
    )
    for label, speed in (
        ("equal replicas", [1.0] * args.replicas),
        ("replica 0 twice as fast", [2.0] + [1.0] * (args.replicas - 1)),
    ):
        rows = []
        arrivals = poisson_arrivals(args.requests, rate, args.large_share, args.seed)
        if label != "equal replicas":
            # The same requests at the load the faster pool's capacity allows.
            scale = sum(speed) / args.replicas
            arrivals = [(t / scale, big) for t, big in arrivals]
        for policy in POLICIES:
            results, makespan = simulate(policy, arrivals, speed)
            latencies = [latency for _, latency in results]
            smalls = [latency for big, latency in results if not big]
            bigs = [latency for big, latency in results if big]
            rows.append(
                [
                    policy,
                    f"{statistics.median(latencies):.2f}",
                    f"{percentile(latencies, 0.99):.2f}",
                    f"{statistics.median(smalls):.2f}",
                    f"{percentile(smalls, 0.99):.2f}",
                    f"{percentile(bigs, 0.99):.2f}",
                    f"{len(results) / makespan:.3f}",
                ]
            )
        headers = [
            "policy",
            "p50 s",
            "p99 s",
            "small p50 s",
            "small p99 s",
            "large p99 s",
            "images/s",
        ]
        print(f"{label}:\n")
        print(markdown_table(headers, rows))
        print()


if __name__ == "__main__":
    main()
