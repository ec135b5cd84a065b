"""Keeps each stage's pool connected to the replicas it should have.

Replica addresses come from the command line or the environment (``serve``, ``router
--replicas``); in a cluster, the operator's discovery feeds the same ``set_addresses``. An
address whose replica is not in its pool (never connected, evicted after it died,
restarted) is retried every ``interval`` seconds, so a replica that comes back takes
traffic again without anyone restarting the router.

A replica joins its pool with the pipeline revision it advertised; one that is draining
already when it answers is not added (it is going away). A replica no longer wanted is
drained out of its pool in a task of its own, so that one slow drain never holds up
connecting the replicas that replace it. One whose pod is terminating but still serves
(discovery's ``terminating`` addresses) stays in its pool, marked as the last resort
(``StageReplicaPool.set_terminating``); a terminating address never connects anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping

from omni_runtime.engine.stage.stage_core_client import StageCoreDeadError
from omni_runtime.router.remote_stage_client import RemoteStageClient
from omni_runtime.router.stage_replica_pool import StageReplicaPool
from omni_runtime.stage_keys import StageClientKeys

logger = logging.getLogger(__name__)


class ReplicaConnector:
    """Connects pools to replica addresses and keeps them connected."""

    def __init__(
        self,
        pools: Mapping[int, StageReplicaPool],
        *,
        interval: float = 1.0,
        connect_timeout: float = 5.0,
        keys: StageClientKeys | None = None,
    ) -> None:
        self.pools = dict(pools)
        self.keys = keys
        self.interval = interval
        self.connect_timeout = connect_timeout
        self._addresses: dict[int, set[str]] = {stage_id: set() for stage_id in pools}
        self._terminating: dict[int, set[str]] = {stage_id: set() for stage_id in pools}
        self._connecting: dict[tuple[int, str], asyncio.Task[None]] = {}
        self._removing: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._failures: dict[tuple[int, str], str] = {}
        self._wake = asyncio.Event()

    def set_addresses(
        self, stage_id: int, addresses: Iterable[str], *, terminating: Iterable[str] = ()
    ) -> None:
        """The replicas stage ``stage_id`` should have (``addresses``), and those it may
        keep as a last resort while their pods terminate (``terminating``); others are
        removed from its pool."""
        self._addresses[stage_id] = set(addresses)
        self._terminating[stage_id] = set(terminating) - self._addresses[stage_id]
        self._wake.set()

    async def run(self) -> None:
        """Reconcile forever (cancel to stop)."""
        try:
            while True:
                await self.reconcile()
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.interval)
        finally:
            tasks = [*self._connecting.values(), *self._removing.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def reconcile(self) -> None:
        for stage_id, pool in self.pools.items():
            wanted = self._addresses[stage_id]
            terminating = self._terminating[stage_id]
            present = {s.address: s for s in pool.stats()}
            for address, stats in present.items():
                if address in wanted or address in terminating:
                    pool.set_terminating(stats.replica_id, address in terminating)
                elif not stats.draining:
                    self._remove(stage_id, pool, stats.replica_id, address)
            for address in wanted - set(present):
                key = (stage_id, address)
                if key not in self._connecting:
                    self._connecting[key] = asyncio.create_task(self._connect(stage_id, address))

    def _remove(self, stage_id: int, pool: StageReplicaPool, replica_id: int, address: str) -> None:
        removal = (stage_id, replica_id)
        if removal in self._removing:
            return
        logger.info("stage %s: removing replica %s", pool.stage_name, address)
        task = asyncio.create_task(pool.remove_replica(replica_id))
        self._removing[removal] = task

        def forget(_: asyncio.Task[None]) -> None:
            self._removing.pop(removal, None)

        task.add_done_callback(forget)

    async def _connect(self, stage_id: int, address: str) -> None:
        key = (stage_id, address)
        pool = self.pools[stage_id]
        client = RemoteStageClient(address, keys=self.keys)
        try:
            load = await client.wait_ready(self.connect_timeout)
            if address not in self._addresses[stage_id]:
                client.shutdown()  # no longer wanted while we connected
                return
            if load.stage_id != stage_id:
                raise StageCoreDeadError(
                    f"{address} serves stage {load.stage_id} ({load.name}), not stage {stage_id}"
                )
            if load.draining:
                raise StageCoreDeadError(f"{address} is draining (its process is stopping)")
            replica_id = pool.add_replica(client, address, revision=load.revision)
            self._failures.pop(key, None)
            logger.info(
                "stage %s: replica %d at %s is live (revision %s)",
                pool.stage_name,
                replica_id,
                address,
                load.revision or "unknown",
            )
        except StageCoreDeadError as e:
            client.shutdown()
            if self._failures.get(key) != str(e):
                logger.warning("stage %s: cannot use %s: %s", pool.stage_name, address, e)
            self._failures[key] = str(e)
        except BaseException:
            client.shutdown()
            raise
        finally:
            self._connecting.pop(key, None)
