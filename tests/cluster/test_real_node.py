"""The real node beside the kwok nodes: a kubelet, containerd and kube-proxy that run real
containers (the tests' tiny omni-probe image) inside namespaces of their own.

What a user does with pods is checked through the apiserver as they would: logs, exec,
port-forward, a Service's ClusterIP, and an in-cluster client reaching
kubernetes.default.svc with its service account. Skipped, saying what is missing, where
the machine cannot run the node (see controlplane/realnode.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from conftest import Kube, PortForwards, RealNode

Eventually = Callable[..., Any]

KWOK_NODES = ("kwok-cpu-0", "kwok-gpu-0")
CONTROLPLANE = Path(__file__).resolve().parent / "controlplane"


def probe_pod(
    node: RealNode,
    name: str,
    *args: str,
    labels: dict[str, str] | None = None,
    restart: str = "Never",
    serve_port: int | None = None,
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "probe",
        "image": node.probe_image,
        # Only ever imported: a pull would try to leave the machine.
        "imagePullPolicy": "Never",
        "args": list(args),
    }
    if serve_port is not None:
        container["ports"] = [{"containerPort": serve_port}]
        container["readinessProbe"] = {
            "tcpSocket": {"port": serve_port},
            "periodSeconds": 1,
        }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": node.pod_spec(
            restartPolicy=restart,
            terminationGracePeriodSeconds=5,
            containers=[container],
        ),
    }


def pod_phase(kube: Kube, namespace: str, name: str) -> str:
    pod = kube.get_json("pod", name, namespace=namespace)
    return str(pod["status"].get("phase", ""))


def pod_ready(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    pod: dict[str, Any] = kube.get_json("pod", name, namespace=namespace)
    conditions = pod["status"].get("conditions", [])
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in conditions), pod["status"]
    return pod


def test_real_node_is_ready_beside_the_kwok_nodes_and_kwok_leaves_it_alone(
    kube: Kube, real_node: RealNode, eventually: Eventually
) -> None:
    nodes = {n["metadata"]["name"]: n for n in kube.get_json("nodes")["items"]}
    assert {real_node.name, *KWOK_NODES} <= set(nodes)
    for name in (real_node.name, *KWOK_NODES):
        ready = [c for c in nodes[name]["status"]["conditions"] if c["type"] == "Ready"]
        assert [c["status"] for c in ready] == ["True"], (name, ready)

    real = nodes[real_node.name]
    info = real["status"]["nodeInfo"]
    # A real kubelet and runtime report themselves; kwok would write its own versions.
    assert info["kubeletVersion"] == "v1.37.2", info
    assert info["containerRuntimeVersion"].startswith("containerd://2.4.2"), info
    real_ready = next(c for c in real["status"]["conditions"] if c["type"] == "Ready")
    assert real_ready["reason"] == "KubeletReady", real_ready
    assert "kwok.x-k8s.io/node" not in real["metadata"].get("annotations", {})
    assert real["metadata"]["labels"]["omni-operator.test/node-kind"] == "real"
    taints = real["spec"].get("taints", [])
    assert {"key": "omni-operator.test/real-node", "value": "true", "effect": "NoSchedule"} in [
        {k: t[k] for k in ("key", "value", "effect")} for t in taints
    ]
    assert {"type": "InternalIP", "address": "127.0.0.1"} in real["status"]["addresses"]
    for name in KWOK_NODES:
        assert nodes[name]["status"]["nodeInfo"]["kubeletVersion"] != "v1.37.2"

    # The kubelet's own heartbeat, which kwok writes for its nodes only.
    def lease_held() -> bool:
        lease = kube.get_json("lease", real_node.name, namespace="kube-node-lease")
        return bool(
            lease["spec"]["holderIdentity"] == real_node.name and lease["spec"]["renewTime"]
        )

    eventually(lease_held, timeout=30, what=f"{real_node.name}'s node lease")


def test_a_pod_runs_its_logs_and_exec_work_and_deleting_it_removes_its_containers(
    kube: Kube, real_node: RealNode, namespace: str, eventually: Eventually
) -> None:
    kube.apply(probe_pod(real_node, "printer", "print", "hello", "from the real node"), namespace)
    kube.apply(probe_pod(real_node, "sleeper", "sleep"), namespace)

    eventually(
        lambda: pod_phase(kube, namespace, "printer") == "Succeeded",
        timeout=60,
        what="printer Succeeded",
    )
    printer = kube.get_json("pod", "printer", namespace=namespace)
    assert printer["spec"]["nodeName"] == real_node.name
    terminated = printer["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (0, "Completed"), terminated
    logs = kube.kubectl("logs", "printer", namespace=namespace).stdout
    assert logs.splitlines() == ["hello", "from the real node"]

    eventually(lambda: pod_ready(kube, namespace, "sleeper"), timeout=60, what="sleeper Ready")
    assert "sleeping until SIGTERM" in kube.kubectl("logs", "sleeper", namespace=namespace).stdout
    out = kube.kubectl(
        "exec", "sleeper", "--", "/omni-probe", "print", "exec works", namespace=namespace
    )
    assert out.stdout == "exec works\n"
    failed = kube.kubectl(
        "exec", "sleeper", "--", "/no-such-binary", namespace=namespace, check=False
    )
    assert failed.returncode != 0

    def containers(*flags: str) -> list[str]:
        out = real_node.crictl(
            "ps", "-q", *flags, f"--label=io.kubernetes.pod.namespace={namespace}"
        ).stdout
        return out.split()

    assert len(containers("-a")) == 2
    assert len(containers()) == 1  # the printer's exited, the sleeper's runs
    kube.kubectl("delete", "pod", "printer", "sleeper", "--wait=true", namespace=namespace)
    # The sleeper (pid 1 of its container) ended on SIGTERM within the grace period.
    assert containers() == []
    # The kubelet's garbage collection (once a minute) removes what exited.
    eventually(lambda: containers("-a") == [], timeout=150, what="no containers of the namespace")
    eventually(
        lambda: real_node.crictl("pods", "-q", f"--namespace={namespace}").stdout.split() == [],
        timeout=90,
        what="no pod sandboxes of the namespace",
    )


def test_a_service_clusterip_reaches_both_backends_on_the_node(
    kube: Kube, real_node: RealNode, namespace: str, eventually: Eventually
) -> None:
    labels = {"app": "echo"}
    for name in ("backend-a", "backend-b"):
        kube.apply(
            probe_pod(real_node, name, "serve", "8080", labels=labels, serve_port=8080), namespace
        )
    kube.apply(probe_pod(real_node, "client", "sleep"), namespace)
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "echo"},
            "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": 8080}]},
        },
        namespace,
    )
    for name in ("backend-a", "backend-b", "client"):
        eventually(lambda n=name: pod_ready(kube, namespace, n), timeout=60, what=f"{name} Ready")
    cluster_ip = kube.get_json("service", "echo", namespace=namespace)["spec"]["clusterIP"]
    assert cluster_ip.startswith("10.96."), cluster_ip

    seen: set[str] = set()

    def both_answered() -> bool:
        res = kube.kubectl(
            "exec",
            "client",
            "--",
            "/omni-probe",
            "get",
            f"{cluster_ip}:80",
            namespace=namespace,
            check=False,
        )
        if res.returncode == 0:
            seen.update(re.findall(r"hello from (\S+)", res.stdout))
        return seen == {"backend-a", "backend-b"}

    eventually(both_answered, timeout=90, interval=0.1, what=f"answers from both via {cluster_ip}")
    # And by name, as pods find Services in any cluster: the cluster's DNS (CoreDNS on the
    # node) answers the full name and, through the pod's search path, the short one.
    for host in (f"echo.{namespace}.svc.cluster.local", "echo"):
        res = kube.kubectl(
            "exec", "client", "--", "/omni-probe", "get", f"{host}:80", namespace=namespace
        )  # fmt: skip
        assert re.search(r"hello from backend-[ab]", res.stdout), res.stdout
    # A Service that does not exist is no such host, at once.
    missing = kube.kubectl(
        "exec", "client", "--", "/omni-probe", "get",
        f"nothing-here.{namespace}.svc.cluster.local:80", namespace=namespace, check=False,
    )  # fmt: skip
    assert missing.returncode != 0
    assert "no such host" in missing.stdout + missing.stderr
    # The client's own traffic went through kube-proxy's rules: the backends saw it
    # coming from the node's bridge (masqueraded), not from the client's address.
    client_ip = kube.get_json("pod", "client", namespace=namespace)["status"]["podIP"]
    backend_log = kube.kubectl("logs", "backend-a", namespace=namespace).stdout
    assert "connection from" in backend_log
    assert client_ip not in backend_log


def test_a_pod_reaches_the_apiserver_as_its_service_account(
    kube: Kube, real_node: RealNode, namespace: str, eventually: Eventually
) -> None:
    kube.apply(probe_pod(real_node, "whoami", "whoami"), namespace)

    def finished() -> str:
        phase = pod_phase(kube, namespace, "whoami")
        assert phase != "Failed", kube.kubectl("logs", "whoami", namespace=namespace).stdout
        return phase if phase == "Succeeded" else ""

    eventually(finished, timeout=60, what="whoami Succeeded")
    logs = kube.kubectl("logs", "whoami", namespace=namespace).stdout
    # TLS verified against the cluster CA for kubernetes.default.svc at 10.96.0.1:443,
    # and the pod's projected token accepted.
    assert logs.strip() == f"authenticated as system:serviceaccount:{namespace}:default"


def test_port_forward_reaches_a_pod_on_the_node_from_the_host(
    kube: Kube,
    real_node: RealNode,
    namespace: str,
    eventually: Eventually,
    port_forwards: PortForwards,
) -> None:
    kube.apply(probe_pod(real_node, "server", "serve", "9000", serve_port=9000), namespace)
    eventually(lambda: pod_ready(kube, namespace, "server"), timeout=60, what="server Ready")
    local_port = port_forwards.start(namespace, "pod/server", 9000)

    def answer() -> str:
        with socket.create_connection(("127.0.0.1", local_port), timeout=10) as conn:
            conn.settimeout(10)
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
        return data.decode()

    assert answer() == "hello from server\n"
    assert answer() == "hello from server\n"  # a second connection on the same forward


def test_a_unix_socket_from_the_host_reaches_a_pod_on_the_node(
    kube: Kube, real_node: RealNode, namespace: str, eventually: Eventually
) -> None:
    """RealNode.unix_socket_to: what the rollout test's clients connect through."""
    kube.apply(probe_pod(real_node, "server", "serve", "9000", serve_port=9000), namespace)
    eventually(lambda: pod_ready(kube, namespace, "server"), timeout=60, what="server Ready")
    pod_ip = kube.get_json("pod", "server", namespace=namespace)["status"]["podIP"]
    with real_node.unix_socket_to(pod_ip, 9000) as path:

        def answer() -> str:
            with socket.socket(socket.AF_UNIX) as conn:
                conn.settimeout(10)
                conn.connect(path)
                data = b""
                while chunk := conn.recv(4096):
                    data += chunk
            return data.decode()

        assert answer() == "hello from server\n"
        assert answer() == "hello from server\n"  # each connection a fresh one to the pod
    assert not Path(path).exists()


