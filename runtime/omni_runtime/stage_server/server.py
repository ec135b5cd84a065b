"""StageServer: one stage replica served on a TCP port, for any number of routers.

A ZMQ ROUTER socket: each router's RemoteStageClient is a DEALER peer. Messages are the
stage wire format (``omni_runtime.wire``: msgspec, arrays as raw frames, never pickle)
behind a one-byte type frame: ADD (a StageServerRequest), ABORT (request ids), UTILITY (a
collective_rpc call, or one the frontend answers itself: an LLM stage's tokenize and
detokenize), HEALTH (answered with a StageLoad). Outputs go back to the peer that
added the request. Input never takes the server down: a malformed message, an unknown
type or a request the stage refuses is answered with an error output.

Routers ping every second or so; a peer silent for ``peer_timeout`` seconds is gone (its
process died, or the network did), and its requests are aborted so that they stop
occupying the stage. When the stage's core dies, every peer is told (``engine_dead``),
every request in flight fails, and :meth:`serve` returns the reason.

Draining (:meth:`drain`, what a stage process does on SIGTERM): every peer is told at once
(a StageLoad with ``draining``), so routers stop sending new work without waiting for
Kubernetes to take the pod out of its Service; a request that arrives anyway, and one the
frontend holds but has not started (``StageFrontend.unstarted``), is handed back with
``StageErrorCode.DRAINING``, which a router retries on another replica; the requests in
execution finish here. Each HEALTH answer carries the replica's pipeline ``revision``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from typing import Any

import zmq
import zmq.asyncio

from omni_runtime.engine.stage.stage_core_client import (
    StageCoreDeadError,
    request_id_in_flight_error,
)
from omni_runtime.engine.stage.stage_core_types import (
    StageCoreRequestType,
    StageError,
    StageErrorCode,
    StageLoad,
    StageServerOutput,
    StageServerOutputs,
    StageServerRequest,
    StageUtilityCall,
    StageUtilityOutput,
)
from omni_runtime.stage_keys import StageServerKeys, ZapHandler
from omni_runtime.stage_server.frontend import StageFrontend, refusal
from omni_runtime.wire import WireDecoder, WireEncoder, WireError

logger = logging.getLogger(__name__)

DEFAULT_PEER_TIMEOUT = 10.0
# A bound on one incoming message (an input image is the largest thing a router sends).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_SWEEP_INTERVAL = 1.0


class StageServer:
    """Serves one stage's frontend to routers over TCP."""

    def __init__(
        self,
        frontend: StageFrontend,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        peer_timeout: float = DEFAULT_PEER_TIMEOUT,
        revision: str = "",
        keys: StageServerKeys | None = None,
    ) -> None:
        self.frontend = frontend
        self.stage = frontend.stage
        self.peer_timeout = peer_timeout
        self.revision = revision
        self.draining = False
        # Set while draining whenever no request is routed here: the drain is done.
        self._drained = asyncio.Event()
        self._ctx = zmq.asyncio.Context()
        self._zap: ZapHandler | None = None
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._socket.setsockopt(zmq.LINGER, 1000)
        if keys is not None:
            self._zap = ZapHandler(self._ctx, keys.client_public, f"stage {self.stage.name}")
            keys.secure(self._socket)
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._socket.bind_to_random_port(f"tcp://{host}")
        self._encoder = WireEncoder()
        self._decoders = {
            StageCoreRequestType.ADD: WireDecoder(StageServerRequest),
            StageCoreRequestType.ABORT: WireDecoder(list[str]),
            StageCoreRequestType.UTILITY: WireDecoder(StageUtilityCall),
        }
        # request id -> the peer that added it; peer -> when it was last heard from.
        self._routes: dict[str, bytes] = {}
        self._peers: dict[bytes, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.dead_reason: str | None = None

    @property
    def alive(self) -> bool:
        return self.dead_reason is None

    def load(self) -> StageLoad:
        return StageLoad(
            stage_id=self.stage.stage_id,
            name=self.stage.name,
            alive=self.alive,
            in_flight=self.frontend.in_flight,
            reason=self.dead_reason,
            draining=self.draining,
            revision=self.revision,
            adapters=self.frontend.held_adapters,
            max_adapters=self.frontend.adapters.capacity if self.frontend.adapters else 0,
            size_multiple=self.frontend.size_multiple,
        )

    @property
    def held(self) -> int:
        """Requests routed through this server and not yet answered."""
        return len(self._routes)

    async def drain(self, timeout: float) -> bool:
        """Take no new requests, hand back those not started, let the others finish.

        Returns whether everything held finished within ``timeout`` seconds; what is left
        then fails with UNAVAILABLE (the replica could not finish it in its grace period).
        """
        if not self.draining:
            self.draining = True
            await self._broadcast(StageServerOutputs(load=self.load(), timestamp=time.time()))
            await self._hand_back(self.frontend.unstarted())
        self._check_drained()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained.wait(), timeout)
        if not self._routes:
            return True
        left = list(self._routes)
        logger.warning(
            "stage %s: %d request(s) unfinished after the %.0f s drain; failing them",
            self.stage.name,
            len(left),
            timeout,
        )
        error = StageError(
            StageErrorCode.UNAVAILABLE,
            f"stage {self.stage.name!r}: the replica stopped before the request finished "
            f"(drain timeout {timeout:g} s)",
        )
        await self._fail_all(error)
        with contextlib.suppress(StageCoreDeadError):
            await self.frontend.abort(left)
        return False

    async def _hand_back(self, request_ids: list[str]) -> None:
        """Answer ``request_ids`` (held, not started) with DRAINING, and drop them here."""
        by_peer: dict[bytes, list[StageServerOutput]] = defaultdict(list)
        for request_id in request_ids:
            identity = self._routes.pop(request_id, None)
            if identity is not None:
                by_peer[identity].append(refusal(request_id, self._draining_error()))
        if not by_peer:
            return
        handed = [output.request_id for batch in by_peer.values() for output in batch]
        logger.info(
            "stage %s: handing back %d request(s) not started", self.stage.name, len(handed)
        )
        for identity, batch in by_peer.items():
            await self._reply(identity, batch)
        # Their outputs (aborted) find no route and are dropped.
        with contextlib.suppress(StageCoreDeadError):
            await self.frontend.abort(handed)

    def _check_drained(self) -> None:
        if self.draining and not self._routes:
            self._drained.set()

    def _draining_error(self) -> StageError:
        return StageError(
            StageErrorCode.DRAINING,
            f"stage {self.stage.name!r}: this replica is draining and takes no new requests",
        )

    async def serve(self) -> str:
        """Serve until the stage's core dies (returns why) or the task is cancelled."""
        receiving = asyncio.create_task(self._receive_loop(), name=f"{self.stage.name}-recv")
        sweeping = asyncio.create_task(self._sweep_loop(), name=f"{self.stage.name}-sweep")
        if self._zap is not None:
            self._tasks.add(asyncio.create_task(self._zap.run(), name=f"{self.stage.name}-zap"))
        try:
            reason = await self._output_loop()
            # Peers hear why; the ones that ask meanwhile get alive=False.
            await self._broadcast(StageServerOutputs(engine_dead=reason, timestamp=time.time()))
            return reason
        finally:
            for task in (receiving, sweeping, *self._tasks):
                task.cancel()
            await asyncio.gather(receiving, sweeping, *self._tasks, return_exceptions=True)

    def close(self) -> None:
        self._socket.close(linger=0)
        if self._zap is not None:
            self._zap.close()
        self._ctx.term()

    async def _receive_loop(self) -> None:
        while True:
            try:
                frames = await self._socket.recv_multipart(copy=False)
            except zmq.ZMQError as e:  # e.g. a message over MAXMSGSIZE drops the peer
                logger.warning("stage %s: receive failed: %s", self.stage.name, e)
                continue
            identity = frames[0].bytes
            self._peers[identity] = time.monotonic()
            try:
                await self._handle(identity, frames[1:])
            except StageCoreDeadError:
                continue  # the output loop reports it to everyone
            except Exception:  # a bug here must not stop the server answering others
                logger.exception("stage %s: handling a message failed", self.stage.name)

    async def _handle(self, identity: bytes, frames: list[zmq.Frame]) -> None:
        if not frames:
            error = StageError.bad_request("malformed message: no type frame")
            await self._reply(identity, [refusal("", error)])
            return
        try:
            kind = StageCoreRequestType(frames[0].bytes)
        except ValueError:
            known = ", ".join(f"{t.name}={t.value!r}" for t in StageCoreRequestType)
            error = StageError.bad_request(
                f"unknown message type {frames[0].bytes[:8]!r} (known: {known})"
            )
            await self._reply(identity, [refusal("", error)])
            return
        if kind is StageCoreRequestType.HEALTH:
            await self._send(identity, StageServerOutputs(load=self.load(), timestamp=time.time()))
            return
        try:
            payload = self._decoders[kind].decode(frames[1:])
        except WireError as e:
            error = StageError.bad_request(f"malformed {kind.name} message: {e}")
            await self._reply(identity, [refusal("", error)])
            return
        if kind is StageCoreRequestType.ADD:
            self._spawn(self._add(identity, payload))
        elif kind is StageCoreRequestType.ABORT:
            await self.frontend.abort(payload)
        else:
            self._spawn(self._utility(identity, payload))

    async def _add(self, identity: bytes, request: StageServerRequest) -> None:
        request_id = request.request_id
        if not self.alive:
            await self._reply(identity, [refusal(request_id, self._dead_error())])
            return
        if self.draining:
            await self._reply(identity, [refusal(request_id, self._draining_error())])
            return
        # Here, before the frontend: outputs are routed back by id, and the frontends key
        # their per-request state by it, so an id has one owner on this server.
        if request_id in self._routes:
            await self._reply(
                identity, [refusal(request_id, request_id_in_flight_error(request_id))]
            )
            return
        self._routes[request_id] = identity
        try:
            refused = await self.frontend.add(request)
        except StageCoreDeadError:
            self._routes.pop(request_id, None)
            self._check_drained()
            await self._reply(identity, [refusal(request_id, self._dead_error())])
            return
        if refused:
            self._routes.pop(request_id, None)
            self._check_drained()
            await self._reply(identity, refused)

    async def _utility(self, identity: bytes, call: StageUtilityCall) -> None:
        try:
            result: Any
            if call.method in self.frontend.frontend_methods:
                result = await self.frontend.frontend_call(call.method, call.kwargs)
            else:
                result = await self.frontend.client.collective_rpc_async(
                    call.method, args=tuple(call.args), kwargs=call.kwargs
                )
            answer = StageUtilityOutput(call.call_id, result=result)
        except Exception as e:
            answer = StageUtilityOutput(call.call_id, failure_message=f"{type(e).__name__}: {e}")
        try:
            await self._send(identity, StageServerOutputs(utility_output=answer))
        except (TypeError, NotImplementedError) as e:  # a result that cannot be sent
            failed = StageUtilityOutput(call.call_id, failure_message=f"unsendable result: {e}")
            await self._send(identity, StageServerOutputs(utility_output=failed))

    async def _output_loop(self) -> str:
        while True:
            try:
                outputs = await self.frontend.next_outputs()
            except StageCoreDeadError as e:
                self.dead_reason = str(e)
                await self._fail_all(self._dead_error())
                return self.dead_reason
            by_peer: dict[bytes, list[StageServerOutput]] = defaultdict(list)
            for output in outputs:
                identity = self._routes.get(output.request_id)
                if identity is None:
                    continue  # aborted for a peer that went away
                if output.finished:
                    del self._routes[output.request_id]
                by_peer[identity].append(output)
            for identity, batch in by_peer.items():
                await self._reply(identity, batch)
            self._check_drained()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_INTERVAL)
            cutoff = time.monotonic() - self.peer_timeout
            gone = {peer for peer, seen in self._peers.items() if seen < cutoff}
            if not gone:
                continue
            orphaned = [rid for rid, peer in self._routes.items() if peer in gone]
            for peer in gone:
                del self._peers[peer]
            for request_id in orphaned:
                del self._routes[request_id]
            self._check_drained()
            if orphaned:
                logger.warning(
                    "stage %s: aborting %d request(s) of a router silent for %.0f s",
                    self.stage.name,
                    len(orphaned),
                    self.peer_timeout,
                )
                with contextlib.suppress(StageCoreDeadError):
                    await self.frontend.abort(orphaned)

    async def _fail_all(self, error: StageError) -> None:
        by_peer: dict[bytes, list[StageServerOutput]] = defaultdict(list)
        for request_id, identity in self._routes.items():
            by_peer[identity].append(refusal(request_id, error))
        self._routes.clear()
        self._check_drained()
        for identity, batch in by_peer.items():
            await self._reply(identity, batch)

    async def _broadcast(self, outputs: StageServerOutputs) -> None:
        for identity in list(self._peers):
            await self._send(identity, outputs)

    async def _reply(self, identity: bytes, outputs: list[StageServerOutput]) -> None:
        await self._send(identity, StageServerOutputs(outputs=outputs, timestamp=time.time()))

    async def _send(self, identity: bytes, message: StageServerOutputs) -> None:
        frames = self._encoder.encode(message)
        await self._socket.send_multipart([identity, *frames], copy=False)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "stage %s: a request task failed", self.stage.name, exc_info=task.exception()
            )

    def _dead_error(self) -> StageError:
        return StageError(
            StageErrorCode.UNAVAILABLE,
            f"stage {self.stage.name!r} is unavailable: {self.dead_reason or 'its core died'}",
        )
