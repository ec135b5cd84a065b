"""A stage process running several stages gives each stage's engine its own GPUs: the
operator sets OMNI_CUDA_VISIBLE_DEVICES_<stage id> (the stage's ids in the pod's numbering),
and the engine process of that stage sees it as CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
from serving import CLI, wait_until

from omni_runtime.tiny_models import DIFFUSION_SUBDIR

pytestmark = pytest.mark.integration


def _environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return dict(proc.environ())
    except psutil.Error:
        return {}


def test_each_stage_engine_sees_the_gpus_named_for_it(tiny_models: Path, tmp_path: Path) -> None:
    # Two diffusion stages in one process (CPU engines: the variable is what is checked).
    model = str(tiny_models / DIFFUSION_SUBDIR)
    pipeline = {
        "model": model,
        "stages": [
            {"stageId": 0, "name": "one", "type": "diffusion"},
            {"stageId": 1, "name": "two", "type": "diffusion"},
        ],
    }
    config = tmp_path / "pipeline.json"
    config.write_text(json.dumps(pipeline))
    ready = tmp_path / "ready.json"
    log = tmp_path / "stage.log"
    env = {
        **os.environ,
        "OMNI_CUDA_VISIBLE_DEVICES_0": "1",
        "OMNI_CUDA_VISIBLE_DEVICES_1": "0,2",
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                *CLI, "stage", "-f", str(config), "--stages", "0,1",
                "--host", "127.0.0.1", "--port", "0=0", "--port", "1=0",
                "--health-port", "none", "--ready-file", str(ready),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:

        def started() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            return ready.exists()

        wait_until(started, 120, "both stages ready", interval=0.2)
        children = psutil.Process(proc.pid).children(recursive=True)
        seen = sorted(
            _environ(child).get("CUDA_VISIBLE_DEVICES", "<unset>")
            for child in children
            if "OMNI_CUDA_VISIBLE_DEVICES_0" in _environ(child)
        )
        # One engine process per stage, each with its own devices.
        assert seen == ["0,2", "1"], [(c.pid, c.name()) for c in children]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
