"""Fixtures shared by every suite, and the session's no-orphan-process check."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path

import psutil
import pytest

# vLLM/torch/transformers log noise is not test output.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
# vLLM's CPU workers run single-threaded and unpinned: the tiny models gain nothing from
# threads, and by default each engine pins spinning OpenMP threads to the same cores, so
# that the engines of tests running side by side (pytest-xdist) would take turns at a
# crawl. What users run keeps vLLM's defaults; tests/cluster's pods set the same.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny models (omni_runtime.tiny_models), built once per test session from configs."""
    from omni_runtime.tiny_models import ensure_tiny_models

    return ensure_tiny_models(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="module")
def llm_engine_environment() -> Iterator[None]:
    """What a module that starts LLM stage cores in this process needs (modules use it
    autouse): vLLM's CPU KV cache size (GiB; unset, the CPU build refuses to start), and at
    the end, once every core of the module is gone, multiprocessing's resource tracker
    stopped: started with the first core and alive as long as this process, it is no leak,
    but the session's check for surviving children would take it for one."""
    with pytest.MonkeyPatch.context() as patch:
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        yield
    resource_tracker._resource_tracker._stop()


_SHM = Path("/dev/shm")
_shm_at_start: set[str] = set()


def _omni_segments() -> set[str]:
    try:
        return {name for name in os.listdir(_SHM) if name.startswith("omni-")}
    except OSError:
        return set()


def pytest_sessionstart(session: pytest.Session) -> None:
    _shm_at_start.update(_omni_segments())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Runs after every fixture is torn down: whatever child process or shared-memory
    # segment is still here was leaked by the code under test (or a test). Report it,
    # fail the run, and clean up.
    _check_shared_memory(session)
    # A child that is exiting as the session ends (or has exited, unreaped) is not a
    # survivor: give each a moment, reaping it; only one still running afterwards is.
    _, leftovers = psutil.wait_procs(psutil.Process().children(recursive=True), timeout=5)
    leftovers = [p for p in leftovers if _status(p) != psutil.STATUS_ZOMBIE]
    if not leftovers:
        return
    described = ", ".join(f"pid {p.pid} ({' '.join(_cmdline(p))[:120]})" for p in leftovers)
    session.config.get_terminal_writer().line(
        f"FAILED: child processes survived the test session: {described}", red=True
    )
    for proc in leftovers:
        proc.kill()
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _status(proc: psutil.Process) -> str:
    try:
        return str(proc.status())
    except psutil.Error:
        return psutil.STATUS_DEAD


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return ["?"]


def _made_elsewhere(segment: str) -> bool:
    """Whether the process whose pid the segment's name holds (omni-PID-...) still runs
    and is not this one (which makes segments itself, in the unit tests)."""
    pid = segment.removeprefix("omni-").partition("-")[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        return psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _check_shared_memory(session: pytest.Session) -> None:
    # This session's stage processes have exited by now (a survivor fails the session
    # below), so a segment whose maker still runs elsewhere belongs to another session
    # beside this one (scripts/test.sh runs two): not a leak.
    # One whose maker is gone may still be on its way out (a consumer sweeps it), so the
    # check gives those a moment.
    deadline = time.monotonic() + 5
    while True:
        leaked = sorted(s for s in _omni_segments() - _shm_at_start if not _made_elsewhere(s))
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if not leaked:
        return
    session.config.get_terminal_writer().line(
        f"FAILED: shared-memory segments survived the test session: {', '.join(leaked)}",
        red=True,
    )
    for name in leaked:
        (_SHM / name).unlink(missing_ok=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
