"""LoRA affinity against least-load alone: the router's own StageReplicaPool choosing among
two replicas that hold a few adapters each, for requests over eight adapters.

The replicas are simulated (this measures the choice, not a model): each runs one request
at a time, as a DiT replica does, in ``--service-ms``; a request whose adapter the replica
does not hold first loads it in ``--load-ms`` (evicting its least recently used adapter past
``--max-loras``), and the replica reports what it holds as a stage server does (StageLoad
in its heartbeat answer). The default costs are the tiny Z-Image DiT's on this machine
(bench/dit_adapters.py): a 96x96 image in ~0.2 s, an adapter read and injected in ~0.1 s
(a real checkpoint's adapter loads in seconds, which widens the gap). Requests arrive as a
Poisson stream at ``--utilisation`` of the two replicas' capacity, adapters drawn uniformly.

    .venv/bin/python bench/adapter_routing.py [--requests 600] [--max-loras 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import OrderedDict
from typing import Any

from _load import markdown_table, percentile
from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase
from omni_runtime.engine.stage.stage_core_types import (
    StageAdapter,
    StageCoreOutputs,
    StageCoreRequest,
    StageLoad,
    StageServerOutput,
    StageServerOutputs,
    StageServerRequest,
)
from omni_runtime.router.stage_replica_pool import StageReplicaPool


class SimulatedReplica(StageCoreClientBase):
    """One request at a time; a miss loads the adapter first (LRU of max_loras)."""

    def __init__(self, max_loras: int, service_s: float, load_s: float) -> None:
        self.max_loras = max_loras
        self.service_s = service_s
        self.load_s = load_s
        self.held: OrderedDict[str, None] = OrderedDict()
        self.load = StageLoad(0, "dit", True, adapters=[], max_adapters=max_loras)
        self.loads = 0
        self._queue: asyncio.Queue[StageServerRequest] = asyncio.Queue()
        self._outputs: asyncio.Queue[StageCoreOutputs] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None

    async def add_request_async(self, request: StageCoreRequest) -> None:
        assert isinstance(request, StageServerRequest)
        if self._worker is None:
            self._worker = asyncio.create_task(self._work())
        self._queue.put_nowait(request)

    async def _work(self) -> None:
        while True:
            request = await self._queue.get()
            started = time.monotonic()
            adapter = request.adapter
            if adapter is not None:
                if adapter.name in self.held:
                    self.held.move_to_end(adapter.name)
                else:
                    await asyncio.sleep(self.load_s)
                    self.loads += 1
                    while len(self.held) >= self.max_loras:
                        self.held.popitem(last=False)
                    self.held[adapter.name] = None
                self.load = StageLoad(
                    0, "dit", True, adapters=list(self.held), max_adapters=self.max_loras
                )
            await asyncio.sleep(self.service_s)
            output = StageServerOutput(
                request.request_id,
                finished=True,
                finish_reason="stop",
                execute_time=time.monotonic() - started,
            )
            self._outputs.put_nowait(StageServerOutputs(outputs=[output]))

    async def get_outputs_async(self) -> StageCoreOutputs:
        return await self._outputs.get()

    def get_outputs_nowait(self) -> StageCoreOutputs | None:
        raise NotImplementedError

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        return None

    async def collective_rpc_async(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        raise NotImplementedError

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.cancel()


async def run(affinity: bool, args: argparse.Namespace) -> dict[str, float]:
    """One run: latencies and the share of requests placed where their adapter was held."""
    pool = StageReplicaPool("dit", "least-outstanding-requests")
    replicas = [
        SimulatedReplica(args.max_loras, args.service_ms / 1000, args.load_ms / 1000)
        for _ in range(2)
    ]
    for index, replica in enumerate(replicas):
        pool.add_replica(replica, f"10.0.0.{index}:52001")
    placed: list[bool] = []
    pool.on_adapter_placed = lambda stage, adapter, held: placed.append(held)
    rng = random.Random(args.seed)
    adapters = [StageAdapter(f"lora-{i}", f"/loras/{i}.safetensors") for i in range(8)]
    # Arrivals at the utilisation asked of two replicas that never load (the misses' loads
    # are the extra work that affinity saves).
    rate = args.utilisation * 2 / (args.service_ms / 1000)
    latencies: list[float] = []

    async def one(index: int) -> None:
        adapter = rng.choice(adapters)
        request = StageServerRequest(f"r{index}", prompt="p", adapter=adapter)
        start = time.monotonic()
        pending = await pool.add_request(request, adapter=adapter.name if affinity else None)
        async for _ in pending:
            pass
        latencies.append(time.monotonic() - start)

    tasks = []
    for index in range(args.requests):
        tasks.append(asyncio.create_task(one(index)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    await pool.close()
    loads = sum(r.loads for r in replicas)
    return {
        # Without affinity the pool is not told the adapter: count hits from the loads.
        "hit_rate": (args.requests - loads) / args.requests,
        "placed_held": statistics.mean(placed) if placed else float("nan"),
        "p50": percentile(latencies, 50),
        "p90": percentile(latencies, 90),
        "loads": loads,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--max-loras", type=int, default=2)
    parser.add_argument("--service-ms", type=float, default=200.0)
    parser.add_argument("--load-ms", type=float, default=100.0)
    parser.add_argument("--utilisation", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = []
    for affinity in (False, True):
        result = await run(affinity, args)
        rows.append(
            [
                "least-outstanding + affinity" if affinity else "least-outstanding alone",
                f"{result['hit_rate']:.2f}",
                f"{int(result['loads'])}",
                f"{result['p50'] * 1000:.0f}",
                f"{result['p90'] * 1000:.0f}",
            ]
        )
    print(
        f"{args.requests} requests over 8 adapters, 2 replicas holding {args.max_loras} each, "
        f"service {args.service_ms:g} ms, load {args.load_ms:g} ms, "
        f"utilisation {args.utilisation:g}"
    )
    print(markdown_table(["routing", "hit rate", "loads", "p50 ms", "p90 ms"], rows))


if __name__ == "__main__":
    asyncio.run(main())
