#!/usr/bin/env python3
"""The real node's supervisor: pid 1 of the node's own network, mount and pid namespaces.

    unshare --net --mount --pid --fork --mount-proc --propagation private \\
        python3 node_supervisor.py SUPERVISOR.json

Made by realnode.write_configs. Inside the fresh namespaces it puts tmpfs over /run,
/var/lib and /var/log (containerd's state, runc's, the pods' netns files, CNI's cache, the
kubelet's root dir and log links: nothing lands on the machine's disk), shows the kubelet
the kernel settings it wants by bind-mounting files over those /proc/sys entries (nothing
machine-wide changes), brings up lo with the node's address, and runs in order: the
node-side socat forwarders, containerd, the kubelet, kube-proxy and the cluster's DNS
(CoreDNS on the node's address). SIGTERM stops them in
reverse, removes the pods (their shims and containers) and the node's cgroups; whatever
is left is killed, and the namespaces die with this process.

A component that exits is fatal: the supervisor stops the rest and exits 1, so
controlplane.py reports the node as down with the logs. Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

# Beside this file, which is on sys.path when run as a script.
import realnode

# What the kubelet checks with protectKernelDefaults (and would otherwise write).
KERNEL_SETTINGS = {
    "vm/overcommit_memory": "1",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
}
STOP_GRACE_S = 10.0
POLL_S = 0.1


class Fatal(Exception):
    pass


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} node-supervisor: {msg}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.logs = Path(cfg["logs"])
        self.bin: dict[str, str] = cfg["bin"]
        self.children: dict[str, int] = {}  # name -> pid, in start order
        self.exited: dict[int, int] = {}  # pid -> wait status
        self.stopping = False
        self.env = {
            **os.environ,
            # containerd finds its shim on PATH.
            "PATH": f"{Path(self.bin['containerd']).parent}:{os.environ.get('PATH', '/bin')}",
        }
        self.lock_fh: TextIO | None = None

    # --- helpers ---------------------------------------------------------------

    def run(
        self, *cmd: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(
            list(cmd), capture_output=True, text=True, env=self.env, timeout=timeout
        )
        if check and res.returncode != 0:
            raise Fatal(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()}")
        return res

    def spawn(self, name: str, cmd: list[str]) -> None:
        with open(self.logs / f"{name}.log", "ab") as fh:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, env=self.env
            )
        self.children[name] = proc.pid
        log(f"started {name} (pid {proc.pid})")

    def reap(self) -> None:
        """Collect every exited child: as pid 1 this process also inherits the
        namespace's orphans (containerd's shims daemonize)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.exited[pid] = status

    def dead_child(self) -> str | None:
        self.reap()
        for name, pid in self.children.items():
            if pid in self.exited:
                return f"{name} exited ({describe(self.exited[pid])})"
        return None

    def wait_for(self, what: str, check: Any, timeout_s: float = 60) -> None:
        t0 = time.monotonic()
        while True:
            if self.stopping:
                raise Fatal(f"stopped while waiting for {what}")
            if dead := self.dead_child():
                raise Fatal(f"{dead} while waiting for {what}")
            if check():
                log(f"{what}: ok after {time.monotonic() - t0:.1f}s")
                return
            if time.monotonic() - t0 > timeout_s:
                raise Fatal(f"timed out after {timeout_s:.0f}s waiting for {what}")
            time.sleep(POLL_S)

    def crictl(
        self, *args: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        sock = f"unix://{self.cfg['containerd_sock']}"
        return self.run(
            self.bin["crictl"],
            f"--runtime-endpoint={sock}",
            f"--image-endpoint={sock}",
            "--timeout=30s",
            *args,
            check=check,
            timeout=timeout,
        )

    def ctr(
        self, *args: str, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return self.run(
            self.bin["ctr"],
            f"--address={self.cfg['containerd_sock']}",
            "--namespace=k8s.io",
            *args,
            check=check,
            timeout=timeout,
        )

    # --- setup -------------------------------------------------------------------

    def setup_mounts(self) -> None:
        for target in ("/run", "/var/lib", "/var/log"):
            self.run("mount", "-t", "tmpfs", "-o", "mode=755,size=1g", "omni-node", target)
        settings = Path(self.cfg["node_dir"]) / "kernel-settings"
        settings.mkdir(exist_ok=True)
        for key, value in KERNEL_SETTINGS.items():
            src = settings / key.replace("/", ".")
            src.write_text(value + "\n")
            self.run("mount", "--bind", str(src), f"/proc/sys/{key}")
            self.run("mount", "-o", "remount,bind,ro", str(src), f"/proc/sys/{key}", check=False)

    def setup_network(self) -> None:
        self.run("ip", "link", "set", "lo", "up")
        self.run("ip", "addr", "add", f"{self.cfg['node_address']}/32", "dev", "lo")

    def setup_cgroups(self) -> None:
        root = self.cfg["cgroup_root"].lstrip("/")
        for mnt in realnode.cgroup_mounts():
            d = mnt / root
            d.mkdir(exist_ok=True)
            # A new v1 cpuset starts empty and takes no tasks until given its parent's.
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (mnt / name).exists() and not (d / name).read_text().strip():
                    (d / name).write_text((mnt / name).read_text())

    def containerd_root(self) -> str:
        """The shared root when no other node holds it, else a private one (cold images)."""
        lock = Path(self.cfg["containerd_lock"])
        lock.parent.mkdir(parents=True, exist_ok=True)
        fh = open(lock, "w")  # noqa: SIM115 - held for this process's life
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            private = Path(self.cfg["node_dir"]) / "containerd-root"
            log(f"{self.cfg['containerd_root']} is in use by another node; using {private}")
            return str(private)
        self.lock_fh = fh
        return str(self.cfg["containerd_root"])

    def import_images(self) -> None:
        for img in self.cfg["images"]:
            res = self.crictl("inspecti", "-o", "json", img["ref"], check=False)
            if res.returncode == 0 and json.loads(res.stdout)["status"]["id"] == img["id"]:
                continue
            t0 = time.monotonic()
            self.ctr("images", "import", "--local", img["archive"])
            log(f"imported {img['ref']} in {time.monotonic() - t0:.1f}s")

    def remove_pods(self) -> None:
        """Sandboxes a previous run left in the shared containerd root (or this run's, at
        stop) go with their containers, shims and network namespaces."""
        pods = self.crictl("pods", "-q", check=False, timeout=30)
        if pods.returncode == 0 and pods.stdout.strip():
            res = self.crictl("rmp", "--force", "--all", check=False, timeout=90)
            log(f"removed pods: {res.stdout.strip() or res.stderr.strip()}")

    def start(self) -> None:
        cfg = self.cfg
        self.setup_mounts()
        self.setup_network()
        self.setup_cgroups()
        sock_dir = Path(cfg["sock_dir"])
        addr = cfg["node_address"]
        self.spawn(
            "node-apiserver-forward",
            [
                "socat",
                f"TCP-LISTEN:{cfg['apiserver_node_port']},bind={addr},fork,reuseaddr",
                f"UNIX-CONNECT:{sock_dir / 'apiserver.sock'}",
            ],
        )
        kubelet_sock = sock_dir / "kubelet.sock"
        self.spawn(
            "node-kubelet-forward",
            [
                "socat",
                f"UNIX-LISTEN:{kubelet_sock},fork,unlink-early,mode=600",
                f"TCP:{addr}:{cfg['kubelet_port']}",
            ],
        )
        root = self.containerd_root()
        self.spawn(
            "containerd",
            [self.bin["containerd"], f"--config={cfg['containerd_config']}", f"--root={root}"],
        )
        self.wait_for(
            "containerd CRI",
            lambda: (
                Path(cfg["containerd_sock"]).exists()
                and self.crictl("info", check=False, timeout=10).returncode == 0
            ),
        )
        self.remove_pods()
        self.import_images()
        self.wait_for("kubelet forward socket", kubelet_sock.exists, timeout_s=10)
        self.spawn("kubelet", [self.bin["kubelet"], *cfg["kubelet_args"]])
        self.spawn("kube-proxy", [self.bin["kube-proxy"], *cfg["kube_proxy_args"]])
        self.spawn("cluster-dns", [self.bin["cluster-dns"], *cfg["cluster_dns_args"]])
        (Path(cfg["node_dir"]) / "supervisor.ready").write_text(f"{os.getpid()}\n")
        log("node components started")

    # --- stop ----------------------------------------------------------------------

    def terminate(self, name: str, grace_s: float = STOP_GRACE_S) -> None:
        pid = self.children.get(name)
        if pid is None:
            return
        self.reap()
        if pid in self.exited:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while pid not in self.exited and time.monotonic() < deadline:
            time.sleep(0.05)
            self.reap()
        if pid not in self.exited:
            log(f"{name} ignored SIGTERM for {grace_s:.0f}s; killing it")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def kill_the_rest(self) -> None:
        me = os.getpid()
        for _ in range(50):
            left = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
            self.reap()
            left = [p for p in left if p not in self.exited and Path(f"/proc/{p}").exists()]
            if not left:
                return
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def stop(self) -> None:
        t0 = time.monotonic()
        # The kubelet first, so it does not restart what is being removed.
        self.terminate("kubelet")
        self.terminate("kube-proxy")
        self.terminate("cluster-dns")
        if "containerd" in self.children and self.children["containerd"] not in self.exited:
            with contextlib.suppress(subprocess.TimeoutExpired, Fatal):
                self.remove_pods()
        for name in ("containerd", "node-kubelet-forward", "node-apiserver-forward"):
            self.terminate(name)
        self.kill_the_rest()
        deadline = time.monotonic() + 5
        while (
            left := realnode.remove_cgroups(self.cfg["cgroup_root"])
        ) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            log(f"cgroups left: {'; '.join(left)}")
        log(f"stopped in {time.monotonic() - t0:.1f}s")


def describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"code {os.waitstatus_to_exitcode(status)}"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    if os.getpid() != 1:
        log("must run as pid 1 of its own pid namespace (unshare --pid --fork)")
        return 2
    sup = Supervisor(json.loads(Path(argv[1]).read_text()))

    def on_signal(signo: int, _frame: object) -> None:
        sup.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    try:
        sup.start()
        while not sup.stopping:
            if dead := sup.dead_child():
                raise Fatal(dead)
            time.sleep(0.2)
        log("SIGTERM: stopping")
    except Fatal as exc:
        if not sup.stopping:
            log(f"failed: {exc}")
            code = 1
    except Exception as exc:  # the log must say why the node went away
        log(f"failed: {type(exc).__name__}: {exc}")
        code = 1
    sup.stop()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
