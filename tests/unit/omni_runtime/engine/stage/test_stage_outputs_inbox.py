"""StageOutputsInbox: outputs in order, utility answers to their callers, death sticks."""

from __future__ import annotations

import asyncio

import pytest

from omni_runtime.engine.stage.stage_core_client import StageCoreDeadError
from omni_runtime.engine.stage.stage_core_types import (
    StageServerOutput,
    StageServerOutputs,
    StageUtilityOutput,
)
from omni_runtime.engine.stage.stage_outputs_inbox import StageOutputsInbox


def healthy() -> None:
    pass


async def test_outputs_arrive_in_order_and_utility_answers_reach_their_call() -> None:
    inbox = StageOutputsInbox[StageServerOutputs](lambda reason: f"gone: {reason}")
    sent: list[int] = []
    was_sent = asyncio.Event()

    async def send(call_id: int) -> None:
        sent.append(call_id)
        was_sent.set()

    call = asyncio.create_task(inbox.call(send, timeout=5))
    await was_sent.wait()
    inbox.deliver(StageServerOutputs(outputs=[StageServerOutput(request_id="a")]))
    inbox.deliver(StageServerOutputs(utility_output=StageUtilityOutput(sent[0], result=42)))
    inbox.deliver(StageServerOutputs(outputs=[StageServerOutput(request_id="b")]))
    assert await call == 42
    first = await inbox.get(healthy)
    second = inbox.get_nowait(healthy)
    assert [first.outputs[0].request_id, second and second.outputs[0].request_id] == ["a", "b"]
    assert inbox.get_nowait(healthy) is None


async def test_a_failed_utility_call_raises_its_message() -> None:
    inbox = StageOutputsInbox[StageServerOutputs](lambda reason: reason)

    async def send(call_id: int) -> None:
        answer = StageUtilityOutput(call_id, failure_message="unknown method 'x'")
        inbox.deliver(StageServerOutputs(utility_output=answer))

    with pytest.raises(RuntimeError, match="unknown method 'x'"):
        await inbox.call(send, timeout=5)


async def test_death_fails_waiting_calls_and_every_later_read() -> None:
    inbox = StageOutputsInbox[StageServerOutputs](lambda reason: f"replica gone: {reason}")

    was_sent = asyncio.Event()

    async def send(call_id: int) -> None:
        was_sent.set()

    call = asyncio.create_task(inbox.call(send, timeout=5))
    await was_sent.wait()
    inbox.deliver(StageServerOutputs(engine_dead="connection dropped"))
    with pytest.raises(StageCoreDeadError, match="replica gone: connection dropped"):
        await call
    for _ in range(2):
        with pytest.raises(StageCoreDeadError, match="replica gone: connection dropped"):
            await inbox.get(healthy)
    with pytest.raises(StageCoreDeadError):
        inbox.get_nowait(healthy)
    assert inbox.dead_reason == "connection dropped"
