"""``omni-runtime serve``: a whole pipeline on this machine, no cluster.

Every replica of every stage runs as its own ``omni-runtime stage`` process (the same
command a stage pod runs) on an ephemeral loopback port, each seeing only the GPUs its
stage's ``devices`` names; the router runs in this process and serves the OpenAI API.
The router's port is claimed before any stage starts: a port in use is reported at once,
not after the models load, and no stage process can take it while they do (port 0 picks
a free one; the "serving" line says which).
Ctrl-C (or SIGTERM) stops the router, then every stage process (terminate, then kill), and
removes what they left in /dev/shm; stage processes also stop by themselves if this process
dies. Stage logs go to files, so the terminal shows what a user needs; a stage that fails
to start has its log's tail printed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from omni_runtime import tracing
from omni_runtime.config import PipelineConfig, StageConfig, dump_pipeline
from omni_runtime.config.credentials import KEYS_DIR_ENV
from omni_runtime.entrypoints.router_process import build_router, router_server_config
from omni_runtime.router.auth import ApiKeys
from omni_runtime.router.limits import RouterLimits
from omni_runtime.stage_keys import generate_keys, load_client_keys

logger = logging.getLogger("omni_runtime.serve")

_TERMINATE_GRACE = 10.0
_LOG_TAIL_LINES = 30


class ServeError(RuntimeError):
    """The pipeline could not be served; the message says what failed."""


@dataclass
class _Replica:
    stage: StageConfig
    index: int
    proc: subprocess.Popen[bytes]
    ready_file: Path
    log_file: Path

    @property
    def label(self) -> str:
        return f"stage {self.stage.stage_id} ({self.stage.name}) replica {self.index}"

    def log_tail(self) -> str:
        try:
            lines = self.log_file.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-_LOG_TAIL_LINES:])


def stage_environment(stage: StageConfig, base: dict[str, str]) -> dict[str, str]:
    """The environment of a stage process: it sees only the GPUs of its ``devices``, finds
    Mooncake's system libraries where scripts/mooncake_libs.sh put them, and exports its
    spans (where this process does) under a service name of its own."""
    from omni_runtime.connectors.mooncake import with_mooncake_library_path

    env = with_mooncake_library_path(dict(base))
    env["CUDA_VISIBLE_DEVICES"] = "" if stage.devices == "cpu" else stage.devices
    env.update(tracing.child_service_environment(base, stage.name))
    return env


def run_serve(
    pipeline: PipelineConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    startup_timeout: float = 600.0,
    limits: RouterLimits | None = None,
    log_dir: Path | None = None,
    on_ready: Callable[[str], None] | None = None,
    api_keys: ApiKeys | None = None,
    state_dir: Path | None = None,
) -> int:
    """Serve ``pipeline`` until interrupted; the exit code. A video pipeline's jobs live
    in ``state_dir`` (None: the router's default) unless its router names a Redis."""
    from omni_runtime.connectors.shared_memory import sweep_orphaned_segments

    # The router runs in this process; each stage process sets up its own.
    tracing.configure(tracing.ROUTER_SERVICE_NAME)
    sweep_orphaned_segments()
    workdir = Path(tempfile.mkdtemp(prefix="omni-serve-"))
    logs = log_dir or workdir
    logs.mkdir(parents=True, exist_ok=True)
    config_file = workdir / "pipeline.json"
    config_file.write_text(json.dumps(dump_pipeline(pipeline)))
    # Ephemeral stage keys: the stages admit this router alone, not whatever else runs here.
    keys_dir = generate_keys(workdir / "stage-keys")
    replicas: list[_Replica] = []
    failed = False
    listener: socket.socket | None = None
    try:
        listener = _claim_port(host, port)
        port = int(listener.getsockname()[1])
        for stage in sorted(pipeline.stages, key=lambda s: s.stage_id):
            for index in range(stage.replicas):
                replicas.append(_start_replica(stage, index, config_file, workdir, logs, keys_dir))
        print(
            f"starting {len(replicas)} stage process(es); logs in {logs}",
            flush=True,
        )
        addresses = _wait_ready(replicas, startup_timeout)
        app, _ = build_router(
            pipeline,
            addresses,
            limits=limits,
            stage_keys=load_client_keys(keys_dir),
            api_keys=api_keys,
            state_dir=state_dir,
        )
        url = f"http://{host}:{port}/v1"
        name = app.state.router.served_model_name
        server = _AnnouncingServer(
            router_server_config(app, host, port),
            f"serving {url} (model {name!r}); Ctrl-C stops everything",
            (lambda: on_ready(url)) if on_ready is not None else None,
        )
        server.run(sockets=[listener])
        return 0
    except ServeError as e:
        failed = True
        print(f"omni-runtime serve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if listener is not None:
            listener.close()
        _stop(replicas)
        sweep_orphaned_segments()
        if failed and log_dir is None:
            print(f"stage logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _claim_port(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` for the router; ServeError naming the address
    if it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn binds its own: a restart need not wait out the old connections' TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = " (choose another with --port, or 0 for any free one)" if port else ""
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    sock.set_inheritable(False)
    return sock


def _start_replica(
    stage: StageConfig, index: int, config_file: Path, workdir: Path, logs: Path, keys_dir: Path
) -> _Replica:
    ready_file = workdir / f"stage-{stage.stage_id}-{index}.ready"
    log_file = logs / f"stage-{stage.stage_id}-{stage.name}-{index}.log"
    command = [
        sys.executable, "-m", "omni_runtime.entrypoints.cli", "stage",
        "-f", str(config_file),
        "--stages", str(stage.stage_id),
        "--host", "127.0.0.1",
        "--port", f"{stage.stage_id}=0",
        "--health-port", "none",
        "--ready-file", str(ready_file),
        "--exit-with-parent",
    ]  # fmt: skip
    with open(log_file, "wb") as log:
        # A session of its own: a Ctrl-C at the terminal reaches serve alone, which stops
        # the stages in order (they also stop by themselves if serve dies).
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**stage_environment(stage, dict(os.environ)), KEYS_DIR_ENV: str(keys_dir)},
            start_new_session=True,
        )
    return _Replica(stage, index, proc, ready_file, log_file)


def _wait_ready(replicas: list[_Replica], timeout: float) -> dict[int, list[str]]:
    deadline = time.monotonic() + timeout
    addresses: dict[int, list[str]] = {}
    waiting = list(replicas)
    start = time.monotonic()
    while waiting:
        for replica in list(waiting):
            code = replica.proc.poll()
            if code is not None:
                raise ServeError(
                    f"{replica.label} exited with code {code} while starting; "
                    f"its log ({replica.log_file}) ends:\n{replica.log_tail()}"
                )
            if replica.ready_file.exists():
                ports = json.loads(replica.ready_file.read_text())["stages"]
                port = ports[str(replica.stage.stage_id)]
                addresses.setdefault(replica.stage.stage_id, []).append(f"127.0.0.1:{port}")
                waiting.remove(replica)
                print(
                    f"  {replica.label} ready on 127.0.0.1:{port} "
                    f"({time.monotonic() - start:.0f} s)",
                    flush=True,
                )
        if waiting and time.monotonic() > deadline:
            names = ", ".join(r.label for r in waiting)
            raise ServeError(f"not ready within {timeout:.0f} s: {names}")
        if waiting:
            time.sleep(0.2)
    return addresses


class _AnnouncingServer(uvicorn.Server):
    """uvicorn's server, saying where it serves once it listens."""

    def __init__(
        self, config: uvicorn.Config, message: str, on_ready: Callable[[], None] | None
    ) -> None:
        super().__init__(config)
        self._message = message
        self._on_ready = on_ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self._message, flush=True)
            if self._on_ready is not None:
                self._on_ready()


def _stop(replicas: list[_Replica]) -> None:
    for replica in replicas:
        if replica.proc.poll() is None:
            replica.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _TERMINATE_GRACE
    for replica in replicas:
        try:
            replica.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            replica.proc.kill()
            replica.proc.wait()
