"""The shared-memory and TCP connectors between real processes, and their cleanup.

The other end of each transfer is a child process running this file as an agent (see
``agent_main``): one connector, driven by JSON lines on stdin. Agents are killed (SIGKILL,
SIGSTOP) to show what a dead or hung peer leaves behind, which a single process cannot.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from connector_arrays import described, expected, make_array

pytestmark = pytest.mark.integration

MiB = 1 << 20
# Starting an agent imports torch (seconds); answers take milliseconds.
START_TIMEOUT = 120.0
CALL_TIMEOUT = 60.0
SHM_DIR = "/dev/shm"


def segments_of(pid: int) -> list[str]:
    prefix = f"omni-{pid}-"
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.01)


# -- the agent: one connector in a child process ------------------------------------------------


def agent_main(kind: str, extra_json: str) -> int:
    import msgspec

    from omni_runtime.connectors import ConnectorError, ConnectorHandle
    from omni_runtime.connectors.shared_memory import SharedMemoryConnector
    from omni_runtime.connectors.tcp import TCPConnector

    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but answers on the pipe

    def reply(**fields: Any) -> None:
        out.write(json.dumps(fields) + "\n")
        out.flush()

    extra = json.loads(extra_json)
    connector = SharedMemoryConnector(kind, extra) if kind == "shm" else TCPConnector(kind, extra)
    held: dict[str, Any] = {}
    reply(ready=True, pid=os.getpid())
    try:
        for line in sys.stdin:  # EOF (the test process gone) ends the agent too
            command = json.loads(line)
            op = command["op"]
            try:
                if op == "put":
                    handle = connector.put(command["key"], make_array(command["spec"]))
                    reply(handle=msgspec.json.encode(handle).decode())
                elif op == "get":
                    handle = msgspec.json.decode(command["handle"], type=ConnectorHandle)
                    tensor = connector.get(handle)
                    if command.get("hold"):
                        held[handle.key] = tensor
                    dtype, shape, sha = described(tensor)
                    reply(dtype=dtype, shape=shape, digest=sha)
                elif op == "release":
                    connector.release(command["key"])
                    reply(ok=True)
                elif op == "close":
                    connector.close()
                    reply(ok=True)
                else:
                    reply(error="ValueError", message=f"unknown op {op!r}")
            except ConnectorError as e:
                reply(error=type(e).__name__, message=str(e))
    finally:
        connector.close()
    return 0


class Agent:
    """A connector in a child process; ``call`` sends a command and waits for the answer."""

    def __init__(self, kind: str, extra: dict[str, Any], log: Path) -> None:
        self.log = log
        with log.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--agent", kind, json.dumps(extra)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        started = self._next(START_TIMEOUT)
        assert started.get("ready"), started
        self.pid = int(started["pid"])

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._answers.put(json.loads(line))
        self._answers.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no answer within {timeout:g} s; log:\n{self.tail()}") from None
        if answer is None:
            self._answers.put(None)
            raise AssertionError(f"agent exited (rc {self.proc.wait()}); log:\n{self.tail()}")
        return answer

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self._next(CALL_TIMEOUT)

    def put(self, key: str, spec: dict[str, Any]) -> Any:
        import msgspec

        from omni_runtime.connectors import ConnectorHandle

        answer = self.call("put", key=key, spec=spec)
        assert "handle" in answer, answer
        return msgspec.json.decode(answer["handle"], type=ConnectorHandle)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> int:
        """End the agent (closing its connector); its exit status, killed if it hangs."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                return self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        return self.proc.wait()


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator[Callable[..., Agent]]:
    """Starts agents for one test; each is ended (killed if need be) at its end."""
    started: list[Agent] = []

    def start(kind: str, **extra: Any) -> Agent:
        agent = Agent(kind, extra, tmp_path / f"agent-{len(started)}.log")
        started.append(agent)
        return agent

    yield start
    for agent in started:
        if agent.proc.poll() is None:
            os.kill(agent.pid, signal.SIGCONT)  # in case a test left it stopped
        agent.stop()


