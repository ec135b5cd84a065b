#!/usr/bin/env python3
"""Run a local Kubernetes control plane for the cluster tests.

    controlplane.py start [--state-dir DIR] [--bin-dir DIR] [--node auto|on|off] [--timeout S]
    controlplane.py stop  [--state-dir DIR]
    controlplane.py status [--state-dir DIR]
    controlplane.py logs [COMPONENT] [--state-dir DIR] [--lines N]
    controlplane.py load-image IMAGE [--state-dir DIR]

`start` runs etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
kwok (two fake nodes) on 127.0.0.1, and a real node (realnode.py: kubelet,
kube-proxy, containerd in namespaces of its own) where it can run; waits until
all are healthy and prints the admin kubeconfig path as its last stdout line.
`--node auto` (the default, or $OMNI_REAL_NODE) starts the real node when this
machine can run it and says why not otherwise; `on` fails instead; `off` never
starts it. `stop` ends exactly the processes `start` recorded. Both are no-ops
when there is nothing to do; a `start` over an unhealthy run replaces it. A
component that exits is reported with the tail of its log: by `start` while
starting, by `status` after. `load-image` copies an image from podman's storage
into the real node's containerd (nothing when it has that image id already).

State dir (default $OMNI_CONTROLPLANE_DIR, else
${OMNI_CACHE_DIR:-~/.cache/omni-operator}/controlplane-run) holds kubeconfig,
token (a bearer token the apiserver accepts, new on every start), state.json
(pids, ports), pki/, etcd-data/ and logs/<component>.log.
Binaries come from --bin-dir, $OMNI_CONTROLPLANE_BIN, or build.sh's bin dir
(run build.sh first); the node's from $OMNI_NODE_BIN or ../node/build.sh's.
Only the Python standard library and openssl are used.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

# Beside this file, which is on sys.path when run as a script.
import realnode

# omni_testkit's port leases, shared with the suites and the benchmarks. The venv has
# testkit/ on its path (scripts/setup.sh); this script runs under any python3 too (standard
# library only), so it puts it there itself.
if str(Path(__file__).resolve().parents[3] / "testkit") not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[3] / "testkit"))
from omni_testkit import port_leases

HERE = Path(__file__).resolve().parent
KWOK_DIR = HERE / "kwok"
STAGE_FILES = (
    "node-initialize.yaml",
    "node-heartbeat.yaml",
    "pod-ready.yaml",
    "pod-complete.yaml",
    "pod-delete.yaml",
)
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
)
NODE_NAMES = ("kwok-cpu-0", "kwok-gpu-0")
# The user of the static bearer token in <state dir>/token (see write_token_auth).
TOKEN_USER = "omni-test-token-admin"

# Kept apart from kwok's pod CIDR so fake pod IPs never look like Service IPs.
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"
# Fake nodes report a loopback address: anything that tries to reach a
# "kubelet" (kubectl logs/exec) then stays on this machine.
NODE_IP = "127.0.0.1"

POLL_INTERVAL_S = 0.25
STOP_GRACE_S = 10.0


class StartError(Exception):
    """The control plane could not be brought up; the message says why."""


def log(msg: str) -> None:
    print(f"controlplane: {msg}", file=sys.stderr, flush=True)


def default_state_dir() -> Path:
    if env := os.environ.get("OMNI_CONTROLPLANE_DIR"):
        return Path(env)
    cache = os.environ.get("OMNI_CACHE_DIR") or str(Path.home() / ".cache" / "omni-operator")
    return Path(cache) / "controlplane-run"


def default_bin_dir() -> Path:
    if env := os.environ.get("OMNI_CONTROLPLANE_BIN"):
        return Path(env)
    out = subprocess.run(
        ["bash", str(HERE / "build.sh"), "--print-bin-dir"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def missing_binaries(bin_dir: Path) -> list[str]:
    return [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]


# --- process bookkeeping -------------------------------------------------


@dataclass
class ProcRecord:
    name: str
    pid: int
    # Kernel start time (clock ticks since boot) from /proc/<pid>/stat: with
    # the pid it identifies the process, so a recycled pid is never signalled.
    starttime: int
    log: str
    # Signal the whole process group: socat's forked children, one per connection,
    # outlive their parent otherwise.
    group: bool = False


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, starttime) of a live pid, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may contain spaces or ')', so split after the last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def is_running(rec: ProcRecord) -> bool:
    st = _proc_stat(rec.pid)
    # A zombie has exited; it only waits for its parent to reap it.
    return st is not None and st[1] == rec.starttime and st[0] not in ("Z", "X")


@dataclass
class State:
    procs: list[ProcRecord] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)
    bin_dir: str = ""
    kubeconfig: str = ""
    # The real node: {"enabled": bool, "reason": why not, and its paths when enabled}.
    node: dict[str, Any] = field(default_factory=dict)
    # Its processes (forwarders, the supervisor), apart from the control plane's:
    # they stop first, being the apiserver's clients.
    node_procs: list[ProcRecord] = field(default_factory=list)

    def all_procs(self) -> list[ProcRecord]:
        return [*self.procs, *self.node_procs]

    @classmethod
    def load(cls, path: Path) -> State | None:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        return cls(
            procs=[ProcRecord(**p) for p in data["procs"]],
            ports=data["ports"],
            bin_dir=data["bin_dir"],
            kubeconfig=data["kubeconfig"],
            node=data.get("node", {}),
            node_procs=[ProcRecord(**p) for p in data.get("node_procs", [])],
        )

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)


@contextlib.contextmanager
def locked(state_dir: Path) -> Iterator[None]:
    """Serialise start/stop of one state dir across processes."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _wait_gone(proc: ProcRecord, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while is_running(proc):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def terminate(procs: list[ProcRecord], grace_s: float = STOP_GRACE_S) -> None:
    """End each recorded process that is still ours: SIGTERM, then SIGKILL after grace_s.

    One at a time in reverse start order: the apiserver blocks its shutdown
    retrying etcd if etcd goes first, and clients go before the apiserver.
    """
    for p in reversed(procs):
        if not is_running(p):
            if p.group:
                _killpg(p.pid, signal.SIGKILL)
            continue
        _signal(p, signal.SIGTERM)
        if _wait_gone(p, grace_s):
            if p.group:
                _killpg(p.pid, signal.SIGKILL)
            continue
        log(f"{p.name} (pid {p.pid}) ignored SIGTERM for {grace_s:.0f}s; killing it")
        _signal(p, signal.SIGKILL)
        _wait_gone(p, 5)


