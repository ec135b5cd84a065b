"""Fixtures for tests that need a real Kubernetes API.

`kube` (session): the cluster named by $KUBECONFIG when that is set, else a
local control plane from controlplane/ (built on first use), private to the
session in a pytest temp dir and stopped after it; $OMNI_CONTROLPLANE_DIR
names a shared one to use instead (left running if it was already up).
`namespace` (function): a fresh namespace, deleted after the test.
`real_node` (session): the local control plane's real node (kubelet, containerd,
kube-proxy; see controlplane/realnode.py), or a skip saying what is missing
(a failure with OMNI_REQUIRE_REAL_NODE=1).
`eventually` polls a check until a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

HERE = Path(__file__).resolve().parent
CONTROLPLANE = HERE / "controlplane"

T = TypeVar("T")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # This hook sees every collected item, not just this directory's.
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.cluster)


class KubectlError(AssertionError):
    pass


@dataclass(frozen=True)
class Kube:
    kubeconfig: Path
    kubectl_path: str
    # True when the control plane is ours (kwok nodes exist, nothing else runs).
    local: bool
    cache_dir: Path
    # Why the real node's binaries could not be built, if they could not.
    node_build_error: str = ""

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        namespace: str | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; with check, a non-zero exit raises."""
        cmd = [
            self.kubectl_path,
            f"--kubeconfig={self.kubeconfig}",
            f"--cache-dir={self.cache_dir}",
        ]
        if namespace is not None:
            cmd.append(f"--namespace={namespace}")
        cmd.extend(args)
        res = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise KubectlError(
                f"kubectl {' '.join(args)} exited {res.returncode}:\n{res.stderr.strip()}"
            )
        return res

    def get_json(self, *args: str, namespace: str | None = None) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json", namespace=namespace).stdout)

    def apply(self, manifest: dict[str, Any] | str, namespace: str | None = None) -> None:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        self.kubectl("apply", "-f", "-", input=text, namespace=namespace)

    def wait_crd_established(self, name: str, timeout: float = 60.0) -> None:
        """Until the CRD ``name`` is Established. Polled, not ``kubectl wait``: right after
        an apply the CRD may have no status.conditions yet, and kubectl wait then fails at
        once ("accessor error: <nil>") instead of waiting."""
        path = '{.status.conditions[?(@.type=="Established")].status}'

        def established() -> bool:
            return self.kubectl("get", f"crd/{name}", "-o", f"jsonpath={path}").stdout == "True"

        eventually(established, timeout=timeout, what=f"CRD {name} Established")

    def env(self) -> dict[str, str]:
        """Environment for a subprocess (e.g. an operator) that should use this cluster."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}


def eventually(
    fn: Callable[[], T], timeout: float = 30.0, interval: float = 0.2, what: str | None = None
) -> T:
    """Call fn until it returns a truthy value and raises no AssertionError/KubectlError.

    Returns that value; after `timeout` seconds fails with the last result or
    error, so a check that never passes reports why.
    """
    deadline = time.monotonic() + timeout
    last: str = "never called"
    while True:
        try:
            value = fn()
            if value:
                return value
            last = f"returned {value!r}"
        except AssertionError as exc:  # KubectlError is one
            last = f"raised {exc}"
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"{what or getattr(fn, '__name__', 'check')} not true after "
                f"{timeout:.0f}s: last {last}"
            )
        time.sleep(interval)


@pytest.fixture(name="eventually")
def eventually_fixture() -> Callable[..., Any]:
    return eventually


def _run_script(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.fixture(scope="session")
def controlplane_bin_dir() -> Path:
    """The local control plane's binaries, built from the pinned modules on first use."""
    # A cold build takes minutes; a warm one returns in about a second.
    build = _run_script(["bash", str(CONTROLPLANE / "build.sh")], timeout=3 * 3600)
    if build.returncode != 0:
        pytest.skip(
            "local control plane binaries are missing and could not be built: "
            f"build.sh exited {build.returncode}:\n{build.stderr[-3000:]}"
        )
    return Path(_last_line(build.stdout))


def _build_node() -> str:
    """Build the real node's binaries (containerd, ...); returns why not, or ''."""
    build = _run_script(["bash", str(HERE / "node" / "build.sh")], timeout=3 * 3600)
    if build.returncode != 0:
        return f"node/build.sh exited {build.returncode}:\n{build.stderr[-3000:]}"
    return ""


