"""StageDiffusionCoreProcManager: starts a StageDiffusionCoreProc and guarantees its end.

Like vLLM's ``CoreEngineProcManager``: spawn, wait for the proc's handshake (bounded by a
timeout, and cut short if the proc dies first), then watch the process from a monitor
thread. When the proc dies without being asked to, the monitor pushes an ``engine_dead``
message onto the client's output socket, so a client blocked on outputs learns of it at
once, whether or not the proc managed to say so itself. Shutdown is terminate, then kill
after a deadline; a finaliser does the same for a manager that is dropped or left at exit.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
import weakref

import msgspec
import zmq

from omni_runtime.diffusion.engine_base import DiffusionEngineConfig
from omni_runtime.diffusion.stage.stage_diffusion_core_proc import (
    StageProcHandshake,
    spawn_stage_core,
)
from omni_runtime.engine.stage.stage_core_client import StageCoreStartupError
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreOutputs
from omni_runtime.wire import WireEncoder

logger = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT = 120.0
_TERMINATE_GRACE = 5.0


class StageDiffusionCoreProcManager:
    """Owns one diffusion core process: its start, its liveness, and its end."""

    def __init__(
        self,
        config: DiffusionEngineConfig,
        *,
        input_address: str,
        output_address: str,
        handshake_address: str,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    ) -> None:
        self._output_address = output_address
        ctx = zmq.Context()
        handshake = ctx.socket(zmq.PULL)
        handshake.bind(handshake_address)
        self._proc = spawn_stage_core(
            config,
            input_address=input_address,
            output_address=output_address,
            handshake_address=handshake_address,
        )
        self._shutting_down = threading.Event()
        self._monitor: threading.Thread | None = None
        self._finalizer = weakref.finalize(self, _stop_process, self._proc)
        self._pidfd = os.pidfd_open(self._proc.pid)
        try:
            self.info = self._wait_for_ready(handshake, startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        finally:
            handshake.close(linger=0)
            ctx.term()
        self._monitor = threading.Thread(
            target=self._monitor_proc, daemon=True, name="diffusion-core-monitor"
        )
        self._monitor.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def exit_code(self) -> int | None:
        """None while the proc runs; its exit code (negative: killed by that signal) after."""
        return self._proc.poll()

    def shutdown(self, timeout: float = _TERMINATE_GRACE) -> None:
        """Stop the proc (terminate, then kill after ``timeout``) and wait for it. Idempotent."""
        self._shutting_down.set()
        # Ending the proc is also what wakes the monitor, which then sees the flag.
        _stop_process(self._proc, timeout)
        if self._monitor is not None:
            self._monitor.join()
        self._finalizer()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def _wait_for_ready(self, handshake: zmq.Socket[bytes], timeout: float) -> dict[str, object]:
        poller = zmq.Poller()
        poller.register(handshake, zmq.POLLIN)
        poller.register(self._pidfd, zmq.POLLIN)  # readable once the proc has exited
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(int(remaining * 1000) + 1))
            if handshake in events:
                message = msgspec.msgpack.decode(handshake.recv(), type=StageProcHandshake)
                if not message.ready:
                    raise StageCoreStartupError(
                        f"diffusion core (pid {self._proc.pid}) failed to start: {message.error}"
                    )
                return message.info
            if self._pidfd in events:
                raise StageCoreStartupError(
                    f"diffusion core (pid {self._proc.pid}) exited during startup with "
                    f"{_describe_exit(self._proc.wait())}"
                )
        raise StageCoreStartupError(
            f"diffusion core (pid {self._proc.pid}) not ready within {timeout:.0f} s"
        )

    def _monitor_proc(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pidfd, zmq.POLLIN)
        poller.poll()  # returns once the proc has exited, for whatever reason
        if self._shutting_down.is_set():
            return
        reason = (
            f"diffusion core (pid {self._proc.pid}) died unexpectedly with "
            f"{_describe_exit(self._proc.wait())}"
        )
        logger.error(reason)
        ctx = zmq.Context()
        notify = ctx.socket(zmq.PUSH)
        notify.connect(self._output_address)
        frames = WireEncoder().encode(
            StageDiffusionCoreOutputs(engine_dead=reason, timestamp=time.time())
        )
        notify.send_multipart(frames)
        notify.close(linger=1000)
        ctx.term()


def _stop_process(proc: subprocess.Popen[bytes], timeout: float = _TERMINATE_GRACE) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("diffusion core (pid %d) ignored SIGTERM; killing it", proc.pid)
            proc.kill()
            proc.wait()


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
