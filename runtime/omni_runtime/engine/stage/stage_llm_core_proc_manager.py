"""StageLLMCoreProcManager: starts the StageLLMCoreProcs of one LLM stage and ends them.

vLLM's ``CoreEngineProcManager`` with the process target replaced (its ``__init__``
hard-codes vLLM's engine-core entry) and the seed's renames: one proc per local data
parallel rank (``local_proc_count``), numbered from 0. Liveness (``monitor_engine_liveness``,
``finished_procs``, ``sentinels``) and shutdown (terminate, then kill after a deadline; a
finaliser does the same for a manager that is dropped) are vLLM's.

``launch_stage_llm_cores`` does the rest of what vLLM's ``launch_core_engines`` does for a
local stage: the DP coordinator when there is more than one rank, the handshake (vLLM's),
and a deadline on startup. What it returns is what a stage client adopts.
"""

from __future__ import annotations

import multiprocessing.connection
import signal
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
from vllm.config import VllmConfig
from vllm.platforms import current_platform
from vllm.utils import numa_utils
from vllm.utils.network_utils import get_open_zmq_ipc_path, zmq_socket_ctx
from vllm.utils.ompmultiprocessing import OMPProcessManager
from vllm.utils.system_utils import get_mp_context
from vllm.v1.engine.coordinator import DPCoordinator
from vllm.v1.engine.utils import (
    CoreEngine,
    CoreEngineLaunch,
    CoreEngineProcManager,
    EngineZmqAddresses,
    set_assigned_physical_gpu_ids_for_dp_rank,
    wait_for_engine_startup,
)
from vllm.v1.executor import Executor
from vllm.v1.utils import shutdown

from omni_runtime.engine.stage.stage_core_client import StageCoreStartupError
from omni_runtime.engine.stage.stage_llm_core_proc import StageLLMCoreProc
from omni_runtime.engine.stage.stop_watchers import stop_signals_blocked

DEFAULT_STARTUP_TIMEOUT = 300.0
# A core that says it is going (a failed startup, a stop) exits right after: how long to
# wait for that exit, so that errors can name its exit code rather than "running".
ANNOUNCED_EXIT_WAIT_S = 10.0
# How long a core SIGKILLed by vLLM's shutdown may take to be gone, to be reaped.
_KILLED_REAP_S = 5.0
# How long an exit status may take to show once the process has closed its files.
_EXIT_SETTLE_S = 1.0
_EXIT_POLL_S = 0.005


