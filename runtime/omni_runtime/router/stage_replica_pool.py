"""StageReplicaPool: one stage's replicas behind one ``add_request``, as the router sees them.

Each replica is any :class:`StageCoreClientBase` (in production a remote client of a stage
server in another pod). The pool picks a replica per request by the router's policy
(``replica_policies``), binds the request id to it, and runs one reader task per replica
that hands each output to the request it belongs to. A replica whose reader fails or whose
health check raises is evicted: only the requests bound to it fail, with
:class:`ReplicaLostError`, and later requests go to the others.

Each replica has the pipeline revision it advertised; a request may be bound to one
revision (``add_request(..., revision=...)``), so that a request's stages all run one
configuration while a rollout mixes two. A replica that says it is draining (its pod is
going away) takes nothing new, as one the pool is removing does not. A replica marked
terminating (``set_terminating``: its pod is going away but still serves, as in its
preStop delay) is the last resort: it takes a request only where no other replica of the
revision asked for does, and its revision counts only in ``revisions(terminating=True)``.

The pool refuses rather than queues (:class:`PoolSaturatedError`,
:class:`NoLiveReplicaError`): the router answers those with 429/503 at once, which is what
a client can act on, where a queue here would only turn overload into latency.

An instance belongs to the event loop it is first used in.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, get_args

from omni_runtime import pod_contract
from omni_runtime.config import RouterPolicy
from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase, StageCoreDeadError
from omni_runtime.engine.stage.stage_core_types import StageCoreOutput, StageCoreRequest
from omni_runtime.net import address_host
from omni_runtime.router.replica_policies import (
    PolicyState,
    ReplicaCandidate,
    WorkCalibration,
    adapter_affinity,
    calibrated,
    choose_replica,
    costs,
)

__all__ = [
    "DEFAULT_DRAIN_TIMEOUT_S",
    "AdapterPlacedHook",
    "NoLiveReplicaError",
    "PoolRequest",
    "PoolSaturatedError",
    "ReplicaLostError",
    "ReplicaStats",
    "RequestDoneHook",
    "StageReplicaPool",
    "is_failed_output",
    "is_final_output",
]

logger = logging.getLogger(__name__)

# (stage_name, replica_id, latency_s, failed, execute_s, work), called once per request
# that finished or failed on a replica (not for requests the caller aborted): what /metrics
# records. execute_s is what the replica said it spent on the request (its engine's time,
# without its own queue for a diffusion stage); 0 where it said nothing. work is the
# request's (replica_policies.diffusion_work's units; 1 without an estimate).
RequestDoneHook = Callable[[str, int, float, bool, float, float], None]
# (stage, adapter, whether the replica chosen held it already): LoRA affinity's hit rate.
AdapterPlacedHook = Callable[[str, str, bool], None]

# A replica the pool removes drains for as long as its pod would (the pod contract's).
DEFAULT_DRAIN_TIMEOUT_S = float(pod_contract.DEFAULT_DRAIN_TIMEOUT_S)

# An abort the pool delivers is one the stage decided on (a core shutting down): requests
# its callers abort are unbound first and their outputs dropped.
_FAILED_FINISH_REASONS = frozenset({"abort", "error"})


class ReplicaLostError(StageCoreDeadError):
    """The replica a request was on died or was removed before the request finished."""

    def __init__(self, stage_name: str, replica_id: int, address: str, reason: str) -> None:
        where = f"replica {replica_id}" + (f" ({address})" if address else "")
        super().__init__(f"stage {stage_name!r}: {where} lost: {reason}")
        self.stage_name = stage_name
        self.replica_id = replica_id
        self.address = address
        self.reason = reason


class NoLiveReplicaError(RuntimeError):
    """The stage has no replica that takes new requests."""


class PoolSaturatedError(RuntimeError):
    """Every live replica of the stage has its maximum of requests in flight."""


def is_final_output(output: object) -> bool:
    """Whether ``output`` is the last one of its request, whatever kind of stage sent it.

    Stage servers' outputs and vLLM's say so in ``finished`` (vLLM's is a property of
    ``finish_reason``); a diffusion core's output has neither: it is the request's last
    unless it is a partial image or progress.
    """
    if not hasattr(output, "finished") and (
        getattr(output, "partial_index", None) is not None
        or getattr(output, "progress", None) is not None
    ):
        return False
    if hasattr(output, "finished"):
        return bool(output.finished)
    if hasattr(output, "finish_reason"):
        return output.finish_reason is not None
    return True


def is_failed_output(output: object) -> bool:
    """Whether a final ``output`` reports a failure rather than a result."""
    if getattr(output, "error", None) is not None or getattr(output, "aborted", False) is True:
        return True
    reason = getattr(output, "finish_reason", None)
    # vLLM's FinishReason prints as the same words a stage server sends.
    return reason is not None and str(reason) in _FAILED_FINISH_REASONS


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """One replica's figures for /metrics and /health."""

    replica_id: int
    address: str
    # Being removed from the pool: finishing its requests, taking no new ones.
    draining: bool
    in_flight: int
    done: int
    failed: int
    # Aborted by their callers; neither done nor failed, and left out of latency.
    aborted: int
    latency_total_s: float
    latency_count: int
    revision: str = ""
    # The replica said it is draining (its process is going away): it takes nothing new.
    replica_draining: bool = False
    # Its pod is terminating but still serves: used only where nothing else is.
    terminating: bool = False
    # The work of its requests in flight (replica_policies.diffusion_work's units).
    outstanding_work: float = 0.0
    # Its fitted (seconds per request, seconds per unit of work); None before it ran one.
    cost: tuple[float, float] | None = None
    # LoRA adapters: those it holds (its report, and those sent since), the most it holds
    # (0: it takes none, or has not said), and those of its requests in flight.
    adapters: tuple[str, ...] = ()
    max_adapters: int = 0
    running_adapters: tuple[str, ...] = ()

    @property
    def accepting(self) -> bool:
        """Whether the replica takes new requests."""
        return not self.draining and not self.replica_draining


