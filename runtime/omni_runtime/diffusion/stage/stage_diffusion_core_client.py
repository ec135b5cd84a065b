"""StageDiffusionCoreClient: reaches a diffusion engine running in a StageDiffusionCoreProc.

The client binds the two sockets the proc connects to (requests out on a PUSH socket,
outputs in on a PULL socket; ipc endpoints in a private directory) and starts the proc
through StageDiffusionCoreProcManager. The rest of the contract (a reader task, the inbox,
death that sticks) is ZmqStageClientBase's; an ``engine_dead`` notice comes from the proc,
or from the manager when the proc died silently.
An instance belongs to the event loop it is first used in.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref

import zmq
import zmq.asyncio

from omni_runtime.diffusion.engine_base import DiffusionEngineConfig
from omni_runtime.diffusion.stage.stage_diffusion_core_proc_manager import (
    DEFAULT_STARTUP_TIMEOUT,
    StageDiffusionCoreProcManager,
)
from omni_runtime.engine.stage.stage_core_types import (
    StageDiffusionCoreOutputs,
    StageDiffusionCoreRequest,
)
from omni_runtime.engine.stage.zmq_stage_client import ZmqStageClientBase


class StageDiffusionCoreClient(ZmqStageClientBase[StageDiffusionCoreOutputs]):
    """The client of one out-of-process diffusion core."""

    request_type = StageDiffusionCoreRequest
    outputs_type = StageDiffusionCoreOutputs

    def __init__(
        self, config: DiffusionEngineConfig, *, startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    ) -> None:
        self._ipc_dir = tempfile.mkdtemp(prefix="omni-diffusion-")
        self._ctx = zmq.asyncio.Context()
        self._finalizer = weakref.finalize(self, _release, self._ctx, self._ipc_dir)
        requests = self._ctx.socket(zmq.PUSH)
        requests.bind(f"ipc://{self._ipc_dir}/input")
        outputs = self._ctx.socket(zmq.PULL)
        outputs.bind(f"ipc://{self._ipc_dir}/output")
        super().__init__(
            requests, outputs, describe_death=lambda reason: reason, name="diffusion-client"
        )
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

    def check_health(self) -> None:
        if self._dead_reason is None and self.proc_manager.exit_code() is not None:
            self._dead_reason = f"diffusion core exited with code {self.proc_manager.exit_code()}"
        super().check_health()

    def shutdown(self) -> None:
        self._stop_tasks()
        manager = getattr(self, "proc_manager", None)
        if manager is not None:
            manager.shutdown()
        self._finalizer()


def _release(ctx: zmq.asyncio.Context, ipc_dir: str) -> None:
    ctx.destroy(linger=0)
    shutil.rmtree(ipc_dir, ignore_errors=True)