class StageLLMCoreProcManager(CoreEngineProcManager):  # type: ignore[misc]
    """Owns the core processes of one LLM stage: their start, liveness and end."""

    def __init__(
        self,
        local_proc_count: int,
        vllm_config: VllmConfig,
        local_client: bool,
        handshake_address: str,
        executor_class: type[Executor],
        log_stats: bool,
        client_handshake_address: str | None = None,
        tensor_queue: Any = None,
        *,
        connectors: Mapping[str, Any] | None = None,
    ) -> None:
        """vLLM's arguments, and the pipeline's ``connectors`` (name -> their JSON form),
        through which the cores fetch their requests' inputs."""
        # The attributes vLLM's shutdown, monitor and finished_procs read.
        self._request_shutdown_timeout = vllm_config.shutdown_timeout
        self.manager_stopped = threading.Event()
        self.failed_proc_name: str | None = None
        parallel_config = vllm_config.parallel_config
        data_parallel = parallel_config.data_parallel_size > 1
        common_kwargs = {
            "vllm_config": vllm_config,
            "local_client": local_client,
            "handshake_address": handshake_address,
            "executor_class": executor_class,
            "log_stats": log_stats,
            "client_handshake_address": client_handshake_address,
            "tensor_queue": tensor_queue,
            "connectors": dict(connectors or {}),
        }
        context = get_mp_context()
        # A pipe per core, on which it says why it failed: the errors quote it.
        pipes = [context.Pipe(duplex=False) for _ in range(local_proc_count)]
        self._failure_readers = [reader for reader, _ in pipes]
        self._failures: dict[int, str] = {}
        self.processes = [
            context.Process(
                target=StageLLMCoreProc.run_stage_core,
                name=f"StageLLMCoreProc_DP{rank}" if data_parallel else "StageLLMCoreProc",
                kwargs=common_kwargs | {"dp_rank": rank, "failure_pipe": writer},
            )
            for rank, (_, writer) in enumerate(pipes)
        ]
        self._finalizer = weakref.finalize(self, shutdown, self.processes)
        # The --device-ids a user gave, before each rank's share overwrites it (the config
        # object is shared; spawn pickles it at start(), one rank at a time).
        user_device_ids = parallel_config.assigned_physical_gpu_ids
        # The first process this process starts also starts multiprocessing's resource
        # tracker, which unblocks SIGINT/SIGTERM in the starting thread on its way: a core
        # started next would begin with them unblocked (see stop_watchers).
        resource_tracker.ensure_running()
        # On a CPU, vLLM pins its workers' OpenMP threads and keeps CPUs free for the
        # processes around them (VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU).
        # A stage core runs its worker in its own process, so it is pinned as vLLM pins a
        # worker; unpinned, its spinning OpenMP threads take every CPU from the stage
        # server and the router, which then answer late.
        omp = OMPProcessManager(vllm_config)
        try:
            for rank, proc in enumerate(self.processes):
                # As vLLM does: platforms that cannot select a device per process are
                # given each rank's devices through the config.
                if data_parallel and not (
                    current_platform.is_cuda_alike() or current_platform.is_xpu()
                ):
                    set_assigned_physical_gpu_ids_for_dp_rank(vllm_config, rank, user_device_ids)
                with (
                    numa_utils.configure_subprocess(
                        vllm_config, local_rank=0, dp_local_rank=rank, process_kind="EngineCore"
                    ),
                    omp.configure_omp_envs(rank=0, local_rank=0),
                    stop_signals_blocked(),
                ):
                    proc.start()
                # The core has its end now; with this one closed, only the core holds it.
                pipes[rank][1].close()
        finally:
            if self.finished_procs():
                self.shutdown()

    def shutdown(self, timeout: float | None = None) -> None:
        """vLLM's shutdown (terminate, then SIGKILL past the grace), then each proc reaped:
        vLLM's returns right after the SIGKILL, and a core killed so (one still starting,
        with its stop signals blocked, past a startup deadline on a loaded machine) stayed
        a zombie child. Safe to call again, and from two threads (the startup deadline's
        and the caller's): vLLM's part runs once, and joining a reaped proc returns."""
        super().shutdown(timeout)
        for proc in self.processes:
            if proc.pid is not None:
                # join returns once the sentinel fires, which an exiting core's closed
                # files do before its status exists: then it still looks alive, and a
                # status left uncollected here is lost to whoever reaps the pid next.
                proc.join(_KILLED_REAP_S)
                _settle_exit_code(proc)

    def wait_for_first_exit(self, timeout: float = ANNOUNCED_EXIT_WAIT_S) -> None:
        """Wait up to ``timeout`` seconds for any proc to end by itself."""
        ended = multiprocessing.connection.wait([p.sentinel for p in self.processes], timeout)
        for proc in self.processes:
            if proc.sentinel in ended:
                _settle_exit_code(proc)

    def describe_exit(self) -> str:
        """How the procs ended (or that they run), for error messages."""
        states = []
        for rank, proc in enumerate(self.processes):
            code = proc.exitcode
            if code is None:
                state = "running"
            elif code < 0:
                state = f"killed by signal {signal.Signals(-code).name}"
            else:
                state = f"exited with exit code {code}"
            if code is not None and (failure := self._failure(rank)) is not None:
                state += f" ({failure})"
            states.append(f"{proc.name} (pid {proc.pid}) {state}")
        return "; ".join(states)

    def _failure(self, rank: int) -> str | None:
        """What core ``rank`` said of its failure, if it said anything."""
        if rank not in self._failures:
            reader = self._failure_readers[rank]
            try:
                if reader.poll():
                    self._failures[rank] = reader.recv_bytes().decode(errors="replace")
            except (EOFError, OSError):
                pass  # it ended without a word
        return self._failures.get(rank)


def _settle_exit_code(proc: BaseProcess) -> None:
    """Wait (briefly) until an ended proc's ``exitcode`` shows.

    It can say None a while after the end, which is how a dead core came to be reported
    "running": the sentinel fires as the process closes its files, before its exit status
    exists, and vLLM's liveness monitor may be collecting that status in its own thread
    (then ours finds nothing to collect until the monitor has stored it). Neither lasts
    long: poll until it shows.
    """
    deadline = time.monotonic() + _EXIT_SETTLE_S
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(_EXIT_POLL_S)