@pytest.fixture(scope="module")
def shm_producer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    agent = Agent("shm", {}, tmp_path_factory.mktemp("shm") / "producer.log")
    yield agent
    assert agent.stop() == 0
    assert segments_of(agent.pid) == []


@pytest.fixture(scope="module")
def tcp_producer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    agent = Agent("tcp", {"bind_host": "127.0.0.1"}, tmp_path_factory.mktemp("tcp") / "p.log")
    yield agent
    assert agent.stop() == 0


@pytest.fixture
def shm_consumer() -> Iterator[Any]:
    from omni_runtime.connectors.shared_memory import SharedMemoryConnector

    connector = SharedMemoryConnector("shm")
    yield connector
    connector.close()


@pytest.fixture
def tcp_consumer() -> Iterator[Any]:
    from omni_runtime.connectors.tcp import TCPConnector

    connector = TCPConnector("tcp", {"timeout_seconds": 30})
    yield connector
    connector.close()


SPECS = [
    {"kind": "float32", "shape": [3, 5, 7], "seed": 1},
    {"kind": "bfloat16", "shape": [4, 33], "seed": 2},
    {"kind": "float16", "shape": [129], "seed": 3},
    {"kind": "int64", "shape": [1000], "seed": 4},
    {"kind": "float32", "shape": [], "seed": 5},
    {"kind": "bfloat16", "shape": [0, 16], "seed": 6},
    {"kind": "float64", "shape": [6, 4], "seed": 7, "numpy": True},
]
SPEC_IDS = ["float32", "bfloat16", "float16", "int64", "scalar", "empty", "numpy-view"]
BIG = {"kind": "float32", "shape": [16 * MiB], "seed": 8}  # 64 MiB


# -- shared memory ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_shared_memory_round_trip_across_processes(
    shm_producer: Agent, shm_consumer: Any, spec: dict[str, Any]
) -> None:
    handle = shm_producer.put(f"rt-{spec['seed']}", spec)
    tensor = shm_consumer.get(handle)
    assert described(tensor) == expected(spec)
    assert segments_of(shm_producer.pid) == []


def test_shared_memory_64_mib_and_reuse_through_proc(
    shm_producer: Agent, shm_consumer: Any
) -> None:
    first = shm_producer.put("big-1", BIG)
    tensor = shm_consumer.get(first)
    assert described(tensor) == expected(BIG)
    assert segments_of(shm_producer.pid) == []
    del tensor  # the segment goes back to the producer
    second = shm_producer.put("big-2", {**BIG, "seed": 9})
    # The same segment, nameless now: opened through /proc/<producer>/fd.
    assert second.extra["inode"] == first.extra["inode"]
    assert second.extra["named"] is False
    assert segments_of(shm_producer.pid) == []
    assert described(shm_consumer.get(second)) == expected({**BIG, "seed": 9})


def test_shared_memory_second_consumer_is_refused(
    shm_producer: Agent, shm_consumer: Any, start_agent: Callable[..., Agent]
) -> None:
    other = start_agent("shm")
    spec = {"kind": "float32", "shape": [64], "seed": 10}
    handle = shm_producer.put("once", spec)
    assert described(shm_consumer.get(handle)) == expected(spec)
    again = other.call("get", handle=json.dumps(_fields(handle)))
    assert again.get("error") == "ConnectorError", again
    assert "'once'" in again["message"]


def _fields(handle: Any) -> list[Any]:
    import msgspec

    fields: list[Any] = json.loads(msgspec.json.encode(handle))
    return fields