def _killpg(pgid: int, signo: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signo)


def _signal(p: ProcRecord, signo: int) -> None:
    if p.group:
        _killpg(p.pid, signo)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signo)


# --- certificates and kubeconfig ------------------------------------------


def _openssl(*args: str) -> None:
    res = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise StartError(f"openssl {' '.join(args)} failed:\n{res.stderr}")


def _ec_key(path: Path) -> None:
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path)
    )


def _sign(pki: Path, name: str, subject: str, extensions: str) -> None:
    """Create pki/<name>.key and a cert for it signed by pki/ca."""
    _ec_key(pki / f"{name}.key")
    (pki / f"{name}.ext").write_text(f"[ext]\n{extensions}\n")
    _openssl(
        "req",
        "-new",
        "-key",
        str(pki / f"{name}.key"),
        "-subj",
        subject,
        "-out",
        str(pki / f"{name}.csr"),
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        str(pki / f"{name}.csr"),
        "-CA",
        str(pki / "ca.crt"),
        "-CAkey",
        str(pki / "ca.key"),
        "-set_serial",
        str(secrets.randbits(63)),
        "-days",
        "3650",
        "-extfile",
        str(pki / f"{name}.ext"),
        "-extensions",
        "ext",
        "-out",
        str(pki / f"{name}.crt"),
    )


def make_pki(pki: Path) -> None:
    pki.mkdir(parents=True, exist_ok=True)
    _ec_key(pki / "ca.key")
    (pki / "ca.cnf").write_text(
        "[req]\ndistinguished_name = dn\nprompt = no\n"
        "[dn]\nCN = omni-operator-test-ca\n"
        "[ca]\nbasicConstraints = critical,CA:TRUE\n"
        "keyUsage = critical,keyCertSign,cRLSign,digitalSignature\n"
        "subjectKeyIdentifier = hash\n"
    )
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        str(pki / "ca.key"),
        "-config",
        str(pki / "ca.cnf"),
        "-extensions",
        "ca",
        "-days",
        "3650",
        "-out",
        str(pki / "ca.crt"),
    )
    _sign(
        pki,
        "apiserver",
        "/CN=kube-apiserver",
        "basicConstraints = CA:FALSE\nkeyUsage = critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage = serverAuth\n"
        f"subjectAltName = IP:127.0.0.1,IP:10.96.0.1,IP:{realnode.NODE_ADDRESS},"
        "DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local",
    )
    # system:masters is bound to cluster-admin by the bootstrap RBAC policy.
    _sign(
        pki,
        "admin",
        "/O=system:masters/CN=omni-operator-test-admin",
        "basicConstraints = CA:FALSE\nkeyUsage = critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage = clientAuth",
    )
    # The real node's: the kubelet's serving and client certificates (the Node
    # authorizer knows system:node:<name>), kube-proxy's (bound to
    # system:node-proxier by the bootstrap policy), and the apiserver's client
    # certificate for the kubelet.
    client = (
        "basicConstraints = CA:FALSE\nkeyUsage = critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage = clientAuth"
    )
    _sign(
        pki,
        "kubelet-serving",
        f"/CN={realnode.NODE_NAME}",
        "basicConstraints = CA:FALSE\nkeyUsage = critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage = serverAuth\n"
        f"subjectAltName = IP:127.0.0.1,IP:{realnode.NODE_ADDRESS},DNS:{realnode.NODE_NAME}",
    )
    _sign(pki, "kubelet-client", f"/O=system:nodes/CN=system:node:{realnode.NODE_NAME}", client)
    _sign(pki, "kube-proxy", "/CN=system:kube-proxy", client)
    _sign(pki, "apiserver-kubelet-client", "/CN=kube-apiserver-kubelet-client", client)
    _ec_key(pki / "sa.key")
    _openssl("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def write_token_auth(pki: Path, token_path: Path) -> None:
    """A fresh random bearer token the apiserver accepts (pki/tokens.csv, its
    --token-auth-file), written to token_path for clients that authenticate with a token
    rather than a certificate, such as a kubeconfig exec plugin. Its user is in
    system:masters, as the admin certificate's is: it grants nothing the admin lacks."""
    token = secrets.token_hex(24)
    tokens = pki / "tokens.csv"
    tokens.write_text(f'{token},{TOKEN_USER},{TOKEN_USER},"system:masters"\n')
    tokens.chmod(0o600)
    token_path.write_text(token + "\n")
    token_path.chmod(0o600)


def write_kubeconfig(path: Path, pki: Path, server: str) -> None:
    import base64

    def b64(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    # JSON is valid YAML, and needs no YAML library here.
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "omni-test",
                "cluster": {"server": server, "certificate-authority-data": b64("ca.crt")},
            }
        ],
        "users": [
            {
                "name": "omni-test-admin",
                "user": {
                    "client-certificate-data": b64("admin.crt"),
                    "client-key-data": b64("admin.key"),
                },
            }
        ],
        "contexts": [
            {
                "name": "omni-test",
                "context": {
                    "cluster": "omni-test",
                    "user": "omni-test-admin",
                    "namespace": "default",
                },
            }
        ],
        "current-context": "omni-test",
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


