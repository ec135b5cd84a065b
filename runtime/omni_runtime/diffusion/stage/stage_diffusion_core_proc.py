"""StageDiffusionCoreProc: a diffusion engine in its own process, served over ZMQ.

Shaped like vLLM's ``EngineCoreProc``: an input I/O thread decodes requests into a queue,
an output I/O thread encodes outputs off a queue, and the busy loop in the main thread only
runs the engine, one request at a time. Aborts are applied by the input thread as they
arrive, so a running request sees them at its next denoising step.

The process is started by StageDiffusionCoreProcManager as
``python -m omni_runtime.diffusion.stage.stage_diffusion_core_proc ...`` (plain arguments,
no pickled state). It reports READY, or why it could not start, on the handshake socket;
it says why it is going away (``engine_dead``) on the output socket before it exits on a
fatal error; SIGTERM/SIGINT stop it cleanly: what it holds is finished first (a drain: the
stage process above it drains too, and hands back what is still queued), for at most
``OMNI_DRAIN_TIMEOUT_S`` seconds (default 30), after which a running request is aborted at
its next step. It stops by itself, aborting at once, if its parent dies: nobody is left
to read a result.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any, Final, Literal

import msgspec
import zmq

from omni_runtime.diffusion.engine_base import DiffusionEngineConfig
from omni_runtime.diffusion.loader import load_diffusion_engine
from omni_runtime.engine.stage.stage_core_types import (
    StageCoreRequestType,
    StageDiffusionCoreOutput,
    StageDiffusionCoreOutputs,
    StageDiffusionCoreRequest,
    StageUtilityCall,
    StageUtilityOutput,
)
from omni_runtime.engine.stage.stop_watchers import (
    STOP_SIGNALS,
    start_stop_watchers,
    stop_signals_blocked,
)
from omni_runtime.pod_contract import DrainTimeoutError, drain_timeout_from_env
from omni_runtime.process_logging import disable_loading_bars, drop_torchvision_notice
from omni_runtime.wire import Frame, WireDecoder, WireEncoder, WireError

logger = logging.getLogger(__name__)

# How long the last messages (an engine_dead notice above all) may take to leave on exit.
_LINGER_MS = 2000
# Put on the input queue as an adapter's read ends: the busy loop, which may be waiting
# with nothing runnable but requests whose adapters were being read, looks again.
_ADAPTER_READ: Final = "adapter-read"
_InputKind = StageCoreRequestType | Literal["adapter-read"] | None


class StageProcHandshake(msgspec.Struct, gc=False):
    """Sent once by a starting core proc: ready (with facts about its engine), or not."""

    pid: int
    ready: bool
    error: str | None = None
    info: dict[str, Any] = {}


class StageDiffusionCoreProc:
    """Owns the engine, the sockets and the I/O threads of one diffusion core process."""

    def __init__(
        self,
        config: DiffusionEngineConfig,
        *,
        input_address: str,
        output_address: str,
        handshake_address: str,
    ) -> None:
        self._ctx = zmq.Context()
        self._handshake_address = handshake_address
        self.max_batch = config.max_batch
        try:
            self.engine = load_diffusion_engine(config)
        except BaseException as e:
            self._send_handshake(StageProcHandshake(os.getpid(), False, error=_describe(e)))
            self._ctx.term()
            raise
        # (None, None) asks the busy loop to return.
        self._input_queue: queue.Queue[tuple[_InputKind, Any]] = queue.Queue()
        self.engine.notify_adapter_reads(lambda: self._input_queue.put((_ADAPTER_READ, None)))
        self._output_queue: queue.Queue[StageDiffusionCoreOutputs | None] = queue.Queue()

        input_socket = self._ctx.socket(zmq.PULL)
        input_socket.connect(input_address)
        output_socket = self._ctx.socket(zmq.PUSH)
        output_socket.setsockopt(zmq.LINGER, _LINGER_MS)
        output_socket.connect(output_address)
        self._input_thread = threading.Thread(
            target=self._process_input_socket,
            args=(input_socket,),
            daemon=True,
            name="diffusion-core-input",
        )
        self._output_thread = threading.Thread(
            target=self._process_output_socket,
            args=(output_socket,),
            daemon=True,
            name="diffusion-core-output",
        )
        self._input_thread.start()
        self._output_thread.start()
        self._send_handshake(StageProcHandshake(os.getpid(), True, info=self.engine.describe()))

    def run_busy_loop(self) -> None:
        """Serve until request_shutdown().

        Requests run in the order they came, each with those behind it that share its
        batch key (``engine.batch_key``), up to the engine's ``max_batch``: a request that
        comes while a batch runs waits for the next one rather than join it part way, as
        a pipeline call runs its requests' steps together from the first to the last. A
        request whose LoRA adapter is still being read (``engine.adapter_ready``) lets
        those behind it go first, until the read ends.
        """
        waiting: collections.deque[StageDiffusionCoreRequest] = collections.deque()
        stopping = False
        while waiting or not stopping:
            # Whatever has come, without waiting; then, with nothing to run, wait.
            while not stopping:
                runnable = any(self.engine.adapter_ready(request) for request in waiting)
                try:
                    kind, payload = (
                        self._input_queue.get_nowait() if runnable else self._input_queue.get()
                    )
                except queue.Empty:
                    break
                if kind is None:
                    stopping = True
                elif kind is StageCoreRequestType.ADD:
                    waiting.append(payload)
                elif kind is StageCoreRequestType.UTILITY:
                    self._output_queue.put(
                        StageDiffusionCoreOutputs(
                            utility_output=self._run_utility(payload), timestamp=time.time()
                        )
                    )
            if waiting:
                # Stopping, nothing more will come: a request waiting on its adapter's
                # read runs anyway (the engine waits for the read).
                batch = self._next_batch(waiting, any_request=stopping)
                if batch:
                    self._execute(batch)

    def _next_batch(
        self, waiting: collections.deque[StageDiffusionCoreRequest], any_request: bool = False
    ) -> list[StageDiffusionCoreRequest]:
        """The first waiting request that can run now (``any_request``: the first, ready or
        not) and those behind it of its batch key, taken out; none if none can."""
        first = next((r for r in waiting if self.engine.adapter_ready(r)), None)
        if first is None:
            if not any_request:
                return []
            first = waiting[0]
        waiting.remove(first)
        batch = [first]
        key = self.engine.batch_key(first) if self.max_batch > 1 else None
        if key is None:
            return batch
        for request in list(waiting):
            if len(batch) == self.max_batch:
                break
            if self.engine.batch_key(request) == key:
                waiting.remove(request)
                batch.append(request)
        return batch

    def request_shutdown(self) -> None:
        """Make the busy loop return soon; safe from any thread. A running request is
        aborted at its next step, so that stopping never waits for a long generation."""
        self.engine.abort_all()
        self._input_queue.put((None, None))

    def request_drain(self, timeout: float) -> None:
        """Make the busy loop return once what it holds is done; safe from any thread.
        Requests taken before now are finished, for at most ``timeout`` seconds, then
        aborted (each still answered, marked aborted)."""
        self._input_queue.put((None, None))
        timer = threading.Timer(timeout, self.engine.abort_all)
        timer.daemon = True
        timer.start()

    def send_engine_dead(self, reason: str) -> None:
        """Tell the client this core is going away, then let the message leave."""
        self._output_queue.put(StageDiffusionCoreOutputs(engine_dead=reason, timestamp=time.time()))
        self.close()

    def close(self) -> None:
        # Each socket is closed by the thread that uses it (ZMQ sockets are not
        # thread-safe): the output thread after the sentinel, the input thread when term()
        # interrupts its recv.
        self._output_queue.put(None)
        self._output_thread.join(timeout=_LINGER_MS / 1000)
        self._ctx.term()
        self.engine.close()

    def _execute(self, batch: list[StageDiffusionCoreRequest]) -> None:
        for output in self.engine.execute_batch(batch, emit=self._send_output):
            self._send_output(output)

    def _send_output(self, output: StageDiffusionCoreOutput) -> None:
        self._output_queue.put(StageDiffusionCoreOutputs(outputs=[output], timestamp=time.time()))

    def _run_utility(self, call: StageUtilityCall) -> StageUtilityOutput:
        # Only the engine's public methods: collective_rpc is an operator's tool, not a way
        # into the process's internals.
        method = (
            getattr(self.engine, call.method, None) if not call.method.startswith("_") else None
        )
        if not callable(method):
            return StageUtilityOutput(
                call.call_id, failure_message=f"unknown method {call.method!r}"
            )
        try:
            return StageUtilityOutput(call.call_id, result=method(*call.args, **call.kwargs))
        except Exception as e:
            return StageUtilityOutput(call.call_id, failure_message=_describe(e))

    def _process_input_socket(self, socket: zmq.Socket[Any]) -> None:
        decoders = {
            StageCoreRequestType.ADD: WireDecoder(StageDiffusionCoreRequest),
            StageCoreRequestType.ABORT: WireDecoder(list[str]),
            StageCoreRequestType.UTILITY: WireDecoder(StageUtilityCall),
        }
        try:
            while True:
                frames: list[zmq.Frame] = socket.recv_multipart(copy=False)
                try:
                    kind = StageCoreRequestType(frames[0].bytes)
                    payload = decoders[kind].decode(frames[1:])
                except (ValueError, WireError) as e:
                    # A peer speaking another protocol must not take the core down.
                    logger.warning("dropping undecodable message: %s", e)
                    continue
                if kind is StageCoreRequestType.ABORT:
                    # Here, not on the busy loop: a running request sees it at its next step.
                    self.engine.abort(payload)
                    continue
                if kind is StageCoreRequestType.ADD:
                    refusal = self.engine.admit(payload.request_id)
                    if refusal is not None:
                        self._output_queue.put(
                            StageDiffusionCoreOutputs(outputs=[refusal], timestamp=time.time())
                        )
                        continue
                    # Its adapter's read starts now, while the busy loop runs what is ahead.
                    self.engine.adapter_ready(payload)
                self._input_queue.put((kind, payload))
        except zmq.ContextTerminated:
            socket.close(linger=0)

    def _process_output_socket(self, socket: zmq.Socket[Any]) -> None:
        encoder = WireEncoder()
        while (outputs := self._output_queue.get()) is not None:
            frames: list[Frame] = encoder.encode(outputs)
            socket.send_multipart(frames, copy=False)
        socket.close(linger=_LINGER_MS)

    def _send_handshake(self, message: StageProcHandshake) -> None:
        socket = self._ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, _LINGER_MS)
        socket.connect(self._handshake_address)
        socket.send(msgspec.msgpack.encode(message))
        socket.close()


def spawn_stage_core(
    config: DiffusionEngineConfig,
    *,
    input_address: str,
    output_address: str,
    handshake_address: str,
) -> subprocess.Popen[bytes]:
    """Start a core process running this module (see run_stage_core for the signal mask)."""
    command = [
        sys.executable, "-m", __spec__.name if __spec__ else __name__,
        "--config", msgspec.json.encode(config).decode(),
        "--input-address", input_address,
        "--output-address", output_address,
        "--handshake-address", handshake_address,
    ]  # fmt: skip
    with stop_signals_blocked():
        return subprocess.Popen(command, stdin=subprocess.DEVNULL)


def run_stage_core(
    config: DiffusionEngineConfig,
    *,
    input_address: str,
    output_address: str,
    handshake_address: str,
) -> int:
    """The core process's body; returns its exit code.

    SIGTERM/SIGINT, or the death of the parent, stop it (see stop_watchers for why the
    signals are taken by a thread with sigwait); spawn_stage_core starts the process with
    the signals already blocked, so that threads made by imports inherit the mask too.
    """
    serving: list[StageDiffusionCoreProc] = []
    stop_requested = threading.Event()

    try:
        drain_timeout = drain_timeout_from_env(os.environ)
    except DrainTimeoutError as e:
        # The stage process above refuses the same value first; this is for a core
        # started on its own.
        logger.error("diffusion core cannot start: %s", e)
        return 1

    def stop(reason: str) -> None:
        logger.info("diffusion core stopping: %s", reason)
        stop_requested.set()
        if not serving:
            os._exit(0)  # still loading: nothing to hand back, nobody waiting on outputs
        # A stop signal drains; a parent gone leaves nobody to read a result.
        elif reason in {signum.name for signum in STOP_SIGNALS}:
            serving[0].request_drain(drain_timeout)
        else:
            serving[0].request_shutdown()

    start_stop_watchers(stop)
    drop_torchvision_notice()
    disable_loading_bars()
    try:
        proc = StageDiffusionCoreProc(
            config,
            input_address=input_address,
            output_address=output_address,
            handshake_address=handshake_address,
        )
    except Exception:
        logger.exception("diffusion core failed to start")
        return 1
    serving.append(proc)
    if stop_requested.is_set():  # a stop that arrived as loading finished
        proc.request_shutdown()
    try:
        proc.run_busy_loop()
    except BaseException as e:
        logger.exception("diffusion core failed")
        proc.send_engine_dead(f"diffusion core failed: {_describe(e)}")
        return 1
    proc.close()
    return 0


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one diffusion stage core process.")
    parser.add_argument("--config", required=True, help="DiffusionEngineConfig as JSON")
    parser.add_argument("--input-address", required=True)
    parser.add_argument("--output-address", required=True)
    parser.add_argument("--handshake-address", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("OMNI_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s [diffusion-core %(process)d] %(name)s: %(message)s",
    )
    config = msgspec.json.decode(args.config, type=DiffusionEngineConfig)
    return run_stage_core(
        config,
        input_address=args.input_address,
        output_address=args.output_address,
        handshake_address=args.handshake_address,
    )


if __name__ == "__main__":
    sys.exit(main())
