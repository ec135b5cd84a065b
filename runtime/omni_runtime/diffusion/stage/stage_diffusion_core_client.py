"""StageDiffusionCoreClient: reaches a diffusion engine running in a StageDiffusionCoreProc.

The client binds the two sockets the proc connects to (requests out on a PUSH socket,
outputs in on a PULL socket; ipc endpoints in a private directory), starts the proc through
StageDiffusionCoreProcManager, and runs one background task that reads outputs: request
outputs go to a queue for get_outputs_async, utility answers to the waiting
collective_rpc_async call, and an ``engine_dead`` notice (from the proc, or from the
manager when the proc died silently) fails everything outstanding with its reason.
An instance belongs to the event loop it is first used in.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import weakref
from typing import Any

import zmq
import zmq.asyncio

from omni_runtime.diffusion.engine import DiffusionEngineConfig
from omni_runtime.diffusion.stage.stage_diffusion_core_proc_manager import (
    DEFAULT_STARTUP_TIMEOUT,
    StageDiffusionCoreProcManager,
)
from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase, StageCoreDeadError
from omni_runtime.engine.stage.stage_core_types import (
    StageCoreRequest,
    StageCoreRequestType,
    StageDiffusionCoreOutputs,
    StageDiffusionCoreRequest,
    StageUtilityCall,
)
from omni_runtime.engine.stage.stage_outputs_inbox import StageOutputsInbox
from omni_runtime.wire import WireDecoder, WireEncoder, WireError

logger = logging.getLogger(__name__)


class StageDiffusionCoreClient(StageCoreClientBase):
    """The client of one out-of-process diffusion core."""

    def __init__(
        self, config: DiffusionEngineConfig, *, startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    ) -> None:
        self._ipc_dir = tempfile.mkdtemp(prefix="omni-diffusion-")
        self._ctx = zmq.asyncio.Context()
        self._finalizer = weakref.finalize(self, _release, self._ctx, self._ipc_dir)
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(f"ipc://{self._ipc_dir}/input")
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(f"ipc://{self._ipc_dir}/output")
        self._encoder = WireEncoder()
        self._decoder = WireDecoder(StageDiffusionCoreOutputs)
        self._inbox = StageOutputsInbox[StageDiffusionCoreOutputs](lambda reason: reason)
        self._output_task: asyncio.Task[None] | None = None
        self._dead_reason: str | None = None
        try:
            self.proc_manager = StageDiffusionCoreProcManager(
                config,
                input_address=f"ipc://{self._ipc_dir}/input",
                output_address=f"ipc://{self._ipc_dir}/output",
                handshake_address=f"ipc://{self._ipc_dir}/handshake",
                startup_timeout=startup_timeout,
            )
        except BaseException:
            self._finalizer()
            raise
        self.info = self.proc_manager.info

    async def add_request_async(self, request: StageCoreRequest) -> None:
        if not isinstance(request, StageDiffusionCoreRequest):
            raise TypeError(
                f"a diffusion stage takes StageDiffusionCoreRequest, not {type(request).__name__}"
            )
        await self._send(StageCoreRequestType.ADD, request)

    async def get_outputs_async(self) -> StageDiffusionCoreOutputs:
        self._ensure_output_task()
        return await self._inbox.get(self.check_health)

    def get_outputs_nowait(self) -> StageDiffusionCoreOutputs | None:
        self._ensure_output_task()
        return self._inbox.get_nowait(self.check_health)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(StageCoreRequestType.ABORT, list(request_ids))

    async def collective_rpc_async(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self._ensure_output_task()

        async def send(call_id: int) -> None:
            call = StageUtilityCall(call_id, method, list(args), dict(kwargs or {}))
            await self._send(StageCoreRequestType.UTILITY, call)

        return await self._inbox.call(send, timeout)

    def check_health(self) -> None:
        if self._dead_reason is None and self.proc_manager.exit_code() is not None:
            self._dead_reason = f"diffusion core exited with code {self.proc_manager.exit_code()}"
        if self._dead_reason is not None:
            raise StageCoreDeadError(self._dead_reason)

    def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
            self._output_task = None
        manager = getattr(self, "proc_manager", None)
        if manager is not None:
            manager.shutdown()
        self._finalizer()

    async def _send(self, kind: StageCoreRequestType, payload: Any) -> None:
        self.check_health()
        await self._input.send_multipart([kind.value, *self._encoder.encode(payload)], copy=False)

    def _ensure_output_task(self) -> None:
        if self._output_task is None:
            self._output_task = asyncio.get_running_loop().create_task(
                self._process_output_socket(), name="diffusion-client-outputs"
            )

    async def _process_output_socket(self) -> None:
        while True:
            frames = await self._output.recv_multipart(copy=False)
            try:
                outputs: StageDiffusionCoreOutputs = self._decoder.decode(frames)
            except WireError as e:
                # Only our core and manager connect here; a message we cannot read is a
                # bug to report, not a reason to stop reading the ones after it.
                logger.error("dropping undecodable output message: %s", e)
                continue
            self._inbox.deliver(outputs)
            if outputs.engine_dead is not None:
                self._dead_reason = outputs.engine_dead
                return


def _release(ctx: zmq.asyncio.Context, ipc_dir: str) -> None:
    ctx.destroy(linger=0)
    shutil.rmtree(ipc_dir, ignore_errors=True)
