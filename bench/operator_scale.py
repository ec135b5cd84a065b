"""How fast the operator converges, and what it costs, against the local control plane.

Starts a private control plane (tests/cluster/controlplane, kwok nodes: pods become Ready
without a kubelet, so the figures are the operator's and the controllers', not image pulls
or model loads), installs the CRD and runs the operator (`kopf run --standalone
--all-namespaces -m omni_operator.handlers`) in a process of its own. Then:

The control plane's two kwok nodes hold about 30 tiny pipelines (each asks for 2.25 CPUs);
`--extra-nodes` more fake CPU nodes (32 CPUs each, 4 by default) make room for 50.

1. apply -> Ready: `kubectl apply -f manifests/examples/bagel-pipeline.yaml` until its
   status.phase is Ready, `--repeat` times (each in a fresh namespace): median and max.
2. 50 at once: `--pipelines` copies of the tiny example applied in one kubectl call, in one
   namespace; time until every one is Ready, and the operator's peak RSS and CPU use
   (sampled every 0.2 s) meanwhile.
3. at rest: the operator's RSS 10 s after the last pipeline became Ready.

Prints a markdown table; `--json` prints the figures as JSON.

    .venv/bin/python bench/operator_scale.py [--pipelines 50] [--repeat 3]
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
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
CONTROLPLANE = REPO / "tests" / "cluster" / "controlplane"
EXAMPLES = REPO / "manifests" / "examples"


class Cluster:
    def __init__(self, state_dir: Path) -> None:
        built = subprocess.run(
            ["bash", str(CONTROLPLANE / "build.sh")], capture_output=True, text=True, check=True
        )
        self.bin_dir = Path(built.stdout.strip().splitlines()[-1])
        self.state_dir = state_dir
        started = subprocess.run(
            [
                sys.executable,
                str(CONTROLPLANE / "controlplane.py"),
                "start",
                "--bin-dir",
                str(self.bin_dir),
                "--state-dir",
                str(state_dir),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        self.kubeconfig = started.stdout.strip().splitlines()[-1]

    def kubectl(self, *args: str, input: str | None = None) -> str:
        result = subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def stop(self) -> None:
        subprocess.run(
            [
                sys.executable,
                str(CONTROLPLANE / "controlplane.py"),
                "stop",
                "--state-dir",
                str(self.state_dir),
            ],
            capture_output=True,
        )


class Sampler(threading.Thread):
    """Samples a process's RSS and CPU every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.interval = interval
        self.peak_rss = 0
        self.cpu_samples: list[float] = []
        self.stopped = threading.Event()
        self.proc.cpu_percent(None)

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
                self.cpu_samples.append(self.proc.cpu_percent(None))
            except psutil.Error:
                return


def phases(cluster: Cluster, namespace: str) -> dict[str, str]:
    listed = json.loads(cluster.kubectl("get", "omnipipelines", "-n", namespace, "-o", "json"))
    return {
        item["metadata"]["name"]: item.get("status", {}).get("phase", "")
        for item in listed["items"]
    }


def wait_applied(cluster: Cluster, namespace: str, deployments: int, start: float) -> float:
    """Seconds from ``start`` until ``deployments`` Deployments exist in ``namespace``: the
    operator's own share of the work, before the controllers and the scheduler's."""
    while time.monotonic() - start < 600:
        listed = cluster.kubectl("get", "deployments", "-n", namespace, "-o", "name")
        if len(listed.split()) >= deployments:
            return time.monotonic() - start
        time.sleep(0.1)
    raise RuntimeError(f"fewer than {deployments} Deployments after 600 s")


