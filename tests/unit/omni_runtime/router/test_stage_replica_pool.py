"""StageReplicaPool over stand-in replicas: routing, output dispatch, eviction, draining.

The replicas here are tests/fake_replica.py's stand-in StageCoreClientBase, which answers
when a test tells it to and can be made to die; the real clients are exercised end to end
elsewhere.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest

from fake_replica import FakeReplica
from omni_runtime.engine.stage.stage_core_client import StageCoreDeadError
from omni_runtime.engine.stage.stage_core_types import (
    StageCoreOutput,
    StageDiffusionCoreOutput,
    StageDiffusionCoreOutputs,
    StageError,
    StageServerOutput,
    StageServerOutputs,
    StageServerRequest,
)
from omni_runtime.router.replica_policies import PolicyState, ReplicaCandidate, choose_replica
from omni_runtime.router.stage_replica_pool import (
    NoLiveReplicaError,
    PoolRequest,
    PoolSaturatedError,
    ReplicaLostError,
    StageReplicaPool,
    is_failed_output,
    is_final_output,
)

T = TypeVar("T")
TIMEOUT = 5.0


async def within(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, TIMEOUT)


async def until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` (the pool reacts on its reader tasks) until true or the deadline."""
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


async def collect(pool_request: PoolRequest) -> list[StageCoreOutput]:
    return await within(_collect(pool_request))


async def _collect(pool_request: PoolRequest) -> list[StageCoreOutput]:
    return [output async for output in pool_request]


def texts(outputs: list[StageCoreOutput]) -> list[str]:
    return [output.text for output in outputs if isinstance(output, StageServerOutput)]


def req(request_id: str) -> StageServerRequest:
    return StageServerRequest(request_id, prompt="a cat")


PoolFactory = Callable[..., tuple[StageReplicaPool, list[FakeReplica]]]


@pytest.fixture
async def make_pool() -> AsyncIterator[PoolFactory]:
    """A pool over ``n`` fake replicas at addresses r0:7000, r1:7000, ...; closed after."""
    pools: list[StageReplicaPool] = []

    def make(n: int, **kwargs: Any) -> tuple[StageReplicaPool, list[FakeReplica]]:
        pool = StageReplicaPool("dit", **kwargs)
        replicas = [FakeReplica(f"r{i}") for i in range(n)]
        for replica in replicas:
            pool.add_replica(replica, f"{replica.name}:7000")
        pools.append(pool)
        return pool, replicas

    yield make
    for pool in pools:
        await pool.close()


async def test_round_robin_spreads_requests(make_pool: PoolFactory) -> None:
    pool, replicas = make_pool(3)
    sent = [await pool.add_request(req(f"q{i}")) for i in range(6)]
    assert [r.replica_id for r in sent] == [0, 1, 2, 0, 1, 2]
    assert [replica.received for replica in replicas] == [["q0", "q3"], ["q1", "q4"], ["q2", "q5"]]
    assert pool.in_flight == 6


async def test_least_outstanding_sends_to_the_idle_replica(make_pool: PoolFactory) -> None:
    pool, (r0, _) = make_pool(2, policy="least-outstanding-requests")
    sent = [await pool.add_request(req(i)) for i in ("a", "b", "c")]
    assert [r.replica_id for r in sent] == [0, 1, 0]
    r0.answer("a")
    r0.answer("c")
    await collect(sent[0])
    await collect(sent[2])
    # Replica 1 is busy and 0 idle: 0 again, where round-robin would take its turn on 1.
    assert (await pool.add_request(req("d"))).replica_id == 0
    assert (await pool.add_request(req("e"))).replica_id == 1
    assert [s.in_flight for s in pool.stats()] == [1, 2]


async def test_least_work_weighs_requests_by_their_work(make_pool: PoolFactory) -> None:
    pool, (r0, r1) = make_pool(2, policy="least-outstanding-work")
    big = await pool.add_request(req("big"), work=50.0)
    small = [await pool.add_request(req(f"s{i}"), work=0.25) for i in range(3)]
    # The big request holds replica 0: the small ones all go to 1, not one each in turn.
    assert big.replica_id == 0
    assert [s.replica_id for s in small] == [1, 1, 1]
    # Replica 0 ran 0.1 s per unit, replica 1 0.5 s: five times slower.
    r0.answer("big", execute_time=5.0)
    for i in range(3):
        r1.answer(f"s{i}", execute_time=0.125)
    for request in (big, *small):
        await collect(request)
    assert (await pool.add_request(req("p"), work=20.0)).replica_id == 0
    assert (await pool.add_request(req("q"), work=5.0)).replica_id == 1
    # 20 units on 0 are 2 s of work, 5 on 1 are 2.5 s: 0 is the sooner free.
    assert (await pool.add_request(req("r"), work=1.0)).replica_id == 0