@pytest.fixture(scope="session")
def kube(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Kube]:
    cache_dir = tmp_path_factory.mktemp("kubectl-cache")
    external = os.environ.get("KUBECONFIG")
    if external:
        built = _run_script(["bash", str(CONTROLPLANE / "build.sh"), "--print-bin-dir"], 60)
        built_kubectl = Path(_last_line(built.stdout)) / "kubectl"
        kubectl = shutil.which("kubectl") or (
            str(built_kubectl) if built.returncode == 0 and built_kubectl.exists() else None
        )
        if kubectl is None:
            pytest.skip(f"KUBECONFIG={external} is set but no kubectl is on PATH or built")
        yield Kube(Path(external.split(os.pathsep)[0]), kubectl, local=False, cache_dir=cache_dir)
        return

    bin_dir: Path = request.getfixturevalue("controlplane_bin_dir")
    node_build_error = _build_node()
    script = [sys.executable, str(CONTROLPLANE / "controlplane.py")]
    shared = os.environ.get("OMNI_CONTROLPLANE_DIR")
    # By default each session runs a control plane of its own (it starts in
    # seconds): sessions running at once on one machine must not stop or
    # restart each other's. OMNI_CONTROLPLANE_DIR names one to share instead.
    state_dir = Path(shared) if shared else tmp_path_factory.mktemp("controlplane")
    state = ["--state-dir", str(state_dir)]
    # A shared control plane that was up before the session belongs to
    # someone else (a developer keeping it warm); leave it running.
    already = bool(shared) and _run_script([*script, "status", *state], 60).returncode == 0
    started = _run_script([*script, "start", "--bin-dir", str(bin_dir), *state], timeout=900)
    if started.returncode != 0:
        pytest.fail(
            f"local control plane did not start (exit {started.returncode}):\n"
            f"{started.stderr[-6000:]}",
            pytrace=False,
        )
    kubeconfig = Path(_last_line(started.stdout))
    try:
        yield Kube(
            kubeconfig,
            str(bin_dir / "kubectl"),
            local=True,
            cache_dir=cache_dir,
            node_build_error=node_build_error,
        )
    finally:
        if not already:
            _run_script([*script, "stop", *state], timeout=120)
        if not shared:
            # pytest keeps recent temp dirs; logs are worth keeping, the
            # etcd data (tens of MB of preallocated WAL) is not.
            shutil.rmtree(state_dir / "etcd-data", ignore_errors=True)