def test_loading_a_rebuilt_image_drops_the_old_build_from_the_node(
    real_node: RealNode, tmp_path: Path
) -> None:
    """The node's containerd store outlives the suite (a warm run imports nothing), so
    each load of a rebuilt image removes the build it replaces: runtime images are GBs."""
    podman = shutil.which("podman")
    assert podman is not None, "podman is not on PATH"
    image = "omni-operator.test/rebuilt:1"

    def build(content: str) -> None:
        (tmp_path / "f").write_text(content)
        with tarfile.open(tmp_path / "root.tar", "w") as tar:
            tar.add(tmp_path / "f", arcname="f")
        subprocess.run(
            [podman, "import", str(tmp_path / "root.tar"), image],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def refs_and_digests() -> dict[str, str]:
        out = real_node.ctr("images", "ls").stdout.splitlines()[1:]
        return {line.split()[0]: line.split()[2] for line in out}

    try:
        build("first")
        assert "imported" in real_node.load_image(image)
        first = refs_and_digests()
        build("second")
        assert "imported" in real_node.load_image(image)
        second = refs_and_digests()
        assert first[image] != second[image]
        # Nothing names the first build any more, and every other image is still there.
        assert first[image] not in second.values(), second
        others = {ref for ref, digest in first.items() if digest != first[image]}
        assert others <= set(second), (first, second)

        # A build on top of the second: its lower layer is on the node already, so only
        # the new layer (with the image's config and manifest) is sent, and the image
        # containerd makes of it is whole.
        (tmp_path / "g").write_text("third")
        (tmp_path / "Containerfile").write_text(f"FROM {image}\nCOPY g /g\n")
        subprocess.run(
            [podman, "build", "--quiet", "-t", image, str(tmp_path)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        loaded = real_node.load_image(image)
        assert "imported" in loaded
        assert "1 blob(s) the node had already" in loaded, loaded
        (row,) = [
            line.split()
            for line in real_node.ctr("images", "check").stdout.splitlines()
            if line.split()[:1] == [image]
        ]
        assert "complete" in row, row
    finally:
        subprocess.run([podman, "rmi", "--force", image], capture_output=True, timeout=60)
        left = refs_and_digests()
        mine = [ref for ref, digest in left.items() if digest == left.get(image)]
        if mine:
            real_node.ctr("images", "rm", *mine)


# Image builds beside the tests (podman, buildah) mount and unmount under these.
OTHERS_MOUNTS = ("/var/lib/containers/", "/run/containers/")


def _mount_points() -> set[str]:
    with open("/proc/self/mountinfo") as fh:
        points = {line.split()[4] for line in fh}
    return {p for p in points if not p.startswith(OTHERS_MOUNTS)}


def _processes_in(netns: str, mntns: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/net") == netns or (
                os.readlink(f"/proc/{entry}/ns/mnt") == mntns
            ):
                found.append(int(entry))
        except OSError:
            continue  # exited meanwhile
    return found


def _alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (which has exited and waits only to be reaped)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdlines_naming(*paths: str) -> list[str]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(p in cmdline for p in paths):
            found.append(f"{proc.info['pid']}: {cmdline}")
    return found


def test_stop_leaves_nothing_of_the_node_running_or_mounted(
    real_node: RealNode, controlplane_bin_dir: Path, tmp_path: Path, eventually: Eventually
) -> None:
    """A control plane with a node of its own (beside the session's): after a pod ran on
    it, stop ends every process of the node's namespaces (shims, pause, containers,
    socat's children) and leaves no mount, cgroup or socket behind."""
    mounts_before = _mount_points()
    state_dir = tmp_path / "cp"
    script = [sys.executable, str(CONTROLPLANE / "controlplane.py")]
    started = subprocess.run(
        [
            *script,
            "start",
            "--node",
            "on",
            "--bin-dir",
            str(controlplane_bin_dir),
            "--state-dir",
            str(state_dir),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    stopped: subprocess.CompletedProcess[str] | None = None
    try:
        assert started.returncode == 0, started.stderr[-4000:]
        state = json.loads((state_dir / "state.json").read_text())
        node = state["node"]
        assert node["enabled"], node
        kubectl = [str(controlplane_bin_dir / "kubectl"), f"--kubeconfig={state['kubeconfig']}"]
        pod = probe_pod(real_node, "sleeper", "sleep")
        pod["spec"]["containers"][0]["image"] = node["probe_image"]
        subprocess.run(
            [*kubectl, "apply", "-f", "-"],
            input=json.dumps(pod),
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )

        def running() -> bool:
            res = subprocess.run(
                [*kubectl, "get", "pod", "sleeper", "-o", "jsonpath={.status.phase}"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            return res.stdout == "Running"

        eventually(running, timeout=60, what="sleeper Running on the lifecycle node")
        # Containers have namespaces of their own, but all descend from the
        # supervisor: shims daemonize to it, pid 1 of the node's pid namespace;
        # unshare itself entered the node's network and mount namespaces.
        unshare = next(p["pid"] for p in state["node_procs"] if p["name"] == "node-unshare")
        supervisor = psutil.Process(node["supervisor_pid"])
        wanted = {
            "containerd", "kubelet", "kube-proxy", "cluster-dns", "socat", "pause", "omni-probe"
        }  # fmt: skip

        def all_there() -> list[psutil.Process]:
            procs = [psutil.Process(unshare), supervisor, *supervisor.children(recursive=True)]
            names = {p.name() for p in procs}
            # What must be gone afterwards was really there.
            assert wanted <= names, sorted(names)
            return procs

        inside = eventually(all_there, timeout=30, what="the node's processes")
        seen = {p.pid: " ".join(p.cmdline()) for p in inside}
        assert {p.pid for p in inside} >= set(_processes_in(node["netns"], node["mntns"]))
        assert any("containerd-shim" in c for c in seen.values()), seen
        assert Path(node["sock_dir"]).is_dir()
        cgroup_dirs = [
            m / node["cgroup_root"].lstrip("/")
            for m in map(Path, ("/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids"))
        ]
        assert all(d.is_dir() for d in cgroup_dirs)
        stopped = subprocess.run(
            [*script, "stop", "--state-dir", str(state_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        if stopped is None:
            subprocess.run([*script, "stop", "--state-dir", str(state_dir)], timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert _processes_in(node["netns"], node["mntns"]) == []
    assert [f"{p.pid} {seen[p.pid]}" for p in inside if _alive(p)] == []
    assert _cmdlines_naming(str(state_dir), node["sock_dir"]) == []
    assert _mount_points() - mounts_before == set()
    assert not Path(node["sock_dir"]).exists()
    assert [d for d in cgroup_dirs if d.exists()] == []