async def test_sticky_keeps_a_key_on_its_replica(make_pool: PoolFactory) -> None:
    pool, _ = make_pool(3, policy="sticky")
    expected, _ = choose_replica(
        "sticky",
        [ReplicaCandidate(i, name=f"r{i}:7000") for i in range(3)],
        PolicyState(),
        "session-42",
    )
    sent = [await pool.add_request(req(f"q{i}"), sticky_key="session-42") for i in range(5)]
    assert {r.replica_id for r in sent} == {expected}
    # Without a key, the request id decides, so the requests spread out.
    spread = {(await pool.add_request(req(f"free-{i}"))).replica_id for i in range(30)}
    assert spread == {0, 1, 2}


async def test_outputs_reach_their_own_requests(make_pool: PoolFactory) -> None:
    pool, (replica,) = make_pool(1)
    a = await pool.add_request(req("a"))
    b = await pool.add_request(req("b"))
    replica.emit(replica.step("a", "a1"), replica.step("b", "b1"), replica.step("a", "a2"))
    replica.emit(replica.step("b", "b2"))
    replica.answer("b", "b3")
    replica.answer("a", "a3")
    assert texts(await collect(b)) == ["b1", "b2", "b3"]
    assert texts(await collect(a)) == ["a1", "a2", "a3"]
    # After the final output the request is done for good.
    with pytest.raises(StopAsyncIteration):
        await a.next_output()
    assert pool.in_flight == 0
    assert a.finished


async def test_a_dead_replica_fails_only_its_requests(make_pool: PoolFactory) -> None:
    done: list[tuple[str, int, bool]] = []
    pool, (r0, r1) = make_pool(2, on_request_done=lambda s, i, _lat, f, *_: done.append((s, i, f)))
    on_r0 = await pool.add_request(req("a"))
    on_r1 = await pool.add_request(req("b"))
    r0.emit(r0.step("a", "partial"))
    r0.die("core exited with code -9")

    assert texts([await within(on_r0.next_output())]) == ["partial"]
    with pytest.raises(ReplicaLostError) as lost:
        await within(on_r0.next_output())
    message = str(lost.value)
    assert "'dit'" in message
    assert "replica 0" in message
    assert "r0:7000" in message
    assert "core exited with code -9" in message
    assert isinstance(lost.value, StageCoreDeadError)
    # The failure stays put: asking again says the same.
    with pytest.raises(ReplicaLostError):
        await on_r0.next_output()

    assert pool.live_replica_count == 1
    assert r0.shut_down
    assert [s.replica_id for s in pool.stats()] == [1]
    assert done == [("dit", 0, True)]

    r1.answer("b", "fine")
    assert texts(await collect(on_r1)) == ["fine"]
    later = [await pool.add_request(req(f"later-{i}")) for i in range(3)]
    assert {r.replica_id for r in later} == {1}


async def test_an_engine_dead_notice_evicts_the_replica(make_pool: PoolFactory) -> None:
    pool, (r0, _) = make_pool(2)
    on_r0 = await pool.add_request(req("a"))
    r0._outputs.put_nowait(StageServerOutputs(engine_dead="CUDA error: out of memory"))
    with pytest.raises(ReplicaLostError, match="CUDA error: out of memory"):
        await collect(on_r0)
    assert pool.live_replica_count == 1


async def test_a_failed_health_check_evicts_before_routing(make_pool: PoolFactory) -> None:
    pool, (r0, r1) = make_pool(2)
    # Dead, but its output stream has not said so yet: the health check catches it.
    r0.dead = "no heartbeat for 10 s"
    sent = await pool.add_request(req("a"))
    assert sent.replica_id == 1
    assert r0.shut_down
    assert r1.received == ["a"]
    assert [s.replica_id for s in pool.stats()] == [1]


async def test_a_replica_dying_on_send_is_skipped(make_pool: PoolFactory) -> None:
    pool, (r0, r1) = make_pool(2)
    r0.dead_on_send = True
    sent = await pool.add_request(req("a"))
    assert sent.replica_id == 1
    assert r1.received == ["a"]
    assert pool.live_replica_count == 1
    assert pool.in_flight == 1


