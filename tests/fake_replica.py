"""A stand-in stage replica (a StageCoreClientBase) for the pool's tests and the router's:
it answers only when a test tells it to and dies when told to. The real clients are
exercised end to end by tests/integration, beside these."""

from __future__ import annotations

import asyncio
from typing import Any

from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase, StageCoreDeadError
from omni_runtime.engine.stage.stage_core_types import (
    StageCoreOutputs,
    StageCoreRequest,
    StageError,
    StageServerOutput,
    StageServerOutputs,
    StageServerRequest,
)


class FakeReplica(StageCoreClientBase):
    """A replica that answers only when told to, and dies when told to."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.received: list[str] = []
        self.aborted: list[str] = []
        self.pending: set[str] = set()
        self.dead: str | None = None
        self.dead_on_send = False
        self.shut_down = False
        self.hold_sends: asyncio.Event | None = None
        # What a utility call answers, by method (a test sets them); the calls made.
        self.utility_answers: dict[str, Any] = {}
        self.utility_calls: list[tuple[str, dict[str, Any]]] = []
        self._outputs: asyncio.Queue[StageCoreOutputs | BaseException] = asyncio.Queue()

    async def add_request_async(self, request: StageCoreRequest) -> None:
        self.check_health()
        if self.dead_on_send:
            raise StageCoreDeadError(f"{self.name} is gone")
        if self.hold_sends is not None:
            await self.hold_sends.wait()
        assert isinstance(request, StageServerRequest)
        self.received.append(request.request_id)
        self.pending.add(request.request_id)

    async def get_outputs_async(self) -> StageCoreOutputs:
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._outputs.put_nowait(item)
            raise item
        return item

    def get_outputs_nowait(self) -> StageCoreOutputs | None:
        raise NotImplementedError

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.check_health()
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            if request_id in self.pending:
                self.emit(StageServerOutput(request_id, finished=True, finish_reason="abort"))

    async def collective_rpc_async(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.check_health()
        if method not in self.utility_answers:
            raise NotImplementedError(method)
        self.utility_calls.append((method, dict(kwargs or {})))
        return self.utility_answers[method]

    def check_health(self) -> None:
        if self.dead is not None:
            raise StageCoreDeadError(self.dead)

    def shutdown(self) -> None:
        self.shut_down = True

    # What a test makes the replica do.

    def emit(self, *outputs: StageServerOutput) -> None:
        """Send one message holding ``outputs``."""
        for output in outputs:
            if output.finished:
                self.pending.discard(output.request_id)
        self._outputs.put_nowait(StageServerOutputs(outputs=list(outputs)))

    def answer(
        self,
        request_id: str,
        text: str = "done",
        *,
        error: StageError | None = None,
        execute_time: float = 0.0,
    ) -> None:
        reason = "error" if error else "stop"
        self.emit(
            StageServerOutput(
                request_id,
                text,
                finished=True,
                finish_reason=reason,
                error=error,
                execute_time=execute_time,
            )
        )

    def step(self, request_id: str, text: str) -> StageServerOutput:
        return StageServerOutput(request_id, text)

    def die(self, reason: str) -> None:
        """The core is gone: health checks fail and the output stream ends."""
        self.dead = reason
        self._outputs.put_nowait(StageCoreDeadError(reason))
