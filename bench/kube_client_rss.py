"""What the Kubernetes client costs in memory: the RSS of the router with EndpointSlice
discovery on, and of the operator, against the local control plane.

Starts a private control plane (tests/cluster/controlplane, as bench/operator_scale.py
does), then, `--runs` times each:

1. router: `omni-runtime router --discover-namespace NS --stage-service 0=stages` over a
   Service with a hand-written EndpointSlice of two ready endpoints (documentation
   addresses: nothing answers, the router only has to know them); once its log shows both,
   its RSS sampled every 0.2 s for `--settle` seconds: the last sample (at rest) and the
   peak since it started.
2. operator: `kopf run --standalone --namespace NS -m omni_operator.handlers`; one tiny
   pipeline applied and taken to Ready, then the same samples.

Prints a markdown table (medians over the runs); `--json` prints the figures. The code
measured is whatever `omni_runtime`/`omni_operator` this Python imports: to measure another
tree with the same environment (a git worktree of an older commit, say), run this script
with PYTHONPATH=TREE/runtime:TREE/operator; the table names the tree it measured.

    .venv/bin/python bench/kube_client_rss.py [--runs 3] [--settle 10]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from operator_scale import Cluster  # bench/ is not a package: found via sys.path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "manifests" / "examples"


class PeakRss(threading.Thread):
    """The peak and the latest RSS of a process, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.peak = 0
        self.last = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.2):
            try:
                self.last = self.proc.memory_info().rss
            except psutil.Error:
                return
            self.peak = max(self.peak, self.last)


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not after {timeout:.0f} s")
        time.sleep(0.1)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure(
    proc: subprocess.Popen[bytes], ready: Callable[[], bool], settle: float
) -> dict[str, float]:
    sampler = PeakRss(proc.pid)
    sampler.start()
    try:
        wait_for(lambda: proc.poll() is None and ready(), 120, "ready")
        time.sleep(settle)  # the measurement interval, not synchronisation
    finally:
        sampler.stopped.set()
        sampler.join()
    return {"rest_mib": sampler.last / 2**20, "peak_mib": sampler.peak / 2**20}


def router_run(cluster: Cluster, workdir: Path, namespace: str, settle: float) -> dict[str, float]:
    pipeline = workdir / "pipeline.json"
    pipeline.write_text(
        json.dumps(
            {
                "model": str(workdir / "tiny-dit"),  # named, never opened by the router
                "stages": [{"stageId": 0, "name": "dit", "type": "diffusion"}],
                "router": {"servedModelName": "tiny-dit"},
            }
        )
    )
    log_path = workdir / f"router-{time.monotonic_ns()}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "omni_runtime.entrypoints.cli", "router",
                "-f", str(pipeline), "--host", "127.0.0.1", "--port", "0",
                "--discover-namespace", namespace, "--stage-service", "0=stages",
            ],
            env={**os.environ, "KUBECONFIG": cluster.kubeconfig},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        return measure(proc, lambda: "stage 0 (dit): 2 replica(s)" in log_path.read_text(), settle)
    finally:
        stop(proc)


def operator_run(
    cluster: Cluster, workdir: Path, namespace: str, settle: float, port: int
) -> dict[str, float]:
    log_path = workdir / f"operator-{time.monotonic_ns()}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "kopf", "run", "--standalone",
                f"--namespace={namespace}", f"--liveness=http://127.0.0.1:{port}/healthz",
                "-m", "omni_operator.handlers",
            ],
            env={**os.environ, "KUBECONFIG": cluster.kubeconfig},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    tiny: dict[str, Any] = yaml.safe_load((EXAMPLES / "tiny-pipeline.yaml").read_text())
    tiny["metadata"] = {"name": "tiny"}
    applied = False

    def ready() -> bool:
        nonlocal applied
        if not applied:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).close()
            except OSError:
                return False
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(tiny))
            applied = True
        got = json.loads(
            cluster.kubectl("get", "omnipipeline", "tiny", "-n", namespace, "-o", "json")
        )
        return bool(got.get("status", {}).get("phase") == "Ready")

    try:
        return measure(proc, ready, settle)
    finally:
        stop(proc)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    which = subprocess.run(
        [sys.executable, "-c", "import omni_runtime.kube as k; print(k.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    tree = str(Path(which).parents[2])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = Path(tempfile.mkdtemp(prefix="omni-kube-rss-"))
    cluster = Cluster(workdir / "controlplane")
    routers: list[dict[str, float]] = []
    operators: list[dict[str, float]] = []
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "omnipipelines.yaml"))
        cluster.kubectl(
            "wait", "--for=condition=Established", "crd/omnipipelines.omni.dev", "--timeout=60s"
        )
        cluster.kubectl("create", "namespace", "bench-router")
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "stages", "namespace": "bench-router"},
            "spec": {"clusterIP": "None", "ports": [{"name": "stage-0", "port": 52000}]},
        }
        endpoints = [{"addresses": [f"192.0.2.{n}"], "conditions": {"ready": True}} for n in (1, 2)]
        eps = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "stages-hand",
                "namespace": "bench-router",
                "labels": {
                    "kubernetes.io/service-name": "stages",
                    "endpointslice.kubernetes.io/managed-by": "omni-bench",
                },
            },
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": [{"name": "stage-0", "port": 52000, "protocol": "TCP"}],
        }
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([service, eps]))
        for n in range(args.runs):
            routers.append(router_run(cluster, workdir, "bench-router", args.settle))
            namespace = f"bench-operator-{n}"
            cluster.kubectl("create", "namespace", namespace)
            operators.append(operator_run(cluster, workdir, namespace, args.settle, 18090 + n))
    finally:
        cluster.stop()

    def median(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(run[key] for run in runs)

    figures = {
        "tree": tree,
        "runs": args.runs,
        "router": {"runs": routers, **{k: median(routers, k) for k in ("rest_mib", "peak_mib")}},
        "operator": {
            "runs": operators,
            **{k: median(operators, k) for k in ("rest_mib", "peak_mib")},
        },
    }
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"code measured: {tree} (median of {args.runs} runs)\n")
    print("| process | RSS at rest | peak RSS |\n|---|---|---|")
    for name, label in (("router", "router, discovery on"), ("operator", "operator, one pipeline")):
        got: Any = figures[name]
        print(f"| {label} | {got['rest_mib']:.1f} MiB | {got['peak_mib']:.1f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
