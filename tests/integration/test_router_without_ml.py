"""A router pod has no torch, vLLM, diffusers or transformers: the router must start and
answer without them (the import-linter contract checks the imports; this runs them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serving import wait_until

from omni_testkit.port_leases import lease_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# Setting a module to None in sys.modules makes any import of it raise ImportError.
_BLOCKED = ("torch", "vllm", "diffusers", "transformers")
_RUN_ROUTER = f"""
import sys
for name in {_BLOCKED!r}:
    sys.modules[name] = None
from omni_runtime.entrypoints.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_router_serves_with_the_ml_libraries_blocked() -> None:
    port = lease_port()
    stage_port = lease_port()  # nothing listens there: the stage has no live replica
    command = [sys.executable, "-c", _RUN_ROUTER, "router", "-f", "examples/tiny-chat.yaml"]
    command += ["--replicas", f"0=127.0.0.1:{stage_port}", "--host", "127.0.0.1"]
    command += ["--port", str(port)]
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:

        def health() -> httpx.Response | None:
            if proc.poll() is not None:
                output = proc.stdout.read() if proc.stdout else ""
                raise AssertionError(f"the router exited {proc.returncode}:\n{output}")
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            except httpx.TransportError:
                return None

        response = wait_until(health, 60, "the router answers /health")
        assert response.status_code == 503
        assert "chat" in response.json()["error"]
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
        assert models["data"][0]["id"] == "tiny-chat"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout:
            proc.stdout.close()