# --- health checks -----------------------------------------------------------


def free_ports(names: list[str]) -> dict[str, int]:
    """Distinct ports for the named components, leased (omni_testkit.port_leases) from
    outside the kernel's ephemeral range: a port chosen by binding 0 and closing could be
    handed to any process's bind(0) or connect() before the component binds it."""
    return dict(zip(names, port_leases.lease_ports(len(names)), strict=True))


# Health probes go to 127.0.0.1 only; an HTTP(S)_PROXY from the environment
# must not capture them.
_NO_PROXY = urllib.request.ProxyHandler({})


def http_ok(url: str, context: ssl.SSLContext | None = None, expect: str | None = None) -> bool:
    handlers: list[urllib.request.BaseHandler] = [_NO_PROXY]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(url, timeout=2) as resp:
            body = resp.read().decode(errors="replace")
            return resp.status == 200 and (expect is None or expect in body)
    except OSError:
        return False


def admin_context(pki: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    return ctx


def insecure_context() -> ssl.SSLContext:
    # The controller manager and scheduler serve /healthz with a self-signed
    # certificate made in memory; the probe is on loopback only.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text[-lines:])


# --- start ------------------------------------------------------------------------


class Starter:
    def __init__(
        self,
        state_dir: Path,
        bin_dir: Path,
        timeout_s: float,
        node_bin_dir: Path | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.bin_dir = bin_dir
        self.timeout_s = timeout_s
        # None: no real node this run.
        self.node_bin_dir = node_bin_dir
        self.pki = state_dir / "pki"
        self.logs = state_dir / "logs"
        self.kubeconfig = state_dir / "kubeconfig"
        self.state = State(bin_dir=str(bin_dir), kubeconfig=str(self.kubeconfig))
        self.popens: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(
        self,
        name: str,
        args: list[str],
        cmd: list[str] | None = None,
        group: bool = False,
        node: bool = False,
    ) -> None:
        log_path = self.logs / f"{name}.log"
        with open(log_path, "ab") as log_fh:
            popen = subprocess.Popen(
                [*(cmd or [str(self.bin_dir / name)]), *args],
                stdin=subprocess.DEVNULL,
                stdout=log_fh,
                stderr=subprocess.STDOUT,
                cwd=self.state_dir,
                # Own session: a Ctrl-C in the terminal that ran `start` does
                # not reach the components; only `stop` ends them.
                start_new_session=True,
            )
        st = _proc_stat(popen.pid)
        self.popens[name] = popen
        (self.state.node_procs if node else self.state.procs).append(
            ProcRecord(name, popen.pid, st[1] if st else -1, str(log_path), group)
        )
        # Recorded at once, so `stop` can clean up even if start dies midway.
        self.state.save(self.state_dir / "state.json")

    def check_alive(self) -> None:
        for name, popen in self.popens.items():
            code = popen.poll()
            if code is not None:
                log_path = self.logs / f"{name}.log"
                raise StartError(
                    f"{name} exited with code {code} during start; "
                    f"last lines of {log_path}:\n{tail(log_path)}"
                )

    def wait_for(
        self, what: str, check: Callable[[], bool], timeout_s: float | None = None
    ) -> None:
        t0 = time.monotonic()
        deadline = t0 + (timeout_s or self.timeout_s)
        while True:
            self.check_alive()
            if check():
                log(f"{what}: ok after {time.monotonic() - t0:.1f}s")
                return
            if time.monotonic() > deadline:
                logs = "\n".join(
                    f"--- {p.name} ---\n{tail(Path(p.log), 15)}" for p in self.state.all_procs()
                )
                raise StartError(
                    f"timed out after {timeout_s or self.timeout_s:.0f}s waiting for {what}\n{logs}"
                )
            time.sleep(POLL_INTERVAL_S)

    def kubectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )

    def nodes_ready(self) -> bool:
        res = self.kubectl("get", "nodes", "-o", "json")
        if res.returncode != 0:
            return False
        ready = {
            n["metadata"]["name"]
            for n in json.loads(res.stdout)["items"]
            for c in n.get("status", {}).get("conditions", [])
            if c["type"] == "Ready" and c["status"] == "True"
        }
        return set(NODE_NAMES) <= ready

    def start_node(self, node_bin_dir: Path) -> None:
        ports = free_ports(["kubelet"])
        self.state.ports.update(ports)
        sock_dir = realnode.socket_dir(self.state_dir)
        shutil.rmtree(sock_dir, ignore_errors=True)
        sock_dir.mkdir(mode=0o700, parents=True)
        lay = realnode.NodeLayout(
            state_dir=self.state_dir,
            node_dir=self.state_dir / "node",
            sock_dir=sock_dir,
            logs=self.logs,
            pki=self.pki,
            bin_dir=self.bin_dir,
            node_bin_dir=node_bin_dir,
            kubelet_port=ports["kubelet"],
            apiserver_port=self.state.ports["apiserver"],
            cgroup_root=realnode.cgroup_root(self.state_dir),
        )
        shutil.rmtree(lay.node_dir, ignore_errors=True)
        images = realnode.node_images(node_bin_dir)
        config = realnode.write_configs(lay, images)
        self.state.node = {
            "enabled": True,
            "name": realnode.NODE_NAME,
            "node_dir": str(lay.node_dir),
            "sock_dir": str(sock_dir),
            "containerd_sock": str(lay.containerd_sock),
            "cgroup_root": lay.cgroup_root,
            "ctr": str(node_bin_dir / "ctr"),
            "crictl": str(node_bin_dir / "crictl"),
            "probe_image": images[1].ref,
            "pause_image": images[0].ref,
        }
        socat = [shutil.which("socat") or "socat"]
        # Host side of the two forwarders (the node side runs under the supervisor).
        self.spawn(
            "apiserver-node-forward",
            [
                f"UNIX-LISTEN:{sock_dir / 'apiserver.sock'},fork,unlink-early,mode=600",
                f"TCP:127.0.0.1:{lay.apiserver_port}",
            ],
            cmd=socat,
            node=True,
            group=True,
        )
        self.spawn(
            "kubelet-host-forward",
            [
                f"TCP-LISTEN:{lay.kubelet_port},bind=127.0.0.1,fork,reuseaddr",
                f"UNIX-CONNECT:{sock_dir / 'kubelet.sock'}",
            ],
            cmd=socat,
            node=True,
            group=True,
        )
        self.spawn(
            "node-unshare",
            [
                "--net",
                "--mount",
                "--pid",
                "--fork",
                "--mount-proc",
                "--propagation",
                "private",
                # unshare itself ignores SIGTERM; should it die, the supervisor stops.
                "--kill-child=SIGTERM",
                sys.executable,
                str(HERE / "node_supervisor.py"),
                str(config),
            ],
            cmd=[shutil.which("unshare") or "unshare"],
            node=True,
        )
        unshare = self.state.node_procs[-1]
        # The supervisor (pid 1 inside) is what stop signals: it stops the node in order.
        t0 = time.monotonic()
        while True:
            self.check_alive()
            children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children")
            with contextlib.suppress(OSError):
                if kids := children.read_text().split():
                    pid = int(kids[0])
                    st = _proc_stat(pid)
                    if st is not None:
                        self.state.node_procs.append(
                            ProcRecord("node", pid, st[1], str(self.logs / "node-unshare.log"))
                        )
                        self.state.save(self.state_dir / "state.json")
                        break
            if time.monotonic() - t0 > 10:
                raise StartError("unshare started no node supervisor within 10s")
            time.sleep(0.01)
        self.state.node["supervisor_pid"] = pid
        self.state.node["netns"] = os.readlink(f"/proc/{pid}/ns/net")
        self.state.node["mntns"] = os.readlink(f"/proc/{pid}/ns/mnt")
        self.state.save(self.state_dir / "state.json")

    def node_object(self) -> dict[str, Any] | None:
        res = self.kubectl("get", "node", realnode.NODE_NAME, "-o", "json")
        if res.returncode != 0:
            return None
        node: dict[str, Any] = json.loads(res.stdout)
        return node

    def finish_node(self) -> None:
        self.wait_for(
            f"node {realnode.NODE_NAME} registered", lambda: self.node_object() is not None
        )
        addresses = [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": realnode.NODE_NAME},
        ]
        patched = self.kubectl(
            "patch",
            "node",
            realnode.NODE_NAME,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": {"addresses": addresses}}),
        )
        if patched.returncode != 0:
            raise StartError(f"patching {realnode.NODE_NAME}'s addresses failed:\n{patched.stderr}")
        for obj in realnode.kubernetes_endpoints():
            applied = subprocess.run(
                [
                    str(self.bin_dir / "kubectl"),
                    f"--kubeconfig={self.kubeconfig}",
                    "apply",
                    "-f",
                    "-",
                ],
                input=json.dumps(obj),
                capture_output=True,
                text=True,
                timeout=30,
            )
            if applied.returncode != 0:
                raise StartError(
                    f"writing the kubernetes Service's endpoints failed:\n{applied.stderr}"
                )

        def ready() -> bool:
            node = self.node_object()
            if node is None:
                return False
            status = node.get("status", {})
            return any(
                c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", [])
            ) and {"type": "InternalIP", "address": "127.0.0.1"} in status.get("addresses", [])

        self.wait_for(f"node {realnode.NODE_NAME} Ready", ready)

    def run(self) -> None:
        for sub in ("etcd-data", "pki", "logs"):
            shutil.rmtree(self.state_dir / sub, ignore_errors=True)
        self.logs.mkdir(parents=True)
        t_start = time.monotonic()
        make_pki(self.pki)
        ports = free_ports(
            ["etcd_client", "etcd_peer", "apiserver", "controller_manager", "scheduler", "kwok"]
        )
        self.state.ports = ports
        server = f"https://127.0.0.1:{ports['apiserver']}"
        write_kubeconfig(self.kubeconfig, self.pki, server)
        write_token_auth(self.pki, self.state_dir / "token")
        pki = self.pki

        etcd_client = f"http://127.0.0.1:{ports['etcd_client']}"
        etcd_peer = f"http://127.0.0.1:{ports['etcd_peer']}"
        self.spawn(
            "etcd",
            [
                "--name=omni-test",
                f"--data-dir={self.state_dir / 'etcd-data'}",
                f"--listen-client-urls={etcd_client}",
                f"--advertise-client-urls={etcd_client}",
                f"--listen-peer-urls={etcd_peer}",
                f"--initial-advertise-peer-urls={etcd_peer}",
                f"--initial-cluster=omni-test={etcd_peer}",
                # Test data is thrown away on every start; durability only costs time.
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )
        self.wait_for(
            "etcd /health", lambda: http_ok(f"{etcd_client}/health", expect='"health":"true"')
        )

        self.spawn(
            "kube-apiserver",
            [
                f"--etcd-servers={etcd_client}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={ports['apiserver']}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--token-auth-file={pki / 'tokens.csv'}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # Node: what the real node's kubelet may read and write.
                "--authorization-mode=Node,RBAC",
                f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
                # The only address of every node the apiserver can dial is 127.0.0.1,
                # the InternalIP (the real node's is its host-side forwarder).
                "--kubelet-preferred-address-types=InternalIP",
                "--allow-privileged=true",
                # A loopback address is rejected in Endpoints; with the real node,
                # start writes the node-side forwarder there instead.
                "--endpoint-reconciler-type=none",
                f"--cert-dir={pki}",
                "--profiling=false",
            ],
        )
        ctx = admin_context(pki)
        self.wait_for("kube-apiserver /readyz", lambda: http_ok(f"{server}/readyz", ctx, "ok"))
        if self.node_bin_dir is not None:
            # Early: containerd and its image imports overlap the other components' start.
            self.start_node(self.node_bin_dir)

        kube_client = [
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1",
            # One instance only: leader election would just delay the start.
            "--leader-elect=false",
            # The apiserver runs without a front proxy, so there is no
            # request-header CA to look up; looking only logs errors.
            "--authentication-skip-lookup=true",
        ]
        self.spawn(
            "kube-controller-manager",
            [
                *kube_client,
                f"--secure-port={ports['controller_manager']}",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--controllers=*",
                # kwok renews the nodes' heartbeats (kwok/node-heartbeat.yaml), but on a
                # loaded 2-core machine a renewal can come late; a node taken for
                # NotReady has every pod on it marked not ready for good.
                "--node-monitor-grace-period=5m",
                # Its default is under /usr/libexec, which it would create.
                f"--flex-volume-plugin-dir={self.state_dir / 'flexvolume'}",
            ],
        )
        self.spawn("kube-scheduler", [*kube_client, f"--secure-port={ports['scheduler']}"])

        stages = self.state_dir / "kwok-stages.yaml"
        stages.write_text("\n---\n".join((KWOK_DIR / f).read_text() for f in STAGE_FILES))
        self.spawn(
            "kwok",
            [
                f"--kubeconfig={self.kubeconfig}",
                f"--config={stages}",
                # Only the fake nodes (nodes.yaml): the real node's status is its kubelet's.
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                f"--server-address=127.0.0.1:{ports['kwok']}",
                f"--node-ip={NODE_IP}",
                f"--cidr={POD_CIDR}",
            ],
        )
        insecure = insecure_context()
        self.wait_for(
            "kube-controller-manager /healthz",
            lambda: http_ok(
                f"https://127.0.0.1:{ports['controller_manager']}/healthz", insecure, "ok"
            ),
        )
        self.wait_for(
            "kube-scheduler /healthz",
            lambda: http_ok(f"https://127.0.0.1:{ports['scheduler']}/healthz", insecure, "ok"),
        )
        self.wait_for("kwok /healthz", lambda: http_ok(f"http://127.0.0.1:{ports['kwok']}/healthz"))

        applied = self.kubectl("apply", "-f", str(KWOK_DIR / "nodes.yaml"))
        if applied.returncode != 0:
            raise StartError(f"kubectl apply nodes.yaml failed:\n{applied.stderr}")
        self.wait_for(f"nodes {', '.join(NODE_NAMES)} Ready", self.nodes_ready)
        if self.node_bin_dir is not None:
            self.finish_node()
        # The serviceaccount controller creating this proves the controller
        # manager is really working, and pods in "default" need it.
        self.wait_for(
            "serviceaccount default/default",
            lambda: (
                self.kubectl("get", "serviceaccount", "default", "-n", "default").returncode == 0
            ),
        )
        log(f"control plane healthy in {time.monotonic() - t_start:.1f}s (apiserver {server})")


def node_ready(state: State) -> bool:
    res = subprocess.run(
        [
            str(Path(state.bin_dir) / "kubectl"),
            f"--kubeconfig={state.kubeconfig}",
            "get",
            "node",
            state.node["name"],
            "-o",
            "jsonpath={.status.conditions[?(@.type=='Ready')].status}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return res.returncode == 0 and res.stdout.strip() == "True"


def healthy(state: State) -> bool:
    if not state.procs or not all(is_running(p) for p in state.all_procs()):
        return False
    pki = Path(state.kubeconfig).parent / "pki"
    try:
        ctx = admin_context(pki)
    except (OSError, ssl.SSLError):
        return False
    if not http_ok(f"https://127.0.0.1:{state.ports['apiserver']}/readyz", ctx, "ok"):
        return False
    return not state.node.get("enabled") or node_ready(state)


def stop_procs(state_dir: Path, state: State) -> None:
    """End the recorded processes, then remove what the node leaves outside its
    namespaces (its cgroups, the socket dir) if its supervisor could not."""
    terminate(state.node_procs)
    terminate(state.procs)
    if state.node.get("enabled"):
        left = realnode.remove_cgroups(state.node["cgroup_root"])
        if left:
            log(f"node cgroups that could not be removed: {'; '.join(left)}")
        realnode.remove_socket_dir(state_dir)


def choose_node(mode: str, bin_dir: Path) -> tuple[Path | None, str]:
    """The node's bin dir when the real node is to start, else None and why not."""
    if mode == "off":
        return None, "the real node is off (--node off or OMNI_REAL_NODE=off)"
    try:
        node_bin_dir = realnode.default_node_bin_dir().resolve()
    except (OSError, subprocess.CalledProcessError) as exc:
        return None, f"cannot locate the node's binaries: {exc}"
    reason = realnode.unavailable_reason(bin_dir, node_bin_dir)
    return (None, reason) if reason else (node_bin_dir, "")


def cmd_start(state_dir: Path, bin_dir: Path | None, timeout_s: float, node_mode: str) -> int:
    state_path = state_dir / "state.json"
    with locked(state_dir):
        bin_dir = (bin_dir or default_bin_dir()).resolve()
        old = State.load(state_path)
        if old is not None:
            if healthy(old) and Path(old.bin_dir) == bin_dir:
                log("already running and healthy")
                print(old.kubeconfig)
                return 0
            # Unhealthy, or started from binaries of other pins: start afresh.
            log("stopping a previous run that is unhealthy or uses other binaries")
            stop_procs(state_dir, old)
            state_path.unlink()

        if missing := missing_binaries(bin_dir):
            log(f"missing binaries in {bin_dir}: {', '.join(missing)} (run {HERE / 'build.sh'})")
            return 2
        node_bin_dir, why_not = choose_node(node_mode, bin_dir)
        if node_bin_dir is None:
            if node_mode == "on":
                log(f"cannot start the real node: {why_not}")
                return 2
            log(f"no real node: {why_not}")
        starter = Starter(state_dir, bin_dir, timeout_s, node_bin_dir)
        starter.state.node = {"enabled": False, "reason": why_not}
        try:
            starter.run()
        except (StartError, KeyboardInterrupt) as exc:
            log(f"start failed: {exc}")
            stop_procs(state_dir, starter.state)
            for popen in starter.popens.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=1)
            with contextlib.suppress(FileNotFoundError):
                state_path.unlink()
            return 1
        starter.state.save(state_path)
    print(starter.kubeconfig)
    return 0


def cmd_stop(state_dir: Path) -> int:
    state_path = state_dir / "state.json"
    with locked(state_dir):
        state = State.load(state_path)
        if state is None:
            log("not running")
            return 0
        running = [p for p in state.all_procs() if is_running(p)]
        log(
            "stopping "
            + (", ".join(f"{p.name} ({p.pid})" for p in running) or "nothing (all exited)")
        )
        t0 = time.monotonic()
        stop_procs(state_dir, state)
        state_path.unlink()
        log(f"stopped in {time.monotonic() - t0:.1f}s")
    return 0


def cmd_status(state_dir: Path) -> int:
    state = State.load(state_dir / "state.json")
    if state is None:
        print("not running")
        return 1
    for p in state.all_procs():
        print(f"{p.name:<24} pid {p.pid:<8} {'running' if is_running(p) else 'EXITED'}")
    for p in state.all_procs():
        if not is_running(p):
            print(f"--- last lines of {p.log} ---\n{tail(Path(p.log), 15)}")
    ok = healthy(state)
    print(f"kubeconfig: {state.kubeconfig}\nhealthy: {ok}")
    if state.node.get("enabled"):
        print(f"real node {state.node['name']} Ready: {node_ready(state)}")
    else:
        print(f"no real node: {state.node.get('reason', 'not recorded')}")
    return 0 if ok else 1


def cmd_logs(state_dir: Path, component: str | None, lines: int) -> int:
    logs = state_dir / "logs"
    names = sorted(p.stem for p in logs.glob("*.log"))
    if component is None:
        print("\n".join(names) if names else f"no logs in {logs}")
        return 0 if names else 1
    if component not in names:
        print(f"no log {component!r}; there are: {', '.join(names)}", file=sys.stderr)
        return 1
    print(tail(logs / f"{component}.log", lines))
    return 0


class ImageError(Exception):
    pass


PODMAN_ID_LABEL = "omni-operator.test/podman-id"


def load_image(state: State, image: str) -> str:
    """Copy image from podman's storage into the real node's containerd under the name a
    pod's `image: <image>` resolves to; nothing when containerd has that image id under
    that name already. Returns what was done."""
    if not state.node.get("enabled"):
        raise ImageError(f"no real node: {state.node.get('reason', 'not started')}")
    podman = shutil.which("podman")
    if podman is None:
        raise ImageError("podman is not on PATH")
    inspect = subprocess.run(
        [podman, "image", "inspect", "--format", "{{.Id}}", image],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if inspect.returncode != 0:
        raise ImageError(f"podman has no image {image}: {inspect.stderr.strip()}")
    image_id = "sha256:" + inspect.stdout.strip().removeprefix("sha256:")
    want = realnode.normalize_ref(image)
    sock = state.node["containerd_sock"]
    ctr = [state.node["ctr"], f"--address={sock}", "--namespace=k8s.io"]

    # podman's id is the digest of its stored config, which `podman save` may rewrite
    # (docker to OCI media types): the id is kept as a label on the imported image.
    label = f'labels."{PODMAN_ID_LABEL}"=={image_id}'

    def ctr_run(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([*ctr, *args], capture_output=True, text=True, **kw)
        if res.returncode != 0:
            raise ImageError(f"ctr {' '.join(args)} failed: {res.stderr.strip()[-2000:]}")
        return res

    def have() -> list[str]:
        return ctr_run("images", "ls", "-q", label, timeout=60).stdout.split()

    def tag(source: str) -> None:
        ctr_run("images", "tag", "--force", source, want, timeout=60)
        ctr_run("images", "label", want, f"{PODMAN_ID_LABEL}={image_id}", timeout=60)

    def drop_stale() -> None:
        # The store is on disk across runs (a warm run imports nothing) and each runtime
        # image is GBs: what a rebuild replaced goes. Containers still running one keep
        # its content (containerd's leases); only the names go.
        listed = ctr_run("images", "ls", timeout=60).stdout.splitlines()[1:]
        rows = [(f[0], f[2]) for f in map(str.split, listed) if len(f) > 2]  # REF, DIGEST
        stale = realnode.stale_image_refs(rows, want)
        if stale:
            ctr_run("images", "rm", *stale, timeout=120)

    names = have()
    if want in names:
        drop_stale()
        return f"{want} already present ({image_id[:19]})"
    if names:
        tag(names[0])
        drop_stale()
        return f"{want} tagged from {names[0]} ({image_id[:19]})"
    t0 = time.monotonic()
    # Uncompressed, so that a layer's digest is its content's (the same every save) and
    # no one compresses 6 GB to have containerd decompress it again; and streamed without
    # the blobs containerd has already (an OCI archive's import reads only index.json
    # and writes what it is given; unpacking finds the rest in the content store). A
    # rebuild that changed only the top layers then sends only those, not the GBs below.
    known = set(ctr_run("content", "ls", "-q", timeout=60).stdout.split())
    # Their messages go to files: a pipe nobody reads while the copy runs could fill.
    with tempfile.TemporaryFile() as save_err, tempfile.TemporaryFile() as imp_log:
        save = subprocess.Popen(
            [podman, "save", "--uncompressed", "--format", "oci-archive", image],
            stdout=subprocess.PIPE,
            stderr=save_err,
        )
        imp = subprocess.Popen(
            [*ctr, "images", "import", "--local", "--digests", "-"],
            stdin=subprocess.PIPE,
            stdout=imp_log,
            stderr=subprocess.STDOUT,
        )
        assert save.stdout is not None
        assert imp.stdin is not None
        skipped = 0
        try:
            skipped = copy_archive_without(save.stdout, imp.stdin, known)
        except BrokenPipeError:
            pass  # ctr stopped reading: its output says why
        finally:
            with contextlib.suppress(BrokenPipeError):
                imp.stdin.close()
            save.stdout.close()
        try:
            imp.wait(timeout=1800)
            save.wait(timeout=60)
        finally:
            for proc in (imp, save):
                if proc.poll() is None:
                    proc.kill()
        save_err.seek(0)
        imp_log.seek(0)
        save_text = save_err.read().decode(errors="replace")
        imp_out = imp_log.read().decode(errors="replace")
    if save.returncode != 0:
        raise ImageError(f"podman save {image} failed: {save_text.strip()[-2000:]}")
    if imp.returncode != 0:
        raise ImageError(f"ctr images import failed: {imp_out.strip()[-2000:]}")
    # What the import made: a digest-named image (--digests), maybe a named one too.
    made = re.findall(r"^unpacking (\S+) \(", imp_out, re.MULTILINE)
    if not made:
        raise ImageError(f"ctr images import named no image:\n{imp_out}")
    tag(made[0])
    drop_stale()
    return (
        f"{want} imported in {time.monotonic() - t0:.1f}s ({image_id[:19]}; "
        f"{skipped} blob(s) the node had already)"
    )


def copy_archive_without(source: IO[bytes], sink: IO[bytes], known: set[str]) -> int:
    """Copy the tar stream ``source`` to ``sink`` without the blobs whose digests are in
    ``known``; returns how many were left out."""
    skipped = 0
    with (
        tarfile.open(fileobj=source, mode="r|", bufsize=1 << 20) as archive,
        tarfile.open(fileobj=sink, mode="w|", bufsize=1 << 20, format=tarfile.PAX_FORMAT) as out,
    ):
        out.copybufsize = 1 << 20
        for member in archive:
            if realnode.archive_blob_digest(member.name) in known:
                skipped += 1
                continue  # the stream reads past its data
            out.addfile(member, archive.extractfile(member) if member.isfile() else None)
    return skipped


def cmd_load_image(state_dir: Path, image: str) -> int:
    state = State.load(state_dir / "state.json")
    if state is None:
        log("not running")
        return 1
    try:
        print(load_image(state, image))
    except (ImageError, subprocess.TimeoutExpired) as exc:
        log(f"load-image {image}: {exc}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["start", "stop", "status", "logs", "load-image"])
    parser.add_argument("argument", nargs="?", help="logs: the component; load-image: the image")
    parser.add_argument("--state-dir", type=Path, default=None)
    parser.add_argument("--bin-dir", type=Path, default=None)
    parser.add_argument(
        "--node",
        choices=["auto", "on", "off"],
        default=os.environ.get("OMNI_REAL_NODE") or "auto",
        help="start the real node: where it can run (auto), or fail without it (on), or never",
    )
    parser.add_argument("--lines", type=int, default=40, help="logs: how many lines")
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds to wait for each component to become healthy",
    )
    args = parser.parse_args(argv)
    state_dir = (args.state_dir or default_state_dir()).resolve()
    if args.command == "start":
        if args.node not in ("auto", "on", "off"):
            parser.error(f"--node/OMNI_REAL_NODE must be auto, on or off, not {args.node!r}")
        return cmd_start(state_dir, args.bin_dir, args.timeout, args.node)
    if args.command == "stop":
        return cmd_stop(state_dir)
    if args.command == "logs":
        return cmd_logs(state_dir, args.argument, args.lines)
    if args.command == "load-image":
        if not args.argument:
            parser.error("load-image needs the image, e.g. omni-operator/omni-runtime:0.1.0")
        return cmd_load_image(state_dir, args.argument)
    return cmd_status(state_dir)


if __name__ == "__main__":
    sys.exit(main())
