"""ZmqStageClientBase: a stage client that reads its own ZMQ socket.

The diffusion core client (PUSH/PULL to its core proc over ipc) and the router's remote
stage client (a DEALER to a stage server over TCP) are the same machine around different
sockets: requests go out as a type frame and the wire encoding of the payload; a reader
task decodes every message of outputs and hands it to a StageOutputsInbox, which queues
request outputs, resolves utility calls and makes a death notice stick; once dead, a client
stays dead and every call raises StageCoreDeadError with the reason. The LLM clients are
vLLM's own and do not use this base.

A subclass gives the two sockets and may add background tasks (a connection monitor, a
heartbeat) and its own view of what an outputs message means (``_on_outputs``).
An instance belongs to the event loop it is first used in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar, Generic, TypeVar

import zmq
import zmq.asyncio

from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase, StageCoreDeadError
from omni_runtime.engine.stage.stage_core_types import (
    StageCoreRequest,
    StageCoreRequestType,
    StageDiffusionCoreOutputs,
    StageServerOutputs,
    StageUtilityCall,
)
from omni_runtime.engine.stage.stage_outputs_inbox import StageOutputsInbox
from omni_runtime.wire import WireDecoder, WireEncoder, WireError

logger = logging.getLogger(__name__)

# The outputs messages of the stages whose clients read their own socket.
OutputsT = TypeVar("OutputsT", StageDiffusionCoreOutputs, StageServerOutputs)


class ZmqStageClientBase(StageCoreClientBase, Generic[OutputsT]):
    """The stage contract over a send socket and a receive socket of the caller's."""

    # What add_request_async accepts, and what a death notice is built as.
    request_type: ClassVar[type[StageCoreRequest]]
    outputs_type: ClassVar[type[Any]]

    def __init__(
        self,
        send_socket: zmq.asyncio.Socket,
        recv_socket: zmq.asyncio.Socket,
        *,
        describe_death: Callable[[str], str],
        name: str,
    ) -> None:
        self._send_socket = send_socket
        self._recv_socket = recv_socket
        self._describe_death = describe_death
        self._name = name
        self._encoder = WireEncoder()
        self._decoder = WireDecoder(self.outputs_type)
        self._inbox: StageOutputsInbox[OutputsT] = StageOutputsInbox(describe_death)
        self._tasks: list[asyncio.Task[None]] = []
        self._dead_reason: str | None = None

    # -- the contract ------------------------------------------------------------------

    async def add_request_async(self, request: StageCoreRequest) -> None:
        if not isinstance(request, self.request_type):
            raise TypeError(
                f"{self._name} takes {self.request_type.__name__}, not {type(request).__name__}"
            )
        await self._send(StageCoreRequestType.ADD, request)

    async def get_outputs_async(self) -> OutputsT:
        self._start()
        return await self._inbox.get(self.check_health)

    def get_outputs_nowait(self) -> OutputsT | None:
        self._start()
        return self._inbox.get_nowait(self.check_health)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and self._dead_reason is None:
            await self._send(StageCoreRequestType.ABORT, list(request_ids))

    async def collective_rpc_async(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self._start()

        async def send(call_id: int) -> None:
            call = StageUtilityCall(call_id, method, list(args), dict(kwargs or {}))
            await self._send(StageCoreRequestType.UTILITY, call)

        return await self._inbox.call(send, timeout)

    def check_health(self) -> None:
        if self._dead_reason is not None:
            raise StageCoreDeadError(self._describe_death(self._dead_reason))

    def shutdown(self) -> None:
        self._stop_tasks()
        if self._dead_reason is None:
            self._die("shut down")

    # -- for subclasses ----------------------------------------------------------------

    def _background(self) -> dict[str, Coroutine[Any, Any, None]]:
        """Tasks to run beside the reader while the client lives, by name."""
        return {}

    def _on_outputs(self, outputs: OutputsT) -> bool:
        """Handle one decoded message; False stops the reader (the client died of it)."""
        self._inbox.deliver(outputs)
        if outputs.engine_dead is not None:
            self._dead_reason = outputs.engine_dead
            return False
        return True

    def _heard(self) -> None:
        """Called for every message received, before it is decoded."""

    def _start(self) -> None:
        if self._tasks or self._dead_reason is not None:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read_outputs(), name=f"{self._name}-outputs")]
        self._tasks += [
            loop.create_task(coro, name=f"{self._name}-{what}")
            for what, coro in self._background().items()
        ]

    async def _send(self, kind: StageCoreRequestType, payload: Any) -> None:
        self._start()
        self.check_health()
        frames: list[Any] = [] if payload is None else self._encoder.encode(payload)
        try:
            await self._send_socket.send_multipart([kind.value, *frames], copy=False)
        except zmq.ZMQError as e:
            self._die(f"sending failed: {e}")
            self.check_health()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller's own cancellation
            # The socket closed under the send (the replica was found dead meanwhile and
            # its client shut), which cancels the send's future: the replica is gone, not
            # the caller, who may send elsewhere.
            self._die("the connection closed while sending")
            self.check_health()

    def _die(self, reason: str) -> None:
        """Declare the stage gone: every waiting and later call fails with ``reason``."""
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        # Fails waiting calls, and wakes a reader blocked in get_outputs_async.
        self._inbox.deliver(self.outputs_type(engine_dead=reason, timestamp=time.time()))
        current = asyncio.current_task() if _in_loop() else None
        for task in self._tasks:
            if task is not current:
                task.cancel()

    def _stop_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()

    async def _read_outputs(self) -> None:
        while True:
            frames: list[zmq.Frame] = await self._recv_socket.recv_multipart(copy=False)
            self._heard()
            try:
                outputs: OutputsT = self._decoder.decode(frames)
            except WireError as e:
                # Only our peer sends here; a message we cannot read is a bug to report,
                # not a reason to stop reading the ones after it.
                logger.error("%s: undecodable message dropped: %s", self._name, e)
                continue
            if not self._on_outputs(outputs):
                return


def _in_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