def test_shared_memory_release_unlinks(shm_producer: Agent, shm_consumer: Any) -> None:
    from omni_runtime.connectors import ConnectorError

    handle = shm_producer.put("aborted", {"kind": "float32", "shape": [MiB], "seed": 11})
    assert segments_of(shm_producer.pid) == [handle.extra["segment"]]
    assert shm_producer.call("release", key="aborted") == {"ok": True}
    assert segments_of(shm_producer.pid) == []
    with pytest.raises(ConnectorError, match="'aborted'"):
        shm_consumer.get(handle)


def test_shared_memory_ttl_expiry_unlinks(
    start_agent: Callable[..., Agent], shm_consumer: Any
) -> None:
    from omni_runtime.connectors import ConnectorError

    ttl = 2.0
    producer = start_agent("shm", ttl_seconds=ttl)
    # Before the call: the agent's put, whose time the TTL counts from, is after this.
    # (Taken after the reply, it was 0.18 s before the expiry beside two busy loops: the
    # reply itself had taken the rest of the TTL.)
    put_at = time.monotonic()
    handle = producer.put("stale", {"kind": "float32", "shape": [1000], "seed": 12})
    assert segments_of(producer.pid) == [handle.extra["segment"]]
    wait_for(lambda: segments_of(producer.pid) == [], "the unfetched segment expiring")
    assert time.monotonic() - put_at >= ttl
    with pytest.raises(ConnectorError, match="'stale'"):
        shm_consumer.get(handle)


def test_shared_memory_close_and_exit_unlink(start_agent: Callable[..., Agent]) -> None:
    closing = start_agent("shm")
    for i in range(3):
        closing.put(f"k{i}", {"kind": "int64", "shape": [100 * (i + 1)], "seed": i})
    assert len(segments_of(closing.pid)) == 3
    assert closing.call("close") == {"ok": True}
    assert segments_of(closing.pid) == []

    exiting = start_agent("shm")  # never closed: its connector goes at interpreter exit
    exiting.put("k", {"kind": "int64", "shape": [100], "seed": 13})
    assert len(segments_of(exiting.pid)) == 1
    assert exiting.stop() == 0
    assert segments_of(exiting.pid) == []


def test_shared_memory_killed_producer_is_swept(
    start_agent: Callable[..., Agent], shm_consumer: Any
) -> None:
    from omni_runtime.connectors.shared_memory import sweep_orphaned_segments

    producer = start_agent("shm")
    fetched_spec = {"kind": "bfloat16", "shape": [256, 64], "seed": 14}
    fetched = shm_consumer.get(producer.put("fetched", fetched_spec))
    for i in range(2):
        producer.put(f"orphan-{i}", {"kind": "float32", "shape": [4096], "seed": i})
    assert len(segments_of(producer.pid)) == 2
    producer.kill()
    # Nobody unlinked them: a SIGKILL runs no cleanup.
    assert len(segments_of(producer.pid)) == 2
    assert sweep_orphaned_segments() >= 2
    assert segments_of(producer.pid) == []
    # What a consumer already holds outlives its producer.
    assert described(fetched) == expected(fetched_spec)