@dataclass(frozen=True, slots=True)
class _End:
    """The queue item after a request's last output: how it ended."""

    error: ReplicaLostError | None = None


class PoolRequest:
    """A request on one of the pool's replicas: its outputs in order, then its end.

    ``async for output in pool_request`` yields every output up to and including the final
    one; it raises :class:`ReplicaLostError` instead if the replica is lost first.
    """

    def __init__(
        self,
        pool: StageReplicaPool,
        request_id: str,
        replica_id: int,
        address: str = "",
        work: float = 1.0,
        adapter: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.replica_id = replica_id
        # The LoRA adapter it runs with, if any.
        self.adapter = adapter
        # Its work (replica_policies.diffusion_work's units; 1 without an estimate).
        self.work = work
        # The replica's address (host:port): where its pod is.
        self.address = address
        self._pool = pool
        self._items: asyncio.Queue[StageCoreOutput | _End] = asyncio.Queue()
        self._closed = False
        self._seen_end: _End | None = None
        # Until add_request_async returns, a lost replica means "try another", not a failure.
        self._submitted = False
        self._started = time.monotonic()

    @property
    def finished(self) -> bool:
        """No more outputs will arrive (some may still wait to be read)."""
        return self._closed

    async def next_output(self) -> StageCoreOutput:
        """The next output; StopAsyncIteration after the final one or an abort."""
        if self._seen_end is None:
            item = await self._items.get()
            if not isinstance(item, _End):
                return item
            self._seen_end = item
        if self._seen_end.error is not None:
            raise self._seen_end.error
        raise StopAsyncIteration

    def __aiter__(self) -> PoolRequest:
        return self

    async def __anext__(self) -> StageCoreOutput:
        return await self.next_output()

    async def abort(self) -> None:
        """Stop the request on its replica; a no-op once it has finished or failed."""
        await self._pool._abort(self)

    def _deliver(self, output: StageCoreOutput) -> None:
        self._items.put_nowait(output)

    def _close(self, error: ReplicaLostError | None) -> None:
        self._closed = True
        self._items.put_nowait(_End(error))


@dataclass(eq=False)
class _Replica:
    replica_id: int
    client: StageCoreClientBase
    address: str
    revision: str = ""
    requests: dict[str, PoolRequest] = field(default_factory=dict)
    # Ids aborted here whose final (aborted) output has not come back yet.
    aborting: set[str] = field(default_factory=set)
    draining: bool = False
    terminating: bool = False
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    reader: asyncio.Task[None] | None = None
    done: int = 0
    failed: int = 0
    aborted: int = 0
    latency_total_s: float = 0.0
    latency_count: int = 0
    # Its requests' time against their work, from its execution times (None: nothing
    # ran yet).
    calibration: WorkCalibration | None = None
    # Adapters sent here since the replica's last report: name -> (when, the report then
    # current). The replica holds them from then on as far as the pool knows, until a
    # newer report (StageLoad.adapters) says what it holds.
    adapters_sent: dict[str, tuple[float, object]] = field(default_factory=dict)

    def adapters_held(self) -> tuple[set[str], int]:
        """The adapters the replica holds, and how many it holds at most (0: unknown), from
        its last report and what was sent since."""
        load = getattr(self.client, "load", None)
        reported = set(getattr(load, "adapters", None) or ())
        capacity = int(getattr(load, "max_adapters", 0) or 0)
        # A report made before a send cannot know of it; a newer one has the replica's
        # word (it may have evicted it already). A replica that never reports: a while.
        recent = time.monotonic() - ADAPTER_REPORT_LAG_S
        sent = {
            name
            for name, (when, report) in self.adapters_sent.items()
            if report is load and when > recent
        }
        return reported | sent, capacity

    def adapter_sent(self, name: str) -> None:
        self.adapters_sent[name] = (time.monotonic(), getattr(self.client, "load", None))

    @property
    def accepting(self) -> bool:
        return not self.draining and not self.client.draining

    @property
    def outstanding_work(self) -> float:
        return sum(request.work for request in self.requests.values())


# How long a replica's report may lag an adapter sent to it: a few heartbeats (1 s each).
ADAPTER_REPORT_LAG_S = 5.0


class StageReplicaPool:
    """The replicas of one stage, and which request is on which."""

    def __init__(
        self,
        stage_name: str,
        policy: RouterPolicy = "round-robin",
        *,
        max_in_flight_per_replica: int | None = None,
        on_request_done: RequestDoneHook | None = None,
        on_adapter_placed: AdapterPlacedHook | None = None,
    ) -> None:
        if policy not in get_args(RouterPolicy):
            raise ValueError(f"unknown router policy {policy!r}; expected {get_args(RouterPolicy)}")
        if max_in_flight_per_replica is not None and max_in_flight_per_replica < 1:
            raise ValueError(
                f"max_in_flight_per_replica must be >= 1, not {max_in_flight_per_replica}"
            )
        self.stage_name = stage_name
        self.policy: RouterPolicy = policy
        self.max_in_flight_per_replica = max_in_flight_per_replica
        self.on_request_done = on_request_done
        self.on_adapter_placed = on_adapter_placed
        self._ids = itertools.count()
        self._replicas: dict[int, _Replica] = {}
        self._requests: dict[str, PoolRequest] = {}
        self._policy_state = PolicyState()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Every task the pool started (readers, aborts of cancelled sends), for close().
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def live_replica_count(self) -> int:
        """Replicas that take new requests (draining ones do not)."""
        return sum(replica.accepting for replica in self._replicas.values())

    def revisions(self, *, terminating: bool = False) -> set[str]:
        """The revisions of the replicas that take new requests, terminating ones' only
        with ``terminating``."""
        return {
            replica.revision
            for replica in self._replicas.values()
            if replica.accepting and (terminating or not replica.terminating)
        }

    def size_multiples(self) -> set[int]:
        """The multiples the replicas that take new requests say a size must be of
        (StageLoad.size_multiple, from their last report); empty where none says one: none
        has reported yet, or the stage makes no images, or its replicas predate the field."""
        found = set()
        for replica in self._replicas.values():
            load = getattr(replica.client, "load", None)
            multiple = getattr(load, "size_multiple", 0)
            if replica.accepting and isinstance(multiple, int) and multiple > 0:
                found.add(multiple)
        return found

    def set_terminating(self, replica_id: int, terminating: bool) -> None:
        """Mark a replica whose pod is going away but still serves (or no longer so): it
        takes requests only where no other replica of the revision does. An id not in the
        pool is ignored (watchers race with eviction)."""
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.terminating = terminating

    @property
    def in_flight(self) -> int:
        """Requests on the pool's replicas that have not finished."""
        return len(self._requests)

    def stats(self) -> list[ReplicaStats]:
        """The replicas in the pool now (evicted and removed ones are gone), by id."""
        stats = []
        for r in self._replicas.values():
            held, capacity = r.adapters_held()
            running = {q.adapter for q in r.requests.values() if q.adapter is not None}
            stats.append(self._stats(r, held, capacity, running))
        return stats

    @staticmethod
    def _stats(r: _Replica, held: set[str], capacity: int, running: set[str]) -> ReplicaStats:
        return ReplicaStats(
            replica_id=r.replica_id,
            address=r.address,
            draining=r.draining,
            in_flight=len(r.requests),
            done=r.done,
            failed=r.failed,
            aborted=r.aborted,
            latency_total_s=r.latency_total_s,
            latency_count=r.latency_count,
            revision=r.revision,
            replica_draining=r.client.draining,
            terminating=r.terminating,
            outstanding_work=r.outstanding_work,
            cost=r.calibration.fit if r.calibration is not None else None,
            adapters=tuple(sorted(held)),
            max_adapters=capacity,
            running_adapters=tuple(sorted(running)),
        )

    def add_replica(
        self, client: StageCoreClientBase, address: str = "", *, revision: str = ""
    ) -> int:
        """Add a replica (the pool owns ``client`` from here on) of pipeline ``revision``;
        returns its id."""
        if self._closed:
            raise RuntimeError(f"stage {self.stage_name!r}: the replica pool is closed")
        replica = _Replica(next(self._ids), client, address, revision)
        self._replicas[replica.replica_id] = replica
        # Outside a loop the reader starts with the pool's first use on one.
        self._claim_loop(required=False)
        return replica.replica_id

    async def remove_replica(
        self, replica_id: int, *, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    ) -> None:
        """Stop sending to a replica, let its requests finish, then shut its client down.

        Requests still unfinished after ``drain_timeout`` seconds fail with
        ReplicaLostError and are aborted on the replica. A replica that is gone already
        (evicted, removed) is not an error: endpoint watchers race with eviction.
        """
        self._claim_loop()
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        replica.draining = True
        if replica.requests:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(replica.drained.wait(), drain_timeout)
        if self._replicas.get(replica_id) is not replica:
            return
        left = self._detach(
            replica,
            f"removed from the pool before its request finished ({drain_timeout:g} s drain)",
        )
        if left:
            try:
                await replica.client.abort_requests_async(left)
            except Exception as e:
                logger.warning(
                    "stage %r: aborting the undrained requests of replica %d failed: %s",
                    self.stage_name,
                    replica_id,
                    _describe(e),
                )
        await self._stop(replica)

    async def add_request(
        self,
        request: StageCoreRequest,
        *,
        sticky_key: str | None = None,
        revision: str | None = None,
        host: str | None = None,
        work: float | None = None,
        adapter: str | None = None,
    ) -> PoolRequest:
        """Send ``request`` to a replica chosen by the pool's policy.

        ``work`` is the request's estimated work (replica_policies.diffusion_work; None:
        1, as any request without an estimate), which least-outstanding-work weighs.

        ``sticky_key`` (the sticky policy's; else the request id) keeps related requests
        on one replica; ``revision`` (None: any) limits the choice to that revision's
        replicas, and ``host`` (None: any) to the replicas at that address (one pod: what
        shared memory reaches). ``adapter`` (the request's LoRA adapter) prefers a replica
        that holds it (replica_policies.adapter_affinity). Raises NoLiveReplicaError or
        PoolSaturatedError rather than wait, and ValueError for a request id that is in
        flight in the pool.
        """
        self._claim_loop()
        request_id = getattr(request, "request_id", None)
        if not isinstance(request_id, str):
            raise TypeError(f"{type(request).__name__} has no str request_id")
        # Each pass evicts a replica or returns, so this ends.
        while True:
            if self._closed:
                raise RuntimeError(f"stage {self.stage_name!r}: the replica pool is closed")
            self._check_id_free(request_id)
            replica, held = self._pick(
                sticky_key if sticky_key is not None else request_id, revision, host, adapter
            )
            try:
                replica.client.check_health()
            except Exception as e:
                self._evict(replica, f"health check failed: {_describe(e)}")
                continue
            pool_request = PoolRequest(
                self, request_id, replica.replica_id, replica.address, work or 1.0, adapter
            )
            # Bound before sending: the first output may arrive before the send returns.
            replica.requests[request_id] = pool_request
            self._requests[request_id] = pool_request
            try:
                await replica.client.add_request_async(request)
            except StageCoreDeadError as e:
                self._unbind(replica, pool_request)
                self._evict(replica, _describe(e))
                continue
            except asyncio.CancelledError:
                # The request may have reached the replica; don't leave it running there.
                if self._unbind(replica, pool_request):
                    self._spawn(self._abort_quietly(replica, request_id), "abort")
                raise
            except BaseException:
                self._unbind(replica, pool_request)
                raise
            if pool_request.finished or self._requests.get(request_id) is pool_request:
                pool_request._submitted = True
                if adapter is not None:
                    replica.adapter_sent(adapter)
                    self._adapter_placed(adapter, held)
                return pool_request
            # The replica was lost while the request was being sent: it never ran there.

    async def release_hand_offs(self, replica_id: int, request_ids: list[str]) -> None:
        """Tell replica ``replica_id`` that the hand-offs of its finished ``request_ids``
        will never be fetched, so that it drops them now instead of at its connector's TTL
        (an abort of a finished request does that, and only that). Nothing to do where the
        replica is gone: what it held went with it."""
        self._claim_loop()
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        try:
            await replica.client.abort_requests_async(request_ids)
        except StageCoreDeadError as e:
            self._evict(replica, _describe(e))

    async def call_utility(
        self, method: str, kwargs: dict[str, Any], timeout: float | None = None
    ) -> Any:
        """Run utility ``method`` on one live replica chosen by the pool's policy (a call
        any replica answers alike, such as an LLM stage's tokenize); NoLiveReplicaError
        when there is none, TimeoutError past ``timeout``."""
        self._claim_loop()
        replica, _ = self._pick(f"utility:{method}", None, None)
        return await replica.client.collective_rpc_async(method, timeout=timeout, kwargs=kwargs)

    async def close(self) -> None:
        """Fail what is in flight, stop the readers and shut every client down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._claim_loop()
        for replica in list(self._replicas.values()):
            self._detach(replica, "the replica pool was closed")
            await self._stop(replica)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _claim_loop(self, *, required: bool = True) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            if required:
                raise
            return
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError(
                f"stage {self.stage_name!r}: the replica pool belongs to another event loop"
            )
        for replica in self._replicas.values():
            if replica.reader is None and not self._closed:
                replica.reader = self._spawn(self._read(replica), f"replica-{replica.replica_id}")

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        assert self._loop is not None
        task = self._loop.create_task(coro, name=f"stage-{self.stage_name}-pool-{what}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _check_id_free(self, request_id: str) -> None:
        if request_id in self._requests:
            raise ValueError(
                f"stage {self.stage_name!r}: request_id {request_id!r} is in flight already"
            )
        for replica in self._replicas.values():
            if request_id in replica.aborting:
                raise ValueError(
                    f"stage {self.stage_name!r}: request_id {request_id!r} is still being "
                    f"aborted on replica {replica.replica_id}"
                )

    def _adapter_placed(self, adapter: str, held: bool) -> None:
        if self.on_adapter_placed is None:
            return
        try:
            self.on_adapter_placed(self.stage_name, adapter, held)
        except Exception:
            logger.exception("stage %r: on_adapter_placed failed", self.stage_name)

    def _pick(
        self, sticky_key: str, revision: str | None, host: str | None, adapter: str | None = None
    ) -> tuple[_Replica, bool]:
        """The replica for a request, and whether it holds ``adapter`` already."""
        live = [
            replica
            for replica in self._replicas.values()
            if replica.accepting
            and (revision is None or replica.revision == revision)
            and (host is None or address_host(replica.address) == host)
        ]
        if not live:
            draining = sum(not r.accepting for r in self._replicas.values())
            of = f" of revision {revision!r}" if revision is not None else ""
            on = f" at {host} (its input is in that pod's shared memory)" if host else ""
            raise NoLiveReplicaError(
                f"stage {self.stage_name!r} has no live replica{of}{on}"
                + (f" ({draining} draining)" if draining else "")
            )
        live = [replica for replica in live if not replica.terminating] or live
        limit = self.max_in_flight_per_replica
        open_ = [r for r in live if limit is None or len(r.requests) < limit]
        if not open_:
            raise PoolSaturatedError(
                f"stage {self.stage_name!r}: all {len(live)} live replica(s) have "
                f"{limit} request(s) in flight"
            )
        fitted = costs([r.calibration for r in open_])
        candidates = []
        for r, (per_request, per_work) in zip(open_, fitted, strict=True):
            held = r.adapters_held()[0] if adapter is not None else set()
            candidates.append(
                ReplicaCandidate(
                    r.replica_id,
                    len(r.requests),
                    r.address,
                    outstanding_work=r.outstanding_work,
                    seconds_per_request=per_request,
                    seconds_per_work=per_work,
                    holds_adapter=adapter in held,
                )
            )
        if adapter is not None:
            candidates = adapter_affinity(candidates, adapter)
        chosen, self._policy_state = choose_replica(
            self.policy, candidates, self._policy_state, sticky_key
        )
        holds = next(c.holds_adapter for c in candidates if c.replica_id == chosen)
        return self._replicas[chosen], holds

    async def _read(self, replica: _Replica) -> None:
        try:
            while True:
                outputs = await replica.client.get_outputs_async()
                for output in getattr(outputs, "outputs", None) or ():
                    self._dispatch(replica, output)
                # Stage servers and diffusion cores say so when their core is going away.
                dead = getattr(outputs, "engine_dead", None)
                if dead is not None:
                    raise StageCoreDeadError(str(dead))
        except Exception as e:
            self._evict(replica, _describe(e))

    def _dispatch(self, replica: _Replica, output: StageCoreOutput) -> None:
        request_id = str(getattr(output, "request_id", ""))
        final = is_final_output(output)
        pool_request = replica.requests.get(request_id)
        if pool_request is None:
            # An aborted request's last words, or a request the pool gave up on.
            if final:
                replica.aborting.discard(request_id)
            return
        pool_request._deliver(output)
        if final:
            execute_s = float(getattr(output, "execute_time", 0.0) or 0.0)
            self._finish(
                replica, pool_request, failed=is_failed_output(output), execute_s=execute_s
            )

    def _unbind(self, replica: _Replica, pool_request: PoolRequest) -> bool:
        """Forget where ``pool_request`` runs; False if it was not bound."""
        request_id = pool_request.request_id
        if replica.requests.get(request_id) is not pool_request:
            return False
        del replica.requests[request_id]
        if self._requests.get(request_id) is pool_request:
            del self._requests[request_id]
        if replica.draining and not replica.requests:
            replica.drained.set()
        return True

    def _finish(
        self,
        replica: _Replica,
        pool_request: PoolRequest,
        *,
        failed: bool,
        error: ReplicaLostError | None = None,
        execute_s: float = 0.0,
    ) -> None:
        if not self._unbind(replica, pool_request):
            return
        latency = time.monotonic() - pool_request._started
        replica.latency_total_s += latency
        replica.latency_count += 1
        if failed:
            replica.failed += 1
        else:
            replica.done += 1
            replica.calibration = calibrated(replica.calibration, execute_s, pool_request.work)
        pool_request._close(error)
        if self.on_request_done is not None:
            try:
                self.on_request_done(
                    self.stage_name,
                    replica.replica_id,
                    latency,
                    failed,
                    execute_s,
                    pool_request.work,
                )
            except Exception:
                # A metrics hook must not stop outputs reaching their requests.
                logger.exception("stage %r: on_request_done failed", self.stage_name)

    async def _abort(self, pool_request: PoolRequest) -> None:
        replica = self._replicas.get(pool_request.replica_id)
        if replica is None or not self._unbind(replica, pool_request):
            return
        replica.aborted += 1
        # Until its aborted output comes back, the id is the replica's still.
        replica.aborting.add(pool_request.request_id)
        pool_request._close(None)
        try:
            await replica.client.abort_requests_async([pool_request.request_id])
        except StageCoreDeadError as e:
            self._evict(replica, _describe(e))

    async def _abort_quietly(self, replica: _Replica, request_id: str) -> None:
        try:
            await replica.client.abort_requests_async([request_id])
        except Exception as e:
            logger.debug("stage %r: abort of %r failed: %s", self.stage_name, request_id, e)

    def _evict(self, replica: _Replica, reason: str) -> None:
        if self._replicas.get(replica.replica_id) is not replica:
            return
        logger.warning(
            "stage %r: evicting replica %d (%s): %s",
            self.stage_name,
            replica.replica_id,
            replica.address or "no address",
            reason,
        )
        self._detach(replica, reason)
        self._shut_down(replica)

    def _detach(self, replica: _Replica, reason: str) -> list[str]:
        """Take ``replica`` out of the pool; fail its requests. Returns their ids."""
        del self._replicas[replica.replica_id]
        ids = list(replica.requests)
        for pool_request in list(replica.requests.values()):
            if pool_request._submitted:
                lost = ReplicaLostError(
                    self.stage_name, replica.replica_id, replica.address, reason
                )
                self._finish(replica, pool_request, failed=True, error=lost)
            else:
                # add_request is still sending it, and will try another replica.
                self._unbind(replica, pool_request)
        replica.aborting.clear()
        replica.drained.set()
        return ids

    async def _stop(self, replica: _Replica) -> None:
        reader = self._shut_down(replica)
        if reader is not None:
            await asyncio.gather(reader, return_exceptions=True)

    def _shut_down(self, replica: _Replica) -> asyncio.Task[None] | None:
        """Stop the reader (unless it is the caller) and the client; returns the reader."""
        reader = replica.reader
        if reader is not None and reader is asyncio.current_task():
            reader = None
        if reader is not None:
            reader.cancel()
        try:
            replica.client.shutdown()
        except Exception as e:
            logger.warning(
                "stage %r: shutting down replica %d failed: %s",
                self.stage_name,
                replica.replica_id,
                _describe(e),
            )
        return reader


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
