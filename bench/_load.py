"""Helpers shared by the HTTP benchmarks: servers started and stopped for sure, readiness
polling, a closed-loop load generator, percentiles and a markdown table, and what the
processes under test do with the CPUs: the CPU time each spends in a measuring window
(``CpuSampler``, by process role) and where its threads may run (``placement_of``).

Not a benchmark itself; the scripts in bench/ import it (they see this directory first on
sys.path). It also lends them what the tests use from omni_testkit (testkit/): the stage
tests' result helpers (``collect_results``), so that a benchmark reads a stage client's
outputs exactly as the tests do, and the tracing tests' OTLP collector as a sink for
servers that trace (``otlp_sink``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import psutil

from omni_testkit.port_leases import lease_port

TERMINATE_GRACE_S = 15.0
LOG_TAIL_LINES = 40


def free_port() -> int:
    """A loopback port for a server this script starts, leased as the tests lease theirs
    (omni_testkit.port_leases: outside the kernel's ephemeral range, never handed out
    twice)."""
    return lease_port()


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that `finally` blocks stop the servers we started
    (by default SIGTERM ends the interpreter without unwinding anything)."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


class ServerStartError(RuntimeError):
    """A server exited or did not become ready; the message ends with its log's tail."""


class ManagedProcess:
    """A server process in a session of its own, logging to a file.

    Its own session keeps a Ctrl-C at the terminal away from it (this script stops it, in
    order) and gives it a process group we can signal as a whole. Children that start a
    session of their own (serve's stage processes) are found through psutil at stop time
    and ended by pid if the graceful stop left them behind.
    """

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        log_file: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.command = list(command)
        self.log_file = log_file
        with open(log_file, "wb") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise ServerStartError(
                f"{self.name} exited with code {code}; its log ({self.log_file}) ends:\n"
                f"{self.log_tail()}"
            )

    def stop(self) -> None:
        """SIGTERM to the process group (a graceful shutdown stops what it started), then
        SIGKILL to the group if it hangs, and to every descendant still alive, by pid."""
        try:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=TERMINATE_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # Descendants that outlived the leader (an engine core, a stage process in a
        # session of its own) are ended by pid: the group id may be free for reuse by now.
        _gone, alive = psutil.wait_procs(descendants, timeout=TERMINATE_GRACE_S)
        for child in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        psutil.wait_procs(alive, timeout=5)


@contextlib.contextmanager
def running(processes: list[ManagedProcess]) -> Iterator[list[ManagedProcess]]:
    """Stop every process in ``processes`` (appended to inside the block) on the way out,
    the last started first, however the block ends."""
    try:
        yield processes
    finally:
        for process in reversed(processes):
            process.stop()


def wait_http_ok(
    url: str,
    timeout_s: float,
    processes: Sequence[ManagedProcess] = (),
    period_s: float = 0.25,
) -> float:
    """Poll ``url`` until it answers 200; the seconds waited. ServerStartError if one of
    ``processes`` exits first or the deadline passes."""
    start = time.monotonic()
    deadline = start + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while True:
            for process in processes:
                process.check_alive()
            try:
                if client.get(url).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- {p.name} ({p.log_file}):\n{p.log_tail()}" for p in processes
                )
                raise ServerStartError(f"{url} not ready within {timeout_s:.0f} s\n{tails}")
            time.sleep(period_s)


# -- the load generator -----------------------------------------------------------------------


