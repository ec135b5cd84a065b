"""RemoteStageClient: a stage replica in another process or pod, behind the stage contract.

What a router's StageReplicaPool holds for each replica: a DEALER socket connected to the
replica's StageServer. It pings the server every ``heartbeat_interval`` seconds (which also
tells the server this router is alive) and declares the replica dead, failing everything
outstanding with StageCoreDeadError, when the TCP connection drops, when no answer came
for ``heartbeat_timeout`` seconds, or when the server says its core died. A dead client
stays dead: whoever discovers replicas makes a new client when the replica is back.

A server that starts draining tells every peer at once (a StageLoad with ``draining``);
from then on :attr:`draining` is true and the pool sends the replica nothing new, while
what it holds finishes there. Its ``revision`` is what the replica said at its first
answer.

An instance belongs to the event loop it is first used in.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Coroutine
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from omni_runtime.engine.stage.stage_core_client import StageCoreDeadError
from omni_runtime.engine.stage.stage_core_types import (
    StageCoreRequestType,
    StageLoad,
    StageServerOutputs,
    StageServerRequest,
)
from omni_runtime.engine.stage.zmq_stage_client import ZmqStageClientBase
from omni_runtime.stage_keys import StageClientKeys

DEFAULT_HEARTBEAT_INTERVAL = 1.0
DEFAULT_HEARTBEAT_TIMEOUT = 5.0
# Why a handshake failed, as the monitor tells it; each is final for this client.
_HANDSHAKE_FAILURES: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "it refused this router's stage key (the router and the "
    "stage run with different pipeline keys: check OMNI_STAGE_KEYS_DIR on both)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the handshake failed: one side uses CURVE stage "
    "keys and the other does not (OMNI_STAGE_KEYS_DIR must be set on both or neither)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed: one side uses CURVE stage "
    "keys and the other does not, or it is not a stage server",
}


class RemoteStageClient(ZmqStageClientBase[StageServerOutputs]):
    """The client of one stage server (``host:port``)."""

    request_type = StageServerRequest
    outputs_type = StageServerOutputs

    def __init__(
        self,
        address: str,
        *,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        keys: StageClientKeys | None = None,
    ) -> None:
        self.address = address
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self._ctx = zmq.asyncio.Context()
        self._finalizer = weakref.finalize(self, self._ctx.destroy, 0)
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        # Never queue requests for a server we are not connected to: fail fast instead.
        socket.setsockopt(zmq.IMMEDIATE, 1)
        if keys is not None:
            keys.secure(socket)
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        for event in _HANDSHAKE_FAILURES:
            events |= event
        self._monitor = socket.get_monitor_socket(events)
        socket.connect(f"tcp://{address}")
        super().__init__(
            socket,
            socket,
            describe_death=lambda reason: f"stage replica at {address} is gone: {reason}",
            name=f"stage-{address}",
        )
        self._connected = asyncio.Event()
        self._last_heard = time.monotonic()
        self.load: StageLoad | None = None
        self._load_seen = asyncio.Event()
        self._draining = False

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def revision(self) -> str:
        """The pipeline revision the replica runs ("" until it has answered)."""
        return self.load.revision if self.load is not None else ""

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
                    # Bounded: until a handshake completes the send waits, and a failed
                    # one (a refused key) must be seen by check_health above.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._send(StageCoreRequestType.HEALTH, None), 0.5)
                        await asyncio.wait_for(self._load_seen.wait(), 0.5)
        except TimeoutError:
            self._die(f"no answer within {timeout:.0f} s")
            self.check_health()
            raise  # unreachable: check_health raised

    def shutdown(self) -> None:
        super().shutdown()
        self._finalizer()

    # -- ZmqStageClientBase ------------------------------------------------------------

    def _background(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {"monitor": self._watch_connection(), "heartbeat": self._heartbeat()}

    def _heard(self) -> None:
        self._last_heard = time.monotonic()

    def _on_outputs(self, outputs: StageServerOutputs) -> bool:
        if outputs.load is not None:
            self.load = outputs.load
            # Once draining, always: a replica that drains never takes work again.
            self._draining = self._draining or outputs.load.draining
            self._load_seen.set()
            if not outputs.load.alive:
                self._die(f"its core is dead: {outputs.load.reason}")
                return False
        if outputs.engine_dead is not None:
            self._die(f"its core died: {outputs.engine_dead}")
            return False
        self._inbox.deliver(outputs)
        return True

    async def _watch_connection(self) -> None:
        while True:
            event = await recv_monitor_message(self._monitor)
            # Connected once the handshake (CURVE's, or the plain one) is through: before
            # that the peer may still turn out not to be this pipeline's stage.
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected.set()
            elif event["event"] in _HANDSHAKE_FAILURES:
                self._die(_HANDSHAKE_FAILURES[event["event"]])
                return
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
