"""Helpers of the serving suites: stage processes, and routers served over real HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from omni_runtime.config import PipelineConfig
from omni_runtime.connectors.mooncake import with_mooncake_library_path
from omni_runtime.entrypoints.router_process import build_router, router_server_config
from omni_runtime.router.auth import ApiKeys
from omni_runtime.router.limits import RouterLimits
from omni_runtime.router.replicas import ReplicaConnector

CLI = [sys.executable, "-m", "omni_runtime.entrypoints.cli"]


def mooncake_unavailable() -> str | None:
    """Why a child process cannot load Mooncake's engine here (None if it can)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.engine"],
        env=with_mooncake_library_path(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if probe.returncode == 0:
        return None
    return (probe.stderr.strip().splitlines() or ["?"])[-1]


def served_base_url(proc: subprocess.Popen[bytes], log: Path, timeout: float) -> str:
    """The OpenAI base URL that ``omni-runtime serve --port 0`` (``proc``, printing to
    ``log``) announces once it listens; AssertionError with the log if it exits first."""

    def announced() -> str | None:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("serving http://"):
                return line.split()[1]
        return None

    url: str = wait_until(announced, timeout, "omni-runtime serve listening", interval=0.5)
    return url


@contextmanager
def serving(
    config: Path,
    workdir: Path,
    timeout: float = 300,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """``omni-runtime serve -f config --port 0 [args]`` in a child (its log in ``workdir``,
    ``env`` added to its environment) until the block ends; yields its OpenAI base URL."""
    log_path = workdir / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*CLI, "serve", "-f", str(config), "--port", "0", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})},
        )
        try:
            yield served_base_url(proc, log_path, timeout)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def run_vllm_child(script: str, *args: Path, timeout: float = 240) -> None:
    """``script`` (a test module whose ``__main__`` drives vLLM's ``LLM``) in a child with
    ``args``, its engine in that one process; AssertionError with its stderr if it fails."""
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    child = subprocess.run(
        [sys.executable, script, *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-4000:]


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy; AssertionError at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(interval)


@dataclass
class StageProcess:
    stage_id: int
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_stage_processes(
    config_file: Path,
    stage_ids: Sequence[int],
    workdir: Path,
    timeout: float = 240,
    envs: Sequence[Mapping[str, str]] | None = None,
) -> list[StageProcess]:
    """Start one ``omni-runtime stage`` process per id (in parallel), the n-th with
    ``envs[n]`` added to its environment; wait until all serve."""
    started: list[tuple[int, subprocess.Popen[bytes], Path, Path]] = []
    for n, stage_id in enumerate(stage_ids):
        extra = envs[n] if envs is not None else {}
        ready = workdir / f"stage-{stage_id}-{n}-{time.monotonic_ns()}.ready"
        log = workdir / f"stage-{stage_id}-{n}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [
                    *CLI, "stage", "-f", str(config_file),
                    "--stages", str(stage_id),
                    "--host", "127.0.0.1",
                    "--port", f"{stage_id}=0",
                    "--health-port", "none",
                    "--ready-file", str(ready),
                    "--exit-with-parent",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={
                    **with_mooncake_library_path(os.environ),
                    "VLLM_CPU_KVCACHE_SPACE": "1",
                    **extra,
                },
            )  # fmt: skip
        started.append((stage_id, proc, ready, log))
    result: list[StageProcess] = []
    try:
        for stage_id, proc, ready, log in started:

            def is_ready(
                proc: subprocess.Popen[bytes] = proc,
                ready: Path = ready,
                log: Path = log,
                stage_id: int = stage_id,
            ) -> bool:
                if proc.poll() is not None:
                    raise AssertionError(
                        f"stage {stage_id} exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
                    )
                return ready.exists()

            wait_until(is_ready, timeout, f"stage {stage_id} ready", interval=0.2)
            port = json.loads(ready.read_text())["stages"][str(stage_id)]
            result.append(StageProcess(stage_id, proc, port, log))
    except BaseException:
        for _, proc, _, _ in started:
            proc.kill()
            proc.wait()
        raise
    return result


@dataclass
class RunningRouter:
    host: str
    port: int
    app: Any
    replicas: ReplicaConnector
    server: uvicorn.Server

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def connect(self, timeout: float) -> socket.socket:
        """A raw TCP connection to the router, for tests that speak HTTP byte by byte."""
        return socket.create_connection((self.host, self.port), timeout=timeout)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def state(self) -> Any:
        return self.app.state.router


@contextmanager
def running_router(
    pipeline: PipelineConfig,
    addresses: Mapping[int, Sequence[str]],
    *,
    limits: RouterLimits | None = None,
    wait_for_replicas: bool = True,
    api_keys: ApiKeys | None = None,
    state_dir: Path | None = None,
) -> Iterator[RunningRouter]:
    """The router app on a port of its own (bound here and handed to uvicorn, so that
    nothing can take it in between), served by uvicorn in a thread of its own; a video
    pipeline's jobs in ``state_dir``."""
    app, replicas = build_router(
        pipeline, addresses, limits=limits, api_keys=api_keys, state_dir=state_dir
    )
    listener = socket.create_server(("127.0.0.1", 0))
    port = int(listener.getsockname()[1])
    # The server config `omni-runtime router` and `serve` run: its connection deadlines and
    # bound are under test wherever a router is.
    server = uvicorn.Server(router_server_config(app, "127.0.0.1", port))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [listener]}, daemon=True, name=f"router-{port}"
    )
    thread.start()
    try:
        wait_until(lambda: server.started, 30, "router started")
        router = RunningRouter("127.0.0.1", port, app, replicas, server)
        if wait_for_replicas:
            wanted = {stage_id: len(a) for stage_id, a in addresses.items()}
            wait_until(
                lambda: all(
                    router.state.pools[i].live_replica_count >= n for i, n in wanted.items()
                ),
                30,
                f"replicas {dict(addresses)} connected",
            )
        yield router
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        listener.close()


def pipeline_from(data: dict[str, Any]) -> PipelineConfig:
    return PipelineConfig.model_validate(data)
