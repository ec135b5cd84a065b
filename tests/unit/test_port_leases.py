"""omni_testkit.port_leases: leases outside the ephemeral range, never two alike across
processes, dead owners' leases dropped; and no port picked by binding 0 and closing
anywhere in the tree."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from omni_testkit import port_leases

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def own_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A registry of the test's own, so that the leases of sessions running beside it
    neither disturb it nor are disturbed."""
    path = tmp_path / "leases"
    monkeypatch.setenv(port_leases.REGISTRY_ENV, str(path))
    return path


def test_leases_lie_in_the_band_outside_the_ephemeral_range() -> None:
    low, high = port_leases.ephemeral_range()
    band = port_leases.lease_band((low, high))
    ports = port_leases.lease_ports(20)
    assert len(set(ports)) == 20
    for port in ports:
        assert band[0] <= port <= band[1]
        assert not low <= port <= high


def test_processes_leasing_at_once_never_share_a_port(own_registry: Path) -> None:
    script = (
        "import json, sys\n"
        "from omni_testkit import port_leases\n"
        "print(json.dumps(port_leases.lease_ports(40)))\n"
        "sys.stdin.read()\n"  # hold the leases until told to go
    )
    children = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    try:
        leased: list[int] = []
        for child in children:
            assert child.stdout is not None
            leased += json.loads(child.stdout.readline())
        mine = port_leases.lease_ports(40)
    finally:
        for child in children:
            child.communicate("", timeout=30)
    assert len(leased) == 160
    assert len(set(leased) | set(mine)) == 200
    # Their owners gone, their leases are dropped at the next lease.
    port_leases.lease_port()
    owners = {owner[0] for owner in json.loads(own_registry.read_text())["leases"].values()}
    assert owners == {os.getpid()}


def listener_after(port: int) -> socket.socket:
    """A listening socket on the first port after ``port`` that is free now, held by the
    caller: other processes of this machine (the suite's other session, their routers and
    stages) listen on ports of the band through the machine's registry, which this test's
    own registry does not know, so no port but the one bound here is sure to be free."""
    for candidate in range(port + 1, port + 200):
        try:
            return socket.create_server(("127.0.0.1", candidate))
        except OSError:
            continue
    raise AssertionError(f"no free port in {port + 1}-{port + 199}")


def test_a_port_with_a_listener_is_passed_over(own_registry: Path) -> None:
    first = port_leases.lease_port()
    with listener_after(first) as taken:
        port = taken.getsockname()[1]
        registry = json.loads(own_registry.read_text())
        registry["next"] = port
        own_registry.write_text(json.dumps(registry))
        # A port after it (the band is gone round in order; others may be in use too).
        assert port < port_leases.lease_port()


def test_a_lease_of_a_dead_process_or_a_reused_pid_does_not_count(own_registry: Path) -> None:
    first = port_leases.lease_port()
    # The same pid with another start time: a process that reused a dead owner's pid.
    own_registry.write_text(json.dumps({"next": first, "leases": {str(first): [os.getpid(), 1]}}))
    assert port_leases.lease_port() == first


def test_a_corrupt_registry_is_started_afresh(own_registry: Path) -> None:
    own_registry.write_text('{"next": 2')
    assert port_leases.lease_port() > 0
    assert json.loads(own_registry.read_text())["leases"]


@pytest.mark.parametrize(
    ("ephemeral", "band"),
    [
        ((32768, 60999), (20000, 29999)),
        ((25000, 60999), (20000, 24999)),
        ((10000, 60999), (1025, 9999)),
        ((1024, 40000), (40001, 65535)),
    ],
)
def test_the_band_avoids_the_ephemeral_range(
    ephemeral: tuple[int, int], band: tuple[int, int]
) -> None:
    assert port_leases.lease_band(ephemeral) == band


def test_no_band_is_a_clear_error() -> None:
    with pytest.raises(port_leases.PortLeaseError, match="ip_local_port_range"):
        port_leases.lease_band((1024, 65535))


def _picks_and_closes(tree: ast.AST) -> list[int]:
    """Lines of ``with socket...() as s: s.bind((host, 0)) ... return ...``: a port
    chosen by the kernel and given up before its user binds it."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.With):
            continue
        body = ast.Module(body=node.body, type_ignores=[])
        binds_zero = any(
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "bind"
            and call.args
            and isinstance(call.args[0], ast.Tuple)
            and len(call.args[0].elts) == 2
            and isinstance(call.args[0].elts[1], ast.Constant)
            and call.args[0].elts[1].value == 0
            for call in ast.walk(body)
        )
        if binds_zero and any(isinstance(n, ast.Return) for n in ast.walk(body)):
            lines.append(node.lineno)
    return lines


def test_no_port_is_picked_by_binding_zero_and_closing() -> None:
    found = []
    for folder in ("runtime", "operator", "testkit", "tests", "bench", "examples", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if ".venv" in path.parts:
                continue
            tree = ast.parse(path.read_text(), str(path))
            found += [f"{path.relative_to(ROOT)}:{line}" for line in _picks_and_closes(tree)]
    assert not found, f"ports picked by binding 0 and closing (lease one instead): {found}"


def test_the_check_finds_the_pattern() -> None:
    tree = ast.parse(
        "def free_port():\n"
        "    with socket.socket() as sock:\n"
        "        sock.bind(('127.0.0.1', 0))\n"
        "        return sock.getsockname()[1]\n"
    )
    assert _picks_and_closes(tree) == [2]
