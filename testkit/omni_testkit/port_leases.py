"""Ports for the servers that tests and benchmarks start in other processes, handed out
so that no two leases are ever the same port and no port the kernel picks lands on one.

Picking a port by binding 0 and closing the socket races: between the close and the
child's own bind, any process's ``bind(0)`` or ``connect()`` may be given that very port
(the kernel draws both from its ephemeral range, 32768-60999 by default), and the child
fails with "address already in use". Leases are drawn from outside that range
(``/proc/sys/net/ipv4/ip_local_port_range``), where only an explicit bind can take a
port, and from one registry that every process on the machine shares (a JSON file under
an exclusive ``flock``), so two pytest sessions, a benchmark and a control plane never
lease the same one. A lease lasts as long as the process that took it (its pid and start
time are recorded, so a reused pid does not keep a dead lease). Leases go round the band
before any port comes back, so a port is not reused while its last user's connections
may still linger in TIME_WAIT.

Where a server can bind its own port (``--port 0`` with the port reported back, or a
socket bound here and handed over), that is better still; a lease is for the processes
that must be told their port before they start. Standard library only: the control
plane's script imports it too.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Below the kernel's default ephemeral range (32768) and Kubernetes' NodePort range
# (30000-32767), above the well-known ports the tests' components use by default (etcd
# 2379, kubelet 10248-10259, kube-proxy 10249/10256).
PREFERRED_BAND = (20000, 29999)
_MIN_BAND_PORTS = 256
REGISTRY_ENV = "OMNI_PORT_LEASES"


class PortLeaseError(RuntimeError):
    """No port could be leased; the message says why."""


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range, both ends included (Linux's default if unknown)."""
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return (32768, 60999)
    return (low, high)


def lease_band(ephemeral: tuple[int, int]) -> tuple[int, int]:
    """The ports leases come from: the preferred band, less any part of it the kernel may
    hand out; else the widest stretch above 1024 outside the ephemeral range."""
    low, high = ephemeral
    band_low, band_high = PREFERRED_BAND
    stretches = [
        (band_low, min(band_high, low - 1)),
        (max(band_low, high + 1), band_high),
        (1025, low - 1),
        (high + 1, 65535),
    ]
    for start, end in stretches:
        if end - start + 1 >= _MIN_BAND_PORTS:
            return (start, end)
    raise PortLeaseError(
        f"no {_MIN_BAND_PORTS} ports above 1024 lie outside the kernel's ephemeral range "
        f"{low}-{high} ({EPHEMERAL_RANGE_FILE}); narrow it, e.g. "
        "sysctl net.ipv4.ip_local_port_range='32768 60999'"
    )


def registry_path() -> Path:
    return Path(os.environ.get(REGISTRY_ENV) or Path(tempfile.gettempdir()) / "omni-port-leases")


def lease_port() -> int:
    """A loopback port for a server this process is about to start: outside the ephemeral
    range, free now, and leased to no other live process."""
    return lease_ports(1)[0]


def lease_ports(count: int) -> list[int]:
    """``count`` distinct ports, as ``lease_port``, taken under one lock."""
    band = lease_band(ephemeral_range())
    me = _process_identity(os.getpid())
    with _locked_registry() as registry:
        leases: dict[str, list[int]] = {
            port: owner
            for port, owner in registry.get("leases", {}).items()
            if _process_identity(owner[0]) == owner[1]
        }
        cursor = int(registry.get("next", band[0]))
        size = band[1] - band[0] + 1
        chosen: list[int] = []
        for step in range(size):
            port = band[0] + (cursor - band[0] + step) % size
            if str(port) in leases or not _bindable(port):
                continue
            chosen.append(port)
            leases[str(port)] = [os.getpid(), me]
            if len(chosen) == count:
                registry["next"] = band[0] + (port + 1 - band[0]) % size
                break
        else:
            raise PortLeaseError(
                f"only {len(chosen)} of {count} ports free in {band[0]}-{band[1]} "
                f"({len(leases)} leased to live processes, see {registry_path()})"
            )
        registry["leases"] = leases
    return chosen


def _bindable(port: int) -> bool:
    # Without SO_REUSEADDR: a port with a listener or a lingering connection on any local
    # address is passed over.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _process_identity(pid: int) -> int:
    """The start time of ``pid`` (clock ticks since boot), 0 if there is no such process:
    with the pid it names one process, not whoever reuses the pid later."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    # The command name (field 2) may hold spaces and parentheses; fields after it do not.
    return int(stat.rsplit(")", 1)[1].split()[19])


@contextmanager
def _locked_registry() -> Iterator[dict[str, Any]]:  # JSON as read: checked where used
    path = registry_path()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    with os.fdopen(fd, "r+") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        text = file.read()
        try:
            registry = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError:
            # A registry cut short (a writer killed mid-write) holds nothing to keep: every
            # port is still checked for a listener before it is leased.
            registry = {}
        if not isinstance(registry, dict):
            registry = {}
        yield registry
        file.seek(0)
        file.truncate()
        file.write(json.dumps(registry))
        file.flush()
