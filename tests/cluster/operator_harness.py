"""The operator as the cluster tests run it (`kopf run` in a process of its own), and the
objects several cluster tests make by hand."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from omni_testkit.port_leases import lease_port

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "omnipipelines.yaml"
EXAMPLES = REPO / "manifests" / "examples"
TEST_RUNTIME_IMAGE = "omni-operator/omni-runtime:test"
CLI = [sys.executable, "-m", "omni_runtime.entrypoints.cli"]
OUR_KINDS = (
    "configmaps",
    "services",
    "deployments.apps",
    "serviceaccounts",
    "roles.rbac.authorization.k8s.io",
    "rolebindings.rbac.authorization.k8s.io",
    "poddisruptionbudgets.policy",
    "networkpolicies.networking.k8s.io",
    "secrets",
)


class OperatorProcess:
    """`kopf run --standalone --namespace NS -m omni_operator.handlers`, with a liveness
    endpoint; its log goes to a file whose tail failures print."""

    def __init__(self, env: dict[str, str], namespace: str, log_path: Path) -> None:
        self.env = {**env, "OMNI_RUNTIME_IMAGE": TEST_RUNTIME_IMAGE}
        self.namespace = namespace
        self.log_path = log_path
        self.port = lease_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def liveness_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/healthz"

    def start(self, timeout: float = 60) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kopf",
                    "run",
                    "--standalone",
                    f"--namespace={self.namespace}",
                    f"--liveness={self.liveness_url}",
                    "-m",
                    "omni_operator.handlers",
                ],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"operator exited {self.proc.returncode} at start:\n{self.log_tail()}"
                )
            if self.alive():
                return
            time.sleep(0.2)
        raise AssertionError(f"operator not alive after {timeout:.0f}s:\n{self.log_tail()}")

    def alive(self) -> bool:
        try:
            with urllib.request.urlopen(self.liveness_url, timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def probe(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.liveness_url, timeout=2) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when a node dies or the OOM killer strikes."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def example(name: str, *, metadata_name: str | None = None) -> dict[str, Any]:
    """An example pipeline of manifests/examples, optionally renamed."""
    body: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    if metadata_name is not None:
        body["metadata"]["name"] = metadata_name
    body["metadata"].pop("namespace", None)
    return body


def endpoint_slice(namespace: str, address: tuple[str, int], ready: bool) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "stages-hand",
            "namespace": namespace,
            "labels": {
                "kubernetes.io/service-name": "stages",
                # Not the EndpointSlice controller's, so that it leaves the slice alone.
                "endpointslice.kubernetes.io/managed-by": "omni-test",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [address[0]], "conditions": {"ready": ready}}],
        "ports": [{"name": "stage-0", "port": address[1], "protocol": "TCP"}],
    }


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def stage_process(pipeline_file: Path, host: str, timeout: float = 240) -> Iterator[int]:
    """A real stage process serving stage 0 of ``pipeline_file`` on ``host`` (what a stage
    pod would serve), for as long as the context lasts; yields its port."""
    ready = pipeline_file.parent / "stage.ready"
    log = pipeline_file.parent / "stage.log"
    ready.unlink(missing_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                *CLI, "stage", "-f", str(pipeline_file), "--stages", "0",
                "--host", host, "--port", "0=0", "--health-port", "none",
                "--ready-file", str(ready), "--exit-with-parent",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        while not ready.exists():
            assert proc.poll() is None, f"stage exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"stage not ready:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield int(json.loads(ready.read_text())["stages"]["0"])
    finally:
        stop(proc)
