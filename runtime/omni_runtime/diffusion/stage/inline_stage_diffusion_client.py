"""InlineStageDiffusionClient: the diffusion engine in the caller's own process.

Same contract and same outputs as StageDiffusionCoreClient, without a process or sockets:
for a single-process deployment, or a stage too small to be worth one. Requests run one at
a time in a worker thread, so the event loop stays free while the pipeline computes.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from omni_runtime.diffusion.engine_base import DiffusionEngineConfig
from omni_runtime.diffusion.loader import load_diffusion_engine
from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase, StageCoreDeadError
from omni_runtime.engine.stage.stage_core_types import (
    StageCoreRequest,
    StageDiffusionCoreOutput,
    StageDiffusionCoreOutputs,
    StageDiffusionCoreRequest,
)


class InlineStageDiffusionClient(StageCoreClientBase):
    """A diffusion engine run in-process behind the stage client contract."""

    def __init__(self, config: DiffusionEngineConfig) -> None:
        self.engine = load_diffusion_engine(config)
        self.info = self.engine.describe()
        # Admitted, waiting for the worker (the engine tracks ids and aborts).
        self._pending: deque[StageDiffusionCoreRequest] = deque()
        self._outputs: asyncio.Queue[StageDiffusionCoreOutputs] = asyncio.Queue()
        # The engine runs one call at a time: requests and collective_rpc alike.
        self._engine_lock = asyncio.Lock()
        self._worker: asyncio.Task[None] | None = None
        self._closed = False

    async def add_request_async(self, request: StageCoreRequest) -> None:
        if not isinstance(request, StageDiffusionCoreRequest):
            raise TypeError(
                f"a diffusion stage takes StageDiffusionCoreRequest, not {type(request).__name__}"
            )
        self.check_health()
        refusal = self.engine.admit(request.request_id)
        if refusal is not None:
            self._outputs.put_nowait(
                StageDiffusionCoreOutputs(outputs=[refusal], timestamp=time.time())
            )
            return
        self._pending.append(request)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._run_pending())

    async def get_outputs_async(self) -> StageDiffusionCoreOutputs:
        self.check_health()
        return await self._outputs.get()

    def get_outputs_nowait(self) -> StageDiffusionCoreOutputs | None:
        self.check_health()
        try:
            return self._outputs.get_nowait()
        except asyncio.QueueEmpty:
            return None

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.engine.abort(request_ids)

    async def collective_rpc_async(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        target = getattr(self.engine, method, None) if not method.startswith("_") else None
        if not callable(target):
            raise RuntimeError(f"unknown method {method!r}")
        async with self._engine_lock:
            return await asyncio.wait_for(
                asyncio.to_thread(target, *args, **(kwargs or {})), timeout
            )

    def check_health(self) -> None:
        if self._closed:
            raise StageCoreDeadError("inline diffusion client is shut down")

    def shutdown(self) -> None:
        self._closed = True
        if self._worker is not None:
            self._worker.cancel()
        self.engine.close()

    async def _run_pending(self) -> None:
        loop = asyncio.get_running_loop()

        def send(output: StageDiffusionCoreOutput) -> None:
            # From the engine's thread: the queue is the loop's.
            loop.call_soon_threadsafe(self._send, output)

        while self._pending:
            request = self._pending.popleft()
            async with self._engine_lock:
                output = await asyncio.to_thread(self.engine.execute, request, send)
            self._send(output)

    def _send(self, output: StageDiffusionCoreOutput) -> None:
        self._outputs.put_nowait(StageDiffusionCoreOutputs(outputs=[output], timestamp=time.time()))