@dataclass
class LoadResult:
    """One closed-loop run at one concurrency."""

    concurrency: int
    window_s: float
    # Latencies (s) of the requests sent inside the measuring window, all run to the end.
    latencies: list[float] = field(default_factory=list)
    # Requests that finished inside the window: what throughput counts.
    completed_in_window: int = 0
    errors: int = 0
    first_error: str | None = None
    # What each successful request reported about itself (e.g. completion tokens).
    tags: list[object] = field(default_factory=list)
    # CPU time of the processes sampled across the window (closed_loop's ``sampler``).
    cpu: CpuWindow | None = None

    @property
    def throughput(self) -> float:
        return self.completed_in_window / self.window_s if self.window_s > 0 else 0.0

    def percentile(self, q: float) -> float:
        return percentile(self.latencies, q)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the closest ranks; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def closed_loop(
    send: Callable[[int], Awaitable[object]],
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    sampler: CpuSampler | None = None,
) -> LoadResult:
    """``concurrency`` workers, each sending its next request as soon as the last returns.

    The first ``warmup_s`` run at the same concurrency without counting, so the window
    starts on a loaded server (batches formed, pools and caches warm). Requests sent inside
    the window are all awaited, also past its end, so slow ones are not left out of the
    percentiles; throughput counts those that finished inside it. ``send(i)`` returns a tag
    kept per success; an exception counts as an error. A ``sampler`` is started at the
    window's start and stopped at its end (``result.cpu``), so its CPU times cover the same
    window as ``completed_in_window``.
    """
    result = LoadResult(concurrency=concurrency, window_s=duration_s)
    loop = asyncio.get_running_loop()
    start = loop.time()
    window_start = start + warmup_s
    window_end = window_start + duration_s
    counter = iter(range(sys.maxsize))
    timers: list[asyncio.TimerHandle] = []
    if sampler is not None:

        def window_ended() -> None:
            result.cpu = sampler.stop()

        timers = [loop.call_at(window_start, sampler.start), loop.call_at(window_end, window_ended)]

    async def worker() -> None:
        while (sent := loop.time()) < window_end:
            index = next(counter)
            try:
                tag = await send(index)
            except Exception as error:  # one failed request must not end the run
                if sent >= window_start:
                    result.errors += 1
                    if result.first_error is None:
                        result.first_error = f"{type(error).__name__}: {error}"
                continue
            done = loop.time()
            if sent >= window_start:
                result.latencies.append(done - sent)
                result.tags.append(tag)
            if window_start <= done <= window_end:
                result.completed_in_window += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    for timer in timers:
        timer.cancel()
    if sampler is not None and result.cpu is None:
        # Every worker ended before the end-of-window timer ran (it is due by now).
        result.cpu = sampler.stop()
    return result


# -- CPU time and placement of the processes under test ----------------------------------------

# What a process is, from its command line (vLLM's processes retitle themselves, so their
# command line is their title): the first match wins.
ROLE_PATTERNS: tuple[tuple[str, str], ...] = (
    ("VLLM::StageLLMCoreProc", "LLM stage core"),
    ("VLLM::EngineCore", "vLLM engine core"),
    ("VLLM::Worker", "vLLM worker"),
    ("vllm.entrypoints.openai.api_server", "vLLM API server"),
    ("stage_diffusion_core_proc", "diffusion core"),
    ("omni_runtime.entrypoints.cli serve", "router (serve)"),
    ("omni_runtime.entrypoints.cli stage", "stage server"),
    ("multiprocessing.resource_tracker", "resource tracker"),
    ("vllm::router", "vllm-router"),  # its title once started
    ("vllm-router", "vllm-router"),
)
THIS_SCRIPT = "this script"
# Front to back, the order tables list roles in.
ROLE_ORDER = (
    "vllm-router",
    "vLLM API server",
    "vLLM engine core",
    "vLLM worker",
    "router (serve)",
    "stage server",
    "LLM stage core",
    "diffusion core",
    "resource tracker",
    THIS_SCRIPT,
)


def role_order(role: str) -> tuple[int, str]:
    """A sort key: ROLE_ORDER's order (a labelled stage server as a stage server), then
    by name."""
    base = "stage server" if role.startswith("stage server") else role
    return (ROLE_ORDER.index(base) if base in ROLE_ORDER else len(ROLE_ORDER), role)


def process_role(proc: psutil.Process, stage_labels: dict[str, str] | None = None) -> str:
    """The role of ``proc`` (ROLE_PATTERNS); a stage server is told apart by its
    ``--stages`` through ``stage_labels`` (``{"0": "LLM stage server"}``)."""
    if proc.pid == os.getpid():
        return THIS_SCRIPT
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return "?"
    joined = " ".join(cmdline)
    for needle, role in ROLE_PATTERNS:
        if needle in joined:
            if role == "stage server" and stage_labels and "--stages" in cmdline:
                index = cmdline.index("--stages") + 1
                if index < len(cmdline):
                    return stage_labels.get(cmdline[index], role)
            return role
    return Path(cmdline[0]).name if cmdline else "?"