def test_shared_memory_killed_consumer_gives_the_segment_back(
    start_agent: Callable[..., Agent],
) -> None:
    from omni_runtime.connectors.shared_memory import SharedMemoryConnector

    producer = SharedMemoryConnector("shm")
    try:
        consumer = start_agent("shm")
        spec = {"kind": "float32", "shape": [MiB // 4], "seed": 15}
        held = producer.put("held", make_array(spec))
        got = consumer.call("get", handle=json.dumps(_fields(held)), hold=True)
        assert got.get("digest") == expected(spec)[2], got
        # Held by a live consumer: a new put may not reuse the segment.
        busy = producer.put("busy", make_array(spec))
        assert busy.extra["inode"] != held.extra["inode"]
        producer.release("busy")
        consumer.kill()  # dies holding it: it never marks the segment free
        wait_for(
            lambda: held.extra["inode"] == producer.put("probe", make_array(spec)).extra["inode"],
            "the dead consumer's segment coming back",
        )
        assert segments_of(os.getpid()) == []
    finally:
        producer.close()
    assert segments_of(os.getpid()) == []


# -- TCP ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [*SPECS, BIG], ids=[*SPEC_IDS, "64MiB"])
def test_tcp_round_trip_across_processes(
    tcp_producer: Agent, tcp_consumer: Any, spec: dict[str, Any]
) -> None:
    handle = tcp_producer.put(f"rt-{spec['seed']}", spec)
    assert handle.host == "127.0.0.1"
    assert described(tcp_consumer.get(handle)) == expected(spec)


def test_tcp_unknown_key_names_key_and_producer(tcp_producer: Agent, tcp_consumer: Any) -> None:
    from omni_runtime.connectors import ConnectorError, ConnectorHandle

    handle = tcp_producer.put("real", {"kind": "float32", "shape": [4], "seed": 16})
    forged = ConnectorHandle("tcp", "no-such-key", "float32", [4], 16, handle.host, handle.port)
    with pytest.raises(ConnectorError, match=f"'no-such-key'.*127.0.0.1:{handle.port}"):
        tcp_consumer.get(forged)
    assert tcp_producer.call("release", key="real") == {"ok": True}
    with pytest.raises(ConnectorError, match="'real'"):
        tcp_consumer.get(handle)


def test_tcp_get_from_a_killed_producer_fails_within_the_timeout(
    start_agent: Callable[..., Agent],
) -> None:
    from omni_runtime.connectors import ConnectorError
    from omni_runtime.connectors.tcp import TCPConnector

    producer = start_agent("tcp", bind_host="127.0.0.1")
    handle = producer.put("orphan", {"kind": "float32", "shape": [MiB], "seed": 17})
    consumer = TCPConnector("tcp", {"timeout_seconds": 5})
    try:
        # A connection kept from an earlier get must not make the failure any slower.
        warm_spec = {"kind": "float32", "shape": [4], "seed": 18}
        assert described(consumer.get(producer.put("warm", warm_spec))) == expected(warm_spec)
        producer.kill()
        start = time.monotonic()
        with pytest.raises(ConnectorError, match=f"'orphan'.*127.0.0.1:{handle.port}"):
            consumer.get(handle)
        assert time.monotonic() - start < 5
    finally:
        consumer.close()


def test_tcp_get_from_a_hung_producer_times_out(start_agent: Callable[..., Agent]) -> None:
    from omni_runtime.connectors import ConnectorError
    from omni_runtime.connectors.tcp import TCPConnector

    producer = start_agent("tcp", bind_host="127.0.0.1")
    handle = producer.put("hung", {"kind": "float32", "shape": [MiB], "seed": 19})
    consumer = TCPConnector("tcp", {"timeout_seconds": 1})
    os.kill(producer.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(ConnectorError, match=r"timed out after 1 s.*'hung'"):
            consumer.get(handle)
        assert 1 <= time.monotonic() - start < 10
    finally:
        os.kill(producer.pid, signal.SIGCONT)
        consumer.close()
    # Awake, the producer serves the abandoned request, gets no acknowledgement and keeps
    # the key: a retry has it (once the producer has noticed).
    retry = TCPConnector("tcp", {"timeout_seconds": 30})
    got: list[Any] = []
    refusals: list[str] = []

    def fetched() -> bool:
        try:
            got.append(retry.get(handle))
        except ConnectorError as e:
            refusals.append(str(e))
        return bool(got)

    try:
        wait_for(fetched, "the key served to a retry")
        assert all("'hung'" in refusal for refusal in refusals), refusals
        assert described(got[0]) == expected({"kind": "float32", "shape": [MiB], "seed": 19})
    finally:
        retry.close()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--agent":
        sys.exit(agent_main(sys.argv[2], sys.argv[3]))
    sys.exit("usage: test_connector_processes.py --agent shm|tcp EXTRA_JSON")