@dataclass
class StageLLMCoreLaunch:
    """Started, ready stage cores: what a client connects to and then owns."""

    client_addresses: dict[str, str]
    proc_manager: StageLLMCoreProcManager
    coordinator: DPCoordinator | None


def launch_stage_llm_cores(
    vllm_config: VllmConfig,
    executor_class: type[Executor],
    log_stats: bool = False,
    *,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    connectors: Mapping[str, Any] | None = None,
) -> StageLLMCoreLaunch:
    """Start one core per data parallel rank (and the coordinator) and wait until ready;
    ``connectors``: the pipeline's (name -> their JSON form), for the cores' inputs.

    Raises StageCoreStartupError, with nothing left running, when a core fails, dies or is
    not ready within ``startup_timeout`` seconds.
    """
    parallel_config = vllm_config.parallel_config
    proc_count = parallel_config.data_parallel_size
    coordinator = (
        DPCoordinator(
            parallel_config,
            enable_wave_coordination=False,
            logging_config=vllm_config.logging_config,
        )
        if vllm_config.needs_dp_coordinator
        else None
    )
    # The client binds these after the cores connect: ZMQ queues what a core sends meanwhile.
    addresses = EngineZmqAddresses(
        inputs=[get_open_zmq_ipc_path()], outputs=[get_open_zmq_ipc_path()]
    )
    client_addresses = {
        "input_address": addresses.inputs[0],
        "output_address": addresses.outputs[0],
    }
    if coordinator is not None:
        addresses.coordinator_input, addresses.coordinator_output = (
            coordinator.get_engine_socket_addresses()
        )
        addresses.frontend_stats_publish_address = coordinator.get_stats_publish_address()
        client_addresses["stats_update_address"] = addresses.frontend_stats_publish_address
    handshake_address = get_open_zmq_ipc_path()
    proc_manager: StageLLMCoreProcManager | None = None
    expired = threading.Event()
    deadline: threading.Timer | None = None
    try:
        with zmq_socket_ctx(handshake_address, zmq.ROUTER, bind=True) as handshake_socket:
            proc_manager = StageLLMCoreProcManager(
                local_proc_count=proc_count,
                vllm_config=vllm_config,
                local_client=True,
                handshake_address=handshake_address,
                executor_class=executor_class,
                log_stats=log_stats,
                connectors=connectors,
            )

            def expire(manager: StageLLMCoreProcManager = proc_manager) -> None:
                expired.set()
                manager.shutdown()

            # vLLM's handshake wait has no deadline of its own; ending the procs ends it.
            deadline = threading.Timer(startup_timeout, expire)
            deadline.daemon = True
            deadline.start()
            wait_for_engine_startup(
                handshake_socket,
                [CoreEngine(index=rank) for rank in range(proc_count)],
                parallel_config,
                False,
                vllm_config.cache_config,
                CoreEngineLaunch(proc_manager, coordinator, addresses, None),
            )
            deadline.cancel()
    except BaseException as e:
        if deadline is not None:
            deadline.cancel()
        if proc_manager is not None and isinstance(e, Exception) and not expired.is_set():
            proc_manager.wait_for_first_exit()
        if deadline is not None and expired.is_set():
            # The deadline's stop, waited for here: the cores it ended are reaped, so the
            # error says how (SIGTERM, or SIGKILL past the grace), not "running". Joined,
            # not repeated: vLLM's shutdown runs once, and a second call returns while the
            # first still waits out its grace.
            deadline.join()
        exits = proc_manager.describe_exit() if proc_manager is not None else "not started"
        if proc_manager is not None:
            proc_manager.shutdown()
        if coordinator is not None:
            coordinator.shutdown()
        if not isinstance(e, Exception):
            raise
        reason = f"not ready within {startup_timeout:.0f} s" if expired.is_set() else "failed"
        raise StageCoreStartupError(f"LLM stage core {reason} during startup: {exits}") from e
    assert proc_manager is not None
    return StageLLMCoreLaunch(client_addresses, proc_manager, coordinator)
