#!/usr/bin/env python3
"""Run a local Kubernetes control plane for the cluster tests.

    controlplane.py start [--state-dir DIR] [--bin-dir DIR] [--timeout S]
    controlplane.py stop  [--state-dir DIR]
    controlplane.py status [--state-dir DIR]

`start` runs etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
kwok (two fake nodes) on 127.0.0.1, waits until all are healthy and prints the
admin kubeconfig path as its last stdout line. `stop` ends exactly the
processes `start` recorded. Both are no-ops when there is nothing to do; a
`start` over an unhealthy run replaces it. A component that exits is reported
with the tail of its log: by `start` while starting, by `status` after.

State dir (default $OMNI_CONTROLPLANE_DIR, else
${OMNI_CACHE_DIR:-~/.cache/omni-operator}/controlplane-run) holds kubeconfig,
token (a bearer token the apiserver accepts, new on every start), state.json
(pids, ports), pki/, etcd-data/ and logs/<component>.log.
Binaries come from --bin-dir, $OMNI_CONTROLPLANE_BIN, or build.sh's bin dir
(run build.sh first). Only the Python standard library and openssl are used.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGTERM)
        if _wait_gone(p, grace_s):
            continue
        log(f"{p.name} (pid {p.pid}) ignored SIGTERM for {grace_s:.0f}s; killing it")
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
        _wait_gone(p, 5)


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
        "subjectAltName = IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
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
    """Ports free on 127.0.0.1 right now, all distinct.

    The sockets stay bound until every port is chosen, so the kernel cannot
    hand the same port out twice; a component that still loses a race exits
    with "address already in use", which start reports with its log.
    """
    socks = []
    try:
        for _ in names:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return {n: s.getsockname()[1] for n, s in zip(names, socks, strict=True)}
    finally:
        for s in socks:
            s.close()


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
    def __init__(self, state_dir: Path, bin_dir: Path, timeout_s: float) -> None:
        self.state_dir = state_dir
        self.bin_dir = bin_dir
        self.timeout_s = timeout_s
        self.pki = state_dir / "pki"
        self.logs = state_dir / "logs"
        self.kubeconfig = state_dir / "kubeconfig"
        self.state = State(bin_dir=str(bin_dir), kubeconfig=str(self.kubeconfig))
        self.popens: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, args: list[str]) -> None:
        log_path = self.logs / f"{name}.log"
        with open(log_path, "ab") as log_fh:
            popen = subprocess.Popen(
                [str(self.bin_dir / name), *args],
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
        self.state.procs.append(ProcRecord(name, popen.pid, st[1] if st else -1, str(log_path)))
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
                    f"--- {p.name} ---\n{tail(Path(p.log), 15)}" for p in self.state.procs
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
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                # There is no real apiserver endpoint for in-cluster clients, and a
                # loopback address is rejected in Endpoints anyway.
                "--endpoint-reconciler-type=none",
                f"--cert-dir={pki}",
                "--profiling=false",
            ],
        )
        ctx = admin_context(pki)
        self.wait_for("kube-apiserver /readyz", lambda: http_ok(f"{server}/readyz", ctx, "ok"))

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
                "--manage-all-nodes=true",
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
        # The serviceaccount controller creating this proves the controller
        # manager is really working, and pods in "default" need it.
        self.wait_for(
            "serviceaccount default/default",
            lambda: (
                self.kubectl("get", "serviceaccount", "default", "-n", "default").returncode == 0
            ),
        )
        log(f"control plane healthy in {time.monotonic() - t_start:.1f}s (apiserver {server})")


def healthy(state: State) -> bool:
    if not state.procs or not all(is_running(p) for p in state.procs):
        return False
    pki = Path(state.kubeconfig).parent / "pki"
    try:
        ctx = admin_context(pki)
    except (OSError, ssl.SSLError):
        return False
    return http_ok(f"https://127.0.0.1:{state.ports['apiserver']}/readyz", ctx, "ok")


def cmd_start(state_dir: Path, bin_dir: Path | None, timeout_s: float) -> int:
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
            terminate(old.procs)
            state_path.unlink()

        if missing := missing_binaries(bin_dir):
            log(f"missing binaries in {bin_dir}: {', '.join(missing)} (run {HERE / 'build.sh'})")
            return 2
        starter = Starter(state_dir, bin_dir, timeout_s)
        try:
            starter.run()
        except (StartError, KeyboardInterrupt) as exc:
            log(f"start failed: {exc}")
            terminate(starter.state.procs)
            for popen in starter.popens.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=1)
            with contextlib.suppress(FileNotFoundError):
                state_path.unlink()
            return 1
    print(starter.kubeconfig)
    return 0


def cmd_stop(state_dir: Path) -> int:
    state_path = state_dir / "state.json"
    with locked(state_dir):
        state = State.load(state_path)
        if state is None:
            log("not running")
            return 0
        running = [p for p in state.procs if is_running(p)]
        log(
            "stopping "
            + (", ".join(f"{p.name} ({p.pid})" for p in running) or "nothing (all exited)")
        )
        t0 = time.monotonic()
        terminate(state.procs)
        state_path.unlink()
        log(f"stopped in {time.monotonic() - t0:.1f}s")
    return 0


def cmd_status(state_dir: Path) -> int:
    state = State.load(state_dir / "state.json")
    if state is None:
        print("not running")
        return 1
    for p in state.procs:
        print(f"{p.name:<24} pid {p.pid:<8} {'running' if is_running(p) else 'EXITED'}")
    for p in state.procs:
        if not is_running(p):
            print(f"--- last lines of {p.log} ---\n{tail(Path(p.log), 15)}")
    ok = healthy(state)
    print(f"kubeconfig: {state.kubeconfig}\napiserver ready: {ok}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["start", "stop", "status"])
    parser.add_argument("--state-dir", type=Path, default=None)
    parser.add_argument("--bin-dir", type=Path, default=None)
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds to wait for each component to become healthy",
    )
    args = parser.parse_args(argv)
    state_dir = (args.state_dir or default_state_dir()).resolve()
    if args.command == "start":
        return cmd_start(state_dir, args.bin_dir, args.timeout)
    if args.command == "stop":
        return cmd_stop(state_dir)
    return cmd_status(state_dir)


if __name__ == "__main__":
    sys.exit(main())