def wait_ready(cluster: Cluster, namespace: str, count: int, start: float, timeout: float) -> float:
    """Seconds from ``start`` until ``count`` pipelines in ``namespace`` are all Ready."""
    while time.monotonic() - start < timeout:
        got = phases(cluster, namespace)
        if len(got) == count and all(phase == "Ready" for phase in got.values()):
            return time.monotonic() - start
        time.sleep(0.1)
    pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json"))["items"]
    pending = [
        f"{p['metadata']['name']}: "
        + "; ".join(c.get("message", "") for c in p["status"].get("conditions", []))
        for p in pods
        if p["status"].get("phase") != "Running"
    ]
    deployments = cluster.kubectl("get", "deployments", "-n", namespace)
    raise RuntimeError(
        f"not all Ready after {timeout:.0f}s: {phases(cluster, namespace)}\n"
        f"{len(pods)} pods, not running: {pending[:10]}\n{deployments[:3000]}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipelines", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--extra-nodes", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    # SIGTERM (timeout, Ctrl-C's cousin) must still stop the control plane and operator.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = Path(tempfile.mkdtemp(prefix="omni-operator-bench-"))
    cluster = Cluster(workdir / "controlplane")
    operator: subprocess.Popen[bytes] | None = None
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "omnipipelines.yaml"))
        cluster.kubectl(
            "wait", "--for=condition=Established", "crd/omnipipelines.omni.dev", "--timeout=60s"
        )
        nodes = [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": f"bench-cpu-{n}",
                    "annotations": {"kwok.x-k8s.io/node": "fake"},
                    "labels": {"kubernetes.io/hostname": f"bench-cpu-{n}", "type": "kwok"},
                },
                "status": {
                    "capacity": {"cpu": "32", "memory": "128Gi", "pods": "110"},
                    "allocatable": {"cpu": "32", "memory": "128Gi", "pods": "110"},
                },
            }
            for n in range(args.extra_nodes)
        ]
        if nodes:
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(nodes))
        log = (workdir / "operator.log").open("wb")
        operator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kopf",
                "run",
                "--standalone",
                "--all-namespaces",
                "--liveness=http://127.0.0.1:18080/healthz",
                "-m",
                "omni_operator.handlers",
            ],
            env={**os.environ, "KUBECONFIG": cluster.kubeconfig},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen("http://127.0.0.1:18080/healthz", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or operator.poll() is not None:
                    raise RuntimeError("operator did not come up; see its log") from None
                time.sleep(0.2)

        bagel = (EXAMPLES / "bagel-pipeline.yaml").read_text()
        single: list[float] = []
        for n in range(args.repeat):
            namespace = f"bench-bagel-{n}"
            cluster.kubectl("create", "namespace", namespace)
            start = time.monotonic()
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=bagel)
            single.append(wait_ready(cluster, namespace, 1, start, 120))

        tiny: dict[str, Any] = yaml.safe_load((EXAMPLES / "tiny-pipeline.yaml").read_text())
        many = []
        for n in range(args.pipelines):
            body = json.loads(json.dumps(tiny))
            body["metadata"] = {"name": f"tiny-{n:03d}"}
            many.append(body)
        cluster.kubectl("create", "namespace", "bench-many")
        sampler = Sampler(operator.pid)
        sampler.start()
        start = time.monotonic()
        cluster.kubectl("apply", "-n", "bench-many", "-f", "-", input=yaml.safe_dump_all(many))
        # The tiny pipeline has two placement groups and a router: 3 Deployments each.
        applied = wait_applied(cluster, "bench-many", 3 * args.pipelines, start)
        all_ready = wait_ready(cluster, "bench-many", args.pipelines, start, 600)
        sampler.stopped.set()
        sampler.join()
        time.sleep(10)  # a measurement interval, not synchronisation
        rest_rss = psutil.Process(operator.pid).memory_info().rss
        figures = {
            "apply_to_ready_bagel_s": {
                "median": statistics.median(single),
                "max": max(single),
                "runs": single,
            },
            "pipelines": args.pipelines,
            "all_applied_s": applied,
            "all_ready_s": all_ready,
            "peak_rss_mib": sampler.peak_rss / 2**20,
            "cpu_percent_mean": statistics.fmean(sampler.cpu_samples or [0.0]),
            "cpu_percent_peak": max(sampler.cpu_samples or [0.0]),
            "rest_rss_mib": rest_rss / 2**20,
        }
    finally:
        if operator is not None:
            operator.terminate()
            try:
                operator.wait(timeout=20)
            except subprocess.TimeoutExpired:
                operator.kill()
        cluster.stop()
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print("| measure | value |\n|---|---|")
    bagel_figures = figures["apply_to_ready_bagel_s"]
    print(
        f"| bagel apply -> Ready (median / max of {args.repeat}) | "
        f"{bagel_figures['median']:.2f} s / {bagel_figures['max']:.2f} s |"
    )
    print(
        f"| {args.pipelines} pipelines applied at once -> every Deployment created | "
        f"{applied:.1f} s |"
    )
    print(f"| {args.pipelines} pipelines applied at once -> all Ready | {all_ready:.1f} s |")
    print(f"| operator peak RSS meanwhile | {figures['peak_rss_mib']:.0f} MiB |")
    print(
        f"| operator CPU meanwhile (mean / peak, % of one core) | "
        f"{figures['cpu_percent_mean']:.0f} / {figures['cpu_percent_peak']:.0f} |"
    )
    print(f"| operator RSS at rest | {figures['rest_rss_mib']:.0f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