@dataclass(frozen=True)
class RealNode:
    """The real node of a local control plane and its container runtime."""

    name: str
    state_dir: Path
    containerd_sock: str
    ctr_path: str
    crictl_path: str
    # The tests' own tiny image (omni-probe), already in the node's containerd.
    probe_image: str
    # The node's network namespace (its supervisor's): pod IPs are routable inside it.
    netns: str
    # Labels and taint: only pods that ask for the real node land on it.
    node_selector: dict[str, str]
    toleration: dict[str, str]

    def crictl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        sock = f"unix://{self.containerd_sock}"
        return subprocess.run(
            [
                self.crictl_path,
                f"--runtime-endpoint={sock}",
                f"--image-endpoint={sock}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )

    def ctr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.ctr_path, f"--address={self.containerd_sock}", "--namespace=k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )

    def load_image(self, image: str, timeout: float = 1800) -> str:
        """Copy image (e.g. omni-operator/omni-runtime:0.1.0) from podman's storage into the
        node's containerd, under the name a pod's `image:` of the same text resolves to.
        Nothing is copied when containerd has that image id already (a warm run)."""
        res = _run_script(
            [
                sys.executable,
                str(CONTROLPLANE / "controlplane.py"),
                "load-image",
                image,
                "--state-dir",
                str(self.state_dir),
            ],
            timeout=timeout,
        )
        if res.returncode != 0:
            raise AssertionError(f"load-image {image} failed:\n{res.stderr[-3000:]}")
        return _last_line(res.stdout)

    @contextlib.contextmanager
    def unix_socket_to(self, address: str, port: int) -> Iterator[str]:
        """A unix socket on this machine whose every connection is a fresh TCP connection
        from the node's network to address:port (a pod IP, say), for as long as the
        context lasts.

        Why not `kubectl port-forward`: one forwarding error on any of its connections (a
        reset from the far end) closes all of them and the process exits ("lost connection
        to pod", client-go's portforward.go), which a rollout's closing connections do.
        Here each connection stands alone, as a client inside the cluster's network has it.
        """
        socat = shutil.which("socat")
        nsenter = shutil.which("nsenter")
        assert socat, "socat is not on PATH (the real node needs it too)"
        assert nsenter, "nsenter is not on PATH"
        # A short path: a unix socket's name is at most 107 bytes, pytest's tmp dirs run long.
        with tempfile.TemporaryDirectory(prefix="omni-node-") as tmp:
            path = str(Path(tmp) / "s")
            log = Path(tmp) / "socat.log"
            with log.open("w") as err:
                proc = subprocess.Popen(
                    [
                        nsenter,
                        f"--net={self.netns}",
                        socat,
                        f"UNIX-LISTEN:{path},fork,mode=600",
                        f"TCP:{address}:{port}",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    # Its group: socat forks a child per connection.
                    start_new_session=True,
                )
            try:
                deadline = time.monotonic() + 10
                while not Path(path).exists():
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(
                            f"socat in the node's network made no {path}: {log.read_text()}"
                        )
                    time.sleep(0.02)
                yield path
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def pod_spec(self, **spec: Any) -> dict[str, Any]:
        """A pod spec pinned to the real node (its selector and toleration) plus spec."""
        return {
            "nodeSelector": dict(self.node_selector),
            "tolerations": [dict(self.toleration)],
            **spec,
        }


@pytest.fixture(scope="session")
def real_node(kube: Kube) -> RealNode:
    def unavailable(reason: str) -> RealNode:
        if os.environ.get("OMNI_REQUIRE_REAL_NODE") == "1":
            pytest.fail(f"OMNI_REQUIRE_REAL_NODE=1 but {reason}", pytrace=False)
        pytest.skip(reason)

    if not kube.local:
        return unavailable("the real node runs only beside the local control plane")
    state_dir = kube.kubeconfig.parent
    state = json.loads((state_dir / "state.json").read_text())
    node = state.get("node") or {}
    if not node.get("enabled"):
        reason = f"no real node: {node.get('reason', 'not recorded in state.json')}"
        if kube.node_build_error:
            reason += f"\n{kube.node_build_error}"
        return unavailable(reason)
    return RealNode(
        name=node["name"],
        state_dir=state_dir,
        containerd_sock=node["containerd_sock"],
        ctr_path=node["ctr"],
        crictl_path=node["crictl"],
        probe_image=node["probe_image"],
        netns=f"/proc/{node['supervisor_pid']}/ns/net",
        node_selector={"omni-operator.test/node-kind": "real"},
        toleration={
            "key": "omni-operator.test/real-node",
            "operator": "Equal",
            "value": "true",
            "effect": "NoSchedule",
        },
    )


def _namespace_name(test_name: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:40].strip("-")
    return f"t-{base}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    name = _namespace_name(request.node.name)
    kube.kubectl("create", "namespace", name)
    # Pods are refused until the serviceaccount controller made "default".
    eventually(
        lambda: kube.kubectl("get", "serviceaccount", "default", namespace=name),
        timeout=30,
        what=f"serviceaccount {name}/default",
    )
    try:
        yield name
    finally:
        # Termination of the namespace's contents is the controllers' work,
        # and no later test depends on it being finished.
        kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


class PortForwards:
    """`kubectl port-forward` processes, each killed (and reaped) by close()."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, namespace: str, target: str, port: int) -> int:
        proc = subprocess.Popen(
            [
                self.kube.kubectl_path,
                f"--kubeconfig={self.kube.kubeconfig}",
                f"--namespace={namespace}",
                "port-forward",
                target,
                f":{port}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        # kubectl prints the local port once it listens (EOF if it fails).
        line = proc.stdout.readline()
        match = re.match(r"Forwarding from 127\.0\.0\.1:(\d+) -> \d+", line)
        if match is None:
            proc.kill()
            _, err = proc.communicate(timeout=10)
            raise AssertionError(f"kubectl port-forward {target} printed {line!r}; stderr: {err}")
        return int(match.group(1))

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.communicate(timeout=10)
        self.procs.clear()


@pytest.fixture
def port_forwards(kube: Kube) -> Iterator[PortForwards]:
    forwards = PortForwards(kube)
    try:
        yield forwards
    finally:
        forwards.close()