async def test_a_replica_lost_mid_send_sends_the_request_elsewhere(
    make_pool: PoolFactory,
) -> None:
    pool, (r0, r1) = make_pool(2)
    r0.hold_sends = asyncio.Event()
    sending = asyncio.create_task(pool.add_request(req("a")))
    await until(lambda: pool.in_flight == 1)
    r0.die("connection reset")
    await until(lambda: pool.live_replica_count == 1)
    r0.hold_sends.set()
    sent = await within(sending)
    assert sent.replica_id == 1
    assert r1.received == ["a"]
    # Never a failure on r0: the caller did not see it there.
    assert [s.replica_id for s in pool.stats()] == [1]


async def test_a_replica_added_while_serving_takes_traffic(make_pool: PoolFactory) -> None:
    pool, (r0,) = make_pool(1)
    first = await pool.add_request(req("a"))
    late = FakeReplica("late")
    assert pool.add_replica(late, "late:7000") == 1
    second = await pool.add_request(req("b"))
    assert second.replica_id == 1
    assert late.received == ["b"]
    late.answer("b", "from the new one")
    r0.answer("a", "from the old one")
    assert texts(await collect(second)) == ["from the new one"]
    assert texts(await collect(first)) == ["from the old one"]


async def test_replica_ids_are_never_reused(make_pool: PoolFactory) -> None:
    pool, _ = make_pool(2)
    await pool.remove_replica(0)
    assert pool.add_replica(FakeReplica()) == 2
    assert [s.replica_id for s in pool.stats()] == [1, 2]
    # Removing what is gone already is not an error (watchers race with eviction).
    await pool.remove_replica(0)


async def test_remove_replica_drains_its_requests(make_pool: PoolFactory) -> None:
    pool, (r0, r1) = make_pool(2)
    on_r0 = await pool.add_request(req("a"))
    removal = asyncio.create_task(pool.remove_replica(0))
    await until(lambda: pool.stats()[0].draining)
    assert pool.live_replica_count == 1
    # The draining replica takes nothing new.
    assert {(await pool.add_request(req(f"b{i}"))).replica_id for i in range(3)} == {1}
    assert not removal.done()
    assert not r0.shut_down

    r0.answer("a", "finished while draining")
    assert texts(await collect(on_r0)) == ["finished while draining"]
    await within(removal)
    assert r0.shut_down
    assert r0.aborted == []
    assert [s.replica_id for s in pool.stats()] == [1]
    assert not r1.shut_down


async def test_remove_replica_gives_up_after_the_drain_timeout(make_pool: PoolFactory) -> None:
    pool, (r0,) = make_pool(1)
    stuck = await pool.add_request(req("a"))
    await within(pool.remove_replica(0, drain_timeout=0.05))
    with pytest.raises(ReplicaLostError, match="removed from the pool"):
        await collect(stuck)
    assert r0.aborted == ["a"]
    assert r0.shut_down
    with pytest.raises(NoLiveReplicaError, match="'dit' has no live replica"):
        await pool.add_request(req("b"))


async def test_saturated_replicas_refuse(make_pool: PoolFactory) -> None:
    pool, (r0, _) = make_pool(2, max_in_flight_per_replica=1)
    first = await pool.add_request(req("a"))
    await pool.add_request(req("b"))
    with pytest.raises(PoolSaturatedError, match="all 2 live replica"):
        await pool.add_request(req("c"))
    r0.answer("a")
    await collect(first)
    assert (await pool.add_request(req("c"))).replica_id == 0


async def test_no_replica_is_an_error_naming_the_stage() -> None:
    pool = StageReplicaPool("thinker")
    with pytest.raises(NoLiveReplicaError, match="'thinker' has no live replica"):
        await pool.add_request(req("a"))
    await pool.close()


async def test_an_id_in_flight_is_refused(make_pool: PoolFactory) -> None:
    pool, (r0, _) = make_pool(2)
    first = await pool.add_request(req("a"))
    with pytest.raises(ValueError, match="'a' is in flight already"):
        await pool.add_request(req("a"))
    r0.answer("a")
    await collect(first)
    assert (await pool.add_request(req("a"))).replica_id == 1