def process_tree(root: int | None = None) -> list[psutil.Process]:
    """``root`` (default: this process) and every descendant alive now."""
    try:
        top = psutil.Process(root if root is not None else os.getpid())
        return [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


@dataclass
class CpuWindow:
    """CPU seconds (user + system, all threads) each role's processes spent in a window."""

    seconds: dict[str, float] = field(default_factory=dict)
    # How many processes each role had.
    processes: dict[str, int] = field(default_factory=dict)
    # Processes that ended inside the window: their last CPU times are unknown (left out).
    ended: list[str] = field(default_factory=list)
    wall_s: float = 0.0


class CpuSampler:
    """CPU time of a process tree (this script and all it started, by default) between
    ``start()`` and ``stop()``, by process role.

    Each process's ``cpu_times`` (user + system, every thread's) is read at both ends; a
    process that appears inside the window counts from zero, one that ends inside it is
    named in ``ended`` (a dead process's times cannot be read). Reading ~10 processes
    takes well under a millisecond each end.
    """

    def __init__(
        self,
        root: int | None = None,
        role_of: Callable[[psutil.Process], str] = process_role,
    ) -> None:
        self._root = root
        self._role_of = role_of
        self._before: dict[int, tuple[psutil.Process, float]] = {}
        self._started = math.nan

    def _read(self) -> dict[int, tuple[psutil.Process, float]]:
        readings = {}
        for proc in process_tree(self._root):
            with contextlib.suppress(psutil.Error):
                readings[proc.pid] = (proc, _cpu_seconds(proc))
        return readings

    def start(self) -> None:
        self._started = time.monotonic()
        self._before = self._read()

    def stop(self) -> CpuWindow:
        after = self._read()
        window = CpuWindow(wall_s=time.monotonic() - self._started)
        for pid, (proc, seconds) in after.items():
            earlier = self._before.get(pid)
            # The same pid for another process: started inside the window.
            same = earlier is not None and earlier[0].create_time() == proc.create_time()
            spent = seconds - earlier[1] if same and earlier is not None else seconds
            role = self._role_of(proc)
            window.seconds[role] = window.seconds.get(role, 0.0) + spent
            window.processes[role] = window.processes.get(role, 0) + 1
        for pid, (proc, _) in self._before.items():
            if pid not in after:
                window.ended.append(f"{self._role_of(proc)} (pid {pid})")
        return window


def cpu_list(cpus: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5`` (the form taskset and VLLM_CPU_OMP_THREADS_BIND read)."""
    ordered = sorted(set(cpus))
    runs: list[str] = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        low, high = ordered[start], ordered[end]
        runs.append(str(low) if low == high else f"{low}-{high}")
        start = end + 1
    return ",".join(runs)


def thread_affinities(proc: psutil.Process) -> dict[frozenset[int], int]:
    """The CPUs each thread of ``proc`` may run on: each distinct set, with its threads."""
    counts: dict[frozenset[int], int] = {}
    for thread in proc.threads():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            cpus = frozenset(os.sched_getaffinity(thread.id))
            counts[cpus] = counts.get(cpus, 0) + 1
    return counts


def placement_of(proc: psutil.Process) -> str:
    """Where ``proc``'s threads may run: ``CPU 0 (49 threads)``, or each distinct set."""
    parts = []
    affinities = thread_affinities(proc)
    for cpus, threads in sorted(affinities.items(), key=lambda item: -item[1]):
        label = "CPU" if len(cpus) == 1 else "CPUs"
        parts.append(f"{label} {cpu_list(cpus)} ({threads} thread{'s' if threads > 1 else ''})")
    return ", ".join(parts) or "?"


def pin_threads(proc: psutil.Process, cpus: set[int]) -> None:
    """Bind every thread of ``proc`` to ``cpus`` (threads it makes later inherit the set
    from the thread that makes them). Passes until none is left unbound, since a thread
    can start during a pass."""
    for _ in range(5):
        loose = [
            thread.id
            for thread in proc.threads()
            if _affinity_or_none(thread.id) not in (None, cpus)
        ]
        if not loose:
            return
        for tid in loose:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)
    raise RuntimeError(f"pid {proc.pid}: threads kept escaping the CPU binding {cpu_list(cpus)}")


def _affinity_or_none(tid: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(tid)
    except OSError:
        return None


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


def ratio_cell(value: float, target: float, higher_is_better: bool) -> str:
    """``0.97x ok`` / ``0.90x MISS`` against ``target``."""
    if math.isnan(value):
        return "-"
    met = value >= target if higher_is_better else value <= target
    return f"{value:.2f}x {'ok' if met else 'MISS'}"


async def collect_results(client: Any, request_ids: Any, timeout: float | None = None) -> Any:
    """omni_testkit.stage_outputs.collect_results (see there)."""
    # Imported here, not at the top: it imports torch and vLLM, which the HTTP benchmarks
    # importing this module neither need nor should wait for.
    from omni_testkit.stage_outputs import collect_results as collect

    return await collect(client, request_ids, timeout)


def otlp_sink() -> Any:
    """omni_testkit.otlp_collector.OTLPCollector keeping no spans, only counting them: a
    local OTLP/HTTP endpoint for servers that trace (use it in a ``with``)."""
    # Imported here: OpenTelemetry's protobufs are only for the benchmarks that trace.
    from omni_testkit.otlp_collector import OTLPCollector

    return OTLPCollector(keep=False)
