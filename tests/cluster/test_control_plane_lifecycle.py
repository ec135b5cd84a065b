"""controlplane.py's own promises, on a control plane of the test's own (beside the
session's): start and stop are idempotent, stop ends exactly what start recorded, a start
over a broken run replaces it, and a component that dies is reported with its log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

CONTROLPLANE = Path(__file__).resolve().parent / "controlplane"
COMPONENTS = {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"}


def controlplane(*args: str, state_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            str(CONTROLPLANE / "controlplane.py"),
            *args,
            "--state-dir",
            str(state_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def recorded_pids(state_dir: Path) -> dict[str, int]:
    state = json.loads((state_dir / "state.json").read_text())
    return {proc["name"]: proc["pid"] for proc in state["procs"]}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def running_from(state_dir: Path) -> list[int]:
    """Processes whose command line names the state dir (etcd's data dir, certificates)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if str(state_dir) in " ".join(proc.info["cmdline"] or []) and not gone(proc.pid):
            found.append(proc.pid)
    return found


def test_start_and_stop_are_idempotent_and_a_dead_component_is_reported(
    controlplane_bin_dir: Path, tmp_path: Path, eventually: Callable[..., Any]
) -> None:
    state_dir = tmp_path / "cp"
    start = ("start", "--bin-dir", str(controlplane_bin_dir))
    first = controlplane(*start, state_dir=state_dir)
    assert first.returncode == 0, first.stderr
    pids = recorded_pids(state_dir)
    assert set(pids) == COMPONENTS
    try:
        again = controlplane(*start, state_dir=state_dir)
        assert again.returncode == 0, again.stderr
        assert "already running and healthy" in again.stderr
        assert recorded_pids(state_dir) == pids
        assert again.stdout.split()[-1] == first.stdout.split()[-1]  # the same kubeconfig

        os.kill(pids["kube-scheduler"], signal.SIGKILL)
        status = eventually(
            lambda: (
                (result := controlplane("status", state_dir=state_dir)).returncode == 1 and result
            ),
            what="status reporting the killed scheduler",
        )
        assert f"kube-scheduler           pid {pids['kube-scheduler']:<8} EXITED" in status.stdout
        assert f"--- last lines of {state_dir / 'logs' / 'kube-scheduler.log'} ---" in status.stdout

        replaced = controlplane(*start, state_dir=state_dir)
        assert replaced.returncode == 0, replaced.stderr
        assert all(gone(pid) for pid in pids.values())
        pids = recorded_pids(state_dir)
        assert controlplane("status", state_dir=state_dir).returncode == 0
    finally:
        stopped = controlplane("stop", state_dir=state_dir)
    assert stopped.returncode == 0, stopped.stderr
    assert all(gone(pid) for pid in pids.values())
    assert running_from(state_dir) == []
    stopped_again = controlplane("stop", state_dir=state_dir)
    assert stopped_again.returncode == 0
    assert "not running" in stopped_again.stderr


def test_a_component_failing_at_start_is_reported_and_nothing_is_left(
    controlplane_bin_dir: Path, tmp_path: Path
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for binary in controlplane_bin_dir.iterdir():
        (bin_dir / binary.name).symlink_to(binary)
    broken = bin_dir / "kube-apiserver"
    broken.unlink()
    broken.write_text("#!/bin/sh\necho 'simulated: cannot bind 127.0.0.1' >&2\nexit 3\n")
    broken.chmod(0o755)
    state_dir = tmp_path / "cp"
    result = controlplane("start", "--bin-dir", str(bin_dir), state_dir=state_dir)
    assert result.returncode == 1
    assert "kube-apiserver exited with code 3 during start" in result.stderr
    assert "simulated: cannot bind 127.0.0.1" in result.stderr  # the log's tail
    assert "Traceback" not in result.stderr
    assert not (state_dir / "state.json").exists()
    assert running_from(state_dir) == []  # etcd, started first, was stopped
