"""RemoteStageClient: a stage replica in another process or pod, behind the stage contract.

What a router's StageReplicaPool holds for each replica: a DEALER socket connected to the
replica's StageServer. It pings the server every ``heartbeat_interval`` seconds (which also
tells the server this router is alive) and declares the replica dead, failing everything
outstanding with StageCoreDeadError, when the TCP connection drops, when no answer came
for ``heartbeat_timeout`` seconds, or when the server says its core died. A dead client
stays dead: whoever discovers replicas makes a new client when the replica is back.

An instance belongs to the event loop it is first used in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase, StageCoreDeadError
from omni_runtime.engine.stage.stage_core_types import (
    StageCoreRequest,
    StageCoreRequestType,
    StageLoad,
    StageServerOutputs,
    StageServerRequest,
    StageUtilityCall,
)
from omni_runtime.engine.stage.stage_outputs_inbox import StageOutputsInbox
from omni_runtime.wire import WireDecoder, WireEncoder, WireError

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_INTERVAL = 1.0
DEFAULT_HEARTBEAT_TIMEOUT = 5.0


class RemoteStageClient(StageCoreClientBase):
    """The client of one stage server (``host:port``)."""

    def __init__(
        self,
        address: str,
        *,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
    ) -> None:
        self.address = address
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self._ctx = zmq.asyncio.Context()
        self._finalizer = weakref.finalize(self, self._ctx.destroy, 0)
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Never queue requests for a server we are not connected to: fail fast instead.
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        )
        self._socket.connect(f"tcp://{address}")
        self._encoder = WireEncoder()
        self._decoder = WireDecoder(StageServerOutputs)
        self._inbox = StageOutputsInbox[StageServerOutputs](
            lambda reason: f"stage replica at {address} is gone: {reason}"
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._connected = asyncio.Event()
        self._last_heard = time.monotonic()
        self.load: StageLoad | None = None
        self._load_seen = asyncio.Event()
        self._dead_reason: str | None = None

    async def wait_ready(self, timeout: float) -> StageLoad:
        """Wait until the server answers with a live core; StageCoreDeadError if it does
        not within ``timeout`` seconds (or says its core is dead)."""
        self._start()
        try:
            async with asyncio.timeout(timeout):
                while True:
                    self.check_health()
                    if self.load is not None:
                        if not self.load.alive:
                            self._die(f"its core is dead: {self.load.reason}")
                            self.check_health()
                        return self.load
                    self._load_seen.clear()
                    await self._send(StageCoreRequestType.HEALTH, None)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._load_seen.wait(), 0.5)
        except TimeoutError:
            self._die(f"no answer within {timeout:.0f} s")
            raise StageCoreDeadError(self._describe_death()) from None

    async def add_request_async(self, request: StageCoreRequest) -> None:
        if not isinstance(request, StageServerRequest):
            raise TypeError(
                f"a stage server takes StageServerRequest, not {type(request).__name__}"
            )
        await self._send(StageCoreRequestType.ADD, request)

    async def get_outputs_async(self) -> StageServerOutputs:
        self._start()
        return await self._inbox.get(self.check_health)

    def get_outputs_nowait(self) -> StageServerOutputs | None:
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

        async def send(call_id: int) -> None:
            call = StageUtilityCall(call_id, method, list(args), dict(kwargs or {}))
            await self._send(StageCoreRequestType.UTILITY, call)

        return await self._inbox.call(send, timeout)

    def check_health(self) -> None:
        if self._dead_reason is not None:
            raise StageCoreDeadError(self._describe_death())

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        if self._dead_reason is None:
            self._die("shut down")
        self._finalizer()

    # -- internals -------------------------------------------------------------------

    def _start(self) -> None:
        if not self._tasks and self._dead_reason is None:
            loop = asyncio.get_running_loop()
            self._tasks = [
                loop.create_task(self._read_outputs(), name=f"stage-{self.address}-outputs"),
                loop.create_task(self._watch_connection(), name=f"stage-{self.address}-monitor"),
                loop.create_task(self._heartbeat(), name=f"stage-{self.address}-heartbeat"),
            ]

    async def _send(self, kind: StageCoreRequestType, payload: Any) -> None:
        self._start()
        self.check_health()
        frames = [] if payload is None else self._encoder.encode(payload)
        try:
            await self._socket.send_multipart([kind.value, *frames], copy=False)
        except zmq.ZMQError as e:
            self._die(f"sending failed: {e}")
            self.check_health()

    async def _read_outputs(self) -> None:
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            self._last_heard = time.monotonic()
            try:
                outputs: StageServerOutputs = self._decoder.decode(frames)
            except WireError as e:
                logger.error("stage server %s: undecodable message dropped: %s", self.address, e)
                continue
            if outputs.load is not None:
                self.load = outputs.load
                self._load_seen.set()
                if not outputs.load.alive:
                    self._die(f"its core is dead: {outputs.load.reason}")
                    return
            if outputs.engine_dead is not None:
                self._die(f"its core died: {outputs.engine_dead}")
                return
            self._inbox.deliver(outputs)

    async def _watch_connection(self) -> None:
        while True:
            event = await recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_CONNECTED:
                self._connected.set()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._die("the connection to it dropped")
                return

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            silent = time.monotonic() - self._last_heard
            if silent > self.heartbeat_timeout:
                self._die(f"no answer for {silent:.1f} s")
                return
            # Bounded: with no connection a send waits for one, and this loop must go on
            # checking the silence.
            with contextlib.suppress(StageCoreDeadError, TimeoutError):
                await asyncio.wait_for(
                    self._send(StageCoreRequestType.HEALTH, None), self.heartbeat_interval
                )

    def _die(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        # Fails waiting calls, and wakes a reader blocked in get_outputs_async.
        self._inbox.deliver(StageServerOutputs(engine_dead=reason, timestamp=time.time()))
        current = asyncio.current_task() if _in_loop() else None
        for task in self._tasks:
            if task is not current:
                task.cancel()

    def _describe_death(self) -> str:
        return f"stage replica at {self.address} is gone: {self._dead_reason}"


def _in_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