async def test_abort_stops_the_request_on_its_replica(make_pool: PoolFactory) -> None:
    done: list[bool] = []
    pool, (r0, _) = make_pool(2, on_request_done=lambda *args: done.append(args[3]))
    pool_request = await pool.add_request(req("a"))
    r0.emit(r0.step("a", "a1"))
    assert texts([await within(pool_request.next_output())]) == ["a1"]
    await pool_request.abort()
    assert r0.aborted == ["a"]
    assert pool.in_flight == 0
    assert await collect(pool_request) == []
    # The replica's aborted output is dropped; once it is back, the id is free again.
    await until(lambda: "a" not in r0.pending)
    await until(lambda: _reusable(pool, "a"))
    await pool_request.abort()  # a no-op now
    assert r0.aborted == ["a"]
    (stats, _) = pool.stats()
    assert (stats.aborted, stats.done, stats.failed, stats.latency_count) == (1, 0, 0, 0)
    assert done == []


def _reusable(pool: StageReplicaPool, request_id: str) -> bool:
    try:
        pool._check_id_free(request_id)
    except ValueError:
        return False
    return True


async def test_cancelling_add_request_aborts_on_the_replica(make_pool: PoolFactory) -> None:
    pool, (r0,) = make_pool(1)
    r0.hold_sends = asyncio.Event()
    sending = asyncio.create_task(pool.add_request(req("a")))
    await until(lambda: pool.in_flight == 1)
    sending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sending
    assert pool.in_flight == 0
    await until(lambda: r0.aborted == ["a"])


async def test_counters_and_the_done_hook(make_pool: PoolFactory) -> None:
    done: list[tuple[str, int, float, bool, float, float]] = []
    pool, (r0, r1) = make_pool(2, on_request_done=lambda *args: done.append(args))
    ok = await pool.add_request(req("ok"), work=3.0)
    bad = await pool.add_request(req("bad"))
    await pool.add_request(req("waiting"), work=2.0)
    r0.answer("ok", execute_time=0.25)
    height = StageError.bad_request("params.height: Expected int >= 1", "height")
    r1.answer("bad", error=height)
    await collect(ok)
    # A refused request is an output, not an exception: the caller reads why.
    (refusal,) = await collect(bad)
    assert isinstance(refusal, StageServerOutput)
    assert refusal.error == height

    s0, s1 = pool.stats()
    assert (s0.replica_id, s0.address, s0.draining) == (0, "r0:7000", False)
    assert (s0.in_flight, s0.done, s0.failed, s0.latency_count) == (1, 1, 0, 1)
    assert (s1.in_flight, s1.done, s1.failed, s1.latency_count) == (0, 0, 1, 1)
    assert s0.latency_total_s >= 0.0
    assert pool.in_flight == 1
    assert pool.live_replica_count == 2
    assert [(stage, replica, failed) for stage, replica, _, failed, *_ in done] == [
        ("dit", 0, False),
        ("dit", 1, True),
    ]
    assert all(latency >= 0.0 for _, _, latency, *_ in done)
    # What the replica said it worked on the request reaches the hook (0: said nothing),
    # with the request's work (1 without an estimate).
    assert [(execute_s, work) for *_, execute_s, work in done] == [(0.25, 3.0), (0.0, 1.0)]
    # The work still on each replica, and the cost fit of the one that ran something.
    assert (s0.outstanding_work, s1.outstanding_work) == (2.0, 0.0)
    assert s0.cost == (0.0, pytest.approx(0.25 / 3.0))
    assert s1.cost is None


async def test_a_broken_done_hook_does_not_stop_outputs(make_pool: PoolFactory) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("metrics are down")

    pool, (r0,) = make_pool(1, on_request_done=broken)
    first = await pool.add_request(req("a"))
    second = await pool.add_request(req("b"))
    r0.answer("a")
    r0.answer("b")
    assert texts(await collect(first)) == ["done"]
    assert texts(await collect(second)) == ["done"]
    assert pool.live_replica_count == 1


async def test_diffusion_outputs_pass_through(make_pool: PoolFactory) -> None:
    pool, (r0,) = make_pool(1)
    ok = await pool.add_request(req("ok"))
    stopped = await pool.add_request(req("stopped"))
    r0._outputs.put_nowait(
        StageDiffusionCoreOutputs(
            outputs=[
                StageDiffusionCoreOutput("ok", execute_time=0.5),
                StageDiffusionCoreOutput("stopped", aborted=True),
            ]
        )
    )
    assert [o.request_id for o in await collect(ok)] == ["ok"]  # type: ignore[attr-defined]
    assert len(await collect(stopped)) == 1
    (stats,) = pool.stats()
    assert (stats.done, stats.failed) == (1, 1)


