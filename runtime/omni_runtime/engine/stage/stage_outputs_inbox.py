"""StageOutputsInbox: what a stage client's reader task received, for the contract's callers.

The clients that read their own socket (the diffusion core client, the remote stage
client) hand every message to an inbox: request outputs queue for ``get_outputs_async`` /
``get_outputs_nowait``, a utility answer resolves the ``collective_rpc_async`` call waiting
for it, and a death notice fails every waiting call and stays at the head of the queue, so
that every later read raises StageCoreDeadError with the same reason.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

from omni_runtime.engine.stage.stage_core_client import StageCoreDeadError
from omni_runtime.engine.stage.stage_core_types import StageUtilityOutput


class OutputsMessage(Protocol):
    """What every stage outputs message carries, whatever the stage."""

    @property
    def outputs(self) -> Any: ...
    @property
    def utility_output(self) -> StageUtilityOutput | None: ...
    @property
    def engine_dead(self) -> str | None: ...


OutputsT = TypeVar("OutputsT", bound=OutputsMessage)


class StageOutputsInbox(Generic[OutputsT]):
    """Outputs waiting to be read and utility calls waiting for answers, of one client.

    ``describe_death`` turns a death notice's reason into the StageCoreDeadError message
    callers see. Belongs to the event loop it is first used in.
    """

    def __init__(self, describe_death: Callable[[str], str]) -> None:
        self._describe_death = describe_death
        self._queue: asyncio.Queue[OutputsT] = asyncio.Queue()
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self.dead_reason: str | None = None

    def deliver(self, message: OutputsT) -> None:
        """Take one message from the reader task."""
        answer = message.utility_output
        if answer is not None:
            future = self._calls.get(answer.call_id)
            if future is not None and not future.done():
                if answer.failure_message is None:
                    future.set_result(answer.result)
                else:
                    future.set_exception(RuntimeError(answer.failure_message))
        if message.engine_dead is not None:
            self.dead_reason = message.engine_dead
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(StageCoreDeadError(self._describe_death(self.dead_reason)))
            self._queue.put_nowait(message)
        elif message.outputs:
            self._queue.put_nowait(message)

    async def get(self, check_health: Callable[[], None]) -> OutputsT:
        """The next outputs message; ``check_health`` runs first when none is waiting."""
        if self._queue.empty():
            check_health()
        return self._checked(await self._queue.get())

    def get_nowait(self, check_health: Callable[[], None]) -> OutputsT | None:
        try:
            message = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            check_health()
            return None
        return self._checked(message)

    async def call(
        self, send: Callable[[int], Awaitable[None]], timeout: float | None = None
    ) -> Any:
        """Send a utility call with ``send(call_id)`` and wait for its answer."""
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            await send(call_id)
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    def _checked(self, message: OutputsT) -> OutputsT:
        if message.engine_dead is not None:
            self._queue.put_nowait(message)  # every later read fails the same way
            raise StageCoreDeadError(self._describe_death(message.engine_dead))
        return message