async def test_close_fails_what_is_in_flight_and_is_idempotent(make_pool: PoolFactory) -> None:
    pool, replicas = make_pool(2)
    pending = await pool.add_request(req("a"))
    await pool.close()
    await pool.close()
    assert all(replica.shut_down for replica in replicas)
    with pytest.raises(ReplicaLostError, match="closed"):
        await collect(pending)
    with pytest.raises(RuntimeError, match="closed"):
        await pool.add_request(req("b"))
    with pytest.raises(RuntimeError, match="closed"):
        pool.add_replica(FakeReplica())


async def test_the_pool_belongs_to_its_first_loop(make_pool: PoolFactory) -> None:
    pool, _ = make_pool(1)
    await pool.add_request(req("a"))
    with pytest.raises(RuntimeError, match="another event loop"):
        await asyncio.to_thread(asyncio.run, pool.add_request(req("b")))


def test_replicas_added_before_any_loop_start_reading_on_first_use() -> None:
    pool = StageReplicaPool("dit")
    replica = FakeReplica()
    pool.add_replica(replica)

    async def scenario() -> list[StageCoreOutput]:
        pool_request = await pool.add_request(req("a"))
        replica.answer("a", "read")
        try:
            return await collect(pool_request)
        finally:
            await pool.close()

    assert texts(asyncio.run(scenario())) == ["read"]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown router policy 'random'"):
        StageReplicaPool("dit", "random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_in_flight_per_replica must be >= 1"):
        StageReplicaPool("dit", max_in_flight_per_replica=0)


@pytest.mark.parametrize(
    ("output", "final", "failed"),
    [
        (StageServerOutput("r", "step"), False, False),
        (StageServerOutput("r", finished=True, finish_reason="stop"), True, False),
        (StageServerOutput("r", finished=True, finish_reason="length"), True, False),
        (
            StageServerOutput(
                "r", finished=True, finish_reason="error", error=StageError.bad_request("boom")
            ),
            True,
            True,
        ),
        (StageServerOutput("r", finished=True, finish_reason="abort"), True, True),
        (StageDiffusionCoreOutput("r"), True, False),
        (
            StageDiffusionCoreOutput(
                "r", error=StageError.bad_request("width: must be a multiple of 4", "width")
            ),
            True,
            True,
        ),
        (StageDiffusionCoreOutput("r", aborted=True), True, True),
    ],
)
def test_finality_and_failure_of_outputs(output: object, final: bool, failed: bool) -> None:
    assert is_final_output(output) is final
    assert is_failed_output(output) is failed


def test_finality_and_failure_of_llm_outputs() -> None:
    from vllm.v1.engine import FinishReason

    from omni_runtime.engine.stage.stage_core_types import StageLLMCoreOutput

    def llm(reason: FinishReason | None, error: StageError | None = None) -> StageLLMCoreOutput:
        return StageLLMCoreOutput(
            request_id="r", new_token_ids=[1], finish_reason=reason, error=error
        )

    assert (is_final_output(llm(None)), is_failed_output(llm(None))) == (False, False)
    assert (is_final_output(llm(FinishReason.STOP)), is_failed_output(llm(FinishReason.STOP))) == (
        True,
        False,
    )
    assert is_failed_output(llm(FinishReason.ERROR, StageError.bad_request("prompt: too long")))
    assert is_failed_output(llm(FinishReason.ABORT))


async def test_a_terminating_replica_takes_requests_only_where_no_other_does(
    make_pool: PoolFactory,
) -> None:
    pool, (r0, r1) = make_pool(2)
    pool.set_terminating(0, True)
    pool.set_terminating(99, True)  # gone already: ignored
    assert [s.terminating for s in pool.stats()] == [True, False]
    for n in range(3):
        request = await pool.add_request(req(f"a{n}"))
        r1.answer(f"a{n}")
        await collect(request)
    assert (r0.received, r1.received) == ([], ["a0", "a1", "a2"])
    r1.die("gone")
    await until(lambda: pool.live_replica_count == 1)
    request = await pool.add_request(req("b"))
    r0.answer("b")
    assert texts(await collect(request)) == ["done"]
    assert r0.received == ["b"]
