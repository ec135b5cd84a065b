"""MooncakeTransferEngineConnector between real processes, over Mooncake's tcp transport.

Producer and consumer are each a child process running this file as an agent (see
``_agent_main``): the dynamic loader only reads LD_LIBRARY_PATH at process start, so the
children get it from ``with_mooncake_library_path`` whatever this pytest process was
started with. The test process generates the same arrays the producer sends and compares
bytes, dtype and shape.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from connector_arrays import digest, expected, make_array

pytestmark = pytest.mark.integration

MiB = 1 << 20
# Starting an agent imports torch (seconds); answers take milliseconds.
START_TIMEOUT = 120.0
CALL_TIMEOUT = 60.0

HOW_TO_GET_IT = (
    "install the engine (pip install mooncake-transfer-engine-non-cuda==0.3.13.post1, the "
    "project's `mooncake` extra) and its system libraries (scripts/mooncake_libs.sh, or "
    "apt-get install libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200)"
)


# -- the agent: one connector in a child process, driven by JSON lines on stdin -----------


def _agent_main(extra_json: str) -> int:
    import msgspec

    from omni_runtime.connectors.base import ConnectorError, ConnectorHandle
    from omni_runtime.connectors.mooncake import MooncakeTransferEngineConnector

    def reply(**fields: Any) -> None:
        # Marked, so that anything a library prints to stdout is not taken for an answer.
        sys.stdout.write("@@ " + json.dumps(fields) + "\n")
        sys.stdout.flush()

    try:
        connector = MooncakeTransferEngineConnector("rdma_connector", json.loads(extra_json))
    except ConnectorError as exc:
        reply(error=type(exc).__name__, message=str(exc))
        return 0
    reply(ready=True, host=connector.host, port=connector.zmq_port)
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
                    start = time.perf_counter()
                    tensor = connector.get(handle)
                    seconds = time.perf_counter() - start
                    dtype = str(tensor.dtype).removeprefix("torch.")
                    reply(dtype=dtype, shape=list(tensor.shape), digest=digest(tensor), s=seconds)
                elif op == "release":
                    connector.release(command["key"])
                    reply(ok=True)
                elif op == "close":
                    connector.close()
                    reply(ok=True)
                    break
                else:
                    reply(error="ValueError", message=f"unknown op {op!r}")
            except ConnectorError as exc:
                reply(error=type(exc).__name__, message=str(exc))
    finally:
        connector.close()
    return 0


class Agent:
    """A connector in a child process; ``call`` sends one command and waits for its answer."""

    def __init__(self, extra: dict[str, Any], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--agent", json.dumps(extra)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=env,
                text=True,
            )
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.started = self._next(START_TIMEOUT)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self._answers.put(json.loads(line[3:]))
        self._answers.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"agent gave no answer within {timeout:g} s; its log:\n{self.log_tail()}"
            ) from None
        if answer is None:
            self._answers.put(None)
            raise AssertionError(
                f"agent exited (rc {self.proc.wait()}); its log:\n{self.log_tail()}"
            )
        return answer

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def call(self, op: str, timeout: float = CALL_TIMEOUT, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self._next(timeout)

    def put(self, key: str, spec: dict[str, Any]) -> str:
        answer = self.call("put", key=key, spec=spec)
        assert "handle" in answer, answer
        return str(answer["handle"])

    def stop(self) -> int:
        """Close the connector, end the process; its exit status (killed if it hangs)."""
        if self.proc.poll() is None:
            try:
                self.call("close")
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                return self.proc.wait(timeout=30)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        return self.proc.wait()


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agent_env() -> dict[str, str]:
    """The environment in which a child can load Mooncake's engine; skips if none can."""
    from omni_runtime.connectors.mooncake import with_mooncake_library_path

    env = with_mooncake_library_path(os.environ)
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.engine"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        reason = f"Mooncake's transfer engine cannot be loaded ({last}): {HOW_TO_GET_IT}"
        if os.environ.get("OMNI_REQUIRE_MOONCAKE") == "1":
            pytest.fail(f"OMNI_REQUIRE_MOONCAKE=1, but {reason}")
        pytest.skip(reason)
    return env


def _extra(pool: int, **more: Any) -> dict[str, Any]:
    return {
        "host": "127.0.0.1",
        "zmq_port": 0,
        "protocol": "tcp",
        "device_name": "",
        "memory_pool_size": pool,
        "memory_pool_device": "cpu",
        **more,
    }


@pytest.fixture(scope="module")
def agents(
    agent_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, Agent]]:
    """A producer and a consumer (its host "auto", as in the deploy YAML)."""
    logs = tmp_path_factory.mktemp("mooncake-agents")
    started: list[Agent] = []
    try:
        started.append(Agent(_extra(96 * MiB), agent_env, logs / "producer.log"))
        started.append(Agent(_extra(96 * MiB, host="auto"), agent_env, logs / "consumer.log"))
        for agent in started:
            assert agent.started.get("ready"), (agent.started, agent.log_tail())
        yield started[0], started[1]
    finally:
        codes = [agent.stop() for agent in started]
    assert codes == [0] * len(started), "an agent did not close cleanly"


def _small_agent(env: dict[str, str], log: Path, **more: Any) -> Agent:
    agent = Agent(_extra(4 * MiB, **more), env, log)
    assert agent.started.get("ready"), (agent.started, agent.log_tail())
    return agent


# -- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        {"kind": "float32", "shape": [3, 5, 7], "seed": 1},
        {"kind": "bfloat16", "shape": [4, 33], "seed": 2},
        {"kind": "int64", "shape": [1000], "seed": 3},
        {"kind": "float32", "shape": [], "seed": 4},
        {"kind": "bfloat16", "shape": [0, 16], "seed": 5},
        {"kind": "int64", "shape": [6, 4], "seed": 6, "numpy": True},
    ],
    ids=["float32", "bfloat16", "int64", "scalar", "empty", "numpy-view"],
)
def test_round_trip_is_exact(agents: tuple[Agent, Agent], spec: dict[str, Any]) -> None:
    producer, consumer = agents
    handle = producer.put(f"rt-{spec['seed']}", spec)
    got = consumer.call("get", handle=handle)
    dtype, shape, want = expected(spec)
    assert (got.get("dtype"), got.get("shape")) == (dtype, shape), got
    assert got["digest"] == want


def test_64_mib_array(agents: tuple[Agent, Agent]) -> None:
    producer, consumer = agents
    spec = {"kind": "float32", "shape": [16 * MiB], "seed": 7}  # 64 MiB
    got = consumer.call("get", handle=producer.put("big", spec))
    assert got.get("shape") == [16 * MiB], got
    assert got["digest"] == expected(spec)[2]


def test_get_through_a_pool_smaller_than_the_array(
    agents: tuple[Agent, Agent], agent_env: dict[str, str], tmp_path: Path
) -> None:
    # The consumer's 4 MiB pool stages a 10 MiB array in pieces.
    producer, _ = agents
    small = _small_agent(agent_env, tmp_path / "small.log")
    try:
        spec = {"kind": "uint8", "shape": [10 * MiB + 3], "seed": 8}
        got = small.call("get", handle=producer.put("chunked", spec))
        assert got.get("digest") == expected(spec)[2], got
    finally:
        assert small.stop() == 0


def test_unknown_and_fetched_keys_are_errors_naming_the_key(agents: tuple[Agent, Agent]) -> None:
    producer, consumer = agents
    handle = producer.put("once", {"kind": "float32", "shape": [8], "seed": 9})
    forged = json.loads(handle)
    forged[1] = "no-such-key"  # ConnectorHandle is array-like: [connector, key, ...]
    unknown = consumer.call("get", handle=json.dumps(forged))
    assert unknown.get("error") == "ConnectorError", unknown
    assert "'no-such-key'" in unknown["message"]

    assert "digest" in consumer.call("get", handle=handle)
    again = consumer.call("get", handle=handle)  # one consumer per key: the first took it
    assert again.get("error") == "ConnectorError", again
    assert "'once'" in again["message"]


def test_a_get_without_the_handles_token_is_refused_and_the_array_stays(
    agents: tuple[Agent, Agent],
) -> None:
    producer, consumer = agents
    spec = {"kind": "float32", "shape": [256], "seed": 11}
    handle = producer.put("guarded", spec)
    fields = json.loads(handle)
    # ConnectorHandle is array-like: [connector, key, dtype, shape, nbytes, host, port,
    # extra, token].
    assert len(fields) == 9, fields
    assert len(fields[8]) >= 32, fields
    for token in ("", fields[8][::-1]):
        forged = consumer.call("get", handle=json.dumps([*fields[:8], token]))
        # Answered as a missing key: no slot address is given to a peer without the token.
        assert forged.get("error") == "ConnectorError", forged
        assert "'guarded' is not held" in forged["message"]
    got = consumer.call("get", handle=handle)
    assert got.get("digest") == expected(spec)[2], got


def test_release_and_get_free_the_slot(agent_env: dict[str, str], tmp_path: Path) -> None:
    producer = _small_agent(agent_env, tmp_path / "producer.log")
    consumer = _small_agent(agent_env, tmp_path / "consumer.log")
    whole_pool = {"kind": "uint8", "shape": [4 * MiB], "seed": 10}
    try:
        producer.put("a", whole_pool)
        full = producer.call("put", key="b", spec=whole_pool)
        assert full.get("error") == "ConnectorError", full
        assert str(4 * MiB) in full["message"]
        assert "'b'" in full["message"]

        assert producer.call("release", key="a") == {"ok": True}
        handle = producer.put("b", whole_pool)  # fits again

        assert consumer.call("get", handle=handle).get("digest") == expected(whole_pool)[2]
        producer.put("c", whole_pool)  # the get freed the producer's slot

        too_big = producer.call("put", key="d", spec={**whole_pool, "shape": [4 * MiB + 1]})
        assert too_big.get("error") == "ConnectorError", too_big
        assert str(4 * MiB) in too_big["message"]
        assert str(4 * MiB + 1) in too_big["message"]
    finally:
        assert [producer.stop(), consumer.stop()] == [0, 0]


def test_unfetched_array_expires_after_ttl(agent_env: dict[str, str], tmp_path: Path) -> None:
    ttl = 0.5
    producer = _small_agent(agent_env, tmp_path / "producer.log", ttl_seconds=ttl)
    consumer = _small_agent(agent_env, tmp_path / "consumer.log")
    whole_pool = {"kind": "uint8", "shape": [4 * MiB], "seed": 11}
    try:
        stale = producer.put("stale", whole_pool)
        put_at = time.monotonic()
        # The pool is full until expiry frees it: poll with a deadline.
        deadline = put_at + ttl + 10
        while True:
            answer = producer.call("put", key="fresh", spec=whole_pool)
            if "handle" in answer:
                break
            assert time.monotonic() < deadline, f"never expired: {answer}"
        assert time.monotonic() - put_at >= ttl * 0.9
        gone = consumer.call("get", handle=stale)
        assert gone.get("error") == "ConnectorError", gone
        assert "'stale'" in gone["message"]
        assert "expired" in gone["message"]
    finally:
        assert [producer.stop(), consumer.stop()] == [0, 0]


def _without_mooncake_libraries(env: dict[str, str]) -> dict[str, str]:
    from omni_runtime.connectors.mooncake import LIBRARY_PATH_ENV, mooncake_library_path

    ours = set((mooncake_library_path() or "").split(os.pathsep)) - {""}
    clean = {k: v for k, v in env.items() if k != LIBRARY_PATH_ENV}
    kept = [p for p in clean.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p not in ours]
    clean["LD_LIBRARY_PATH"] = os.pathsep.join(kept)
    return clean


def _assert_says_what_to_install(answer: dict[str, Any]) -> None:
    assert answer.get("error") == "ConnectorUnavailableError", answer
    message = answer["message"]
    for needed in (
        "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1",
        "mooncake-transfer-engine==0.3.13.post1",
        "libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200",
        "scripts/mooncake_libs.sh",
    ):
        assert needed in message, message
    assert "Traceback" not in message


def test_unavailable_without_system_libraries(tmp_path: Path) -> None:
    # Runs where the engine is missing too: the message is what such a machine shows.
    env = _without_mooncake_libraries(dict(os.environ))
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.engine"],
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    if probe.returncode == 0:
        pytest.skip("the libraries are installed system-wide here; nothing to take away")
    agent = Agent(_extra(MiB), env, tmp_path / "agent.log")
    try:
        _assert_says_what_to_install(agent.started)
        if importlib.util.find_spec("mooncake") is not None:
            assert "libibverbs.so.1" in agent.started["message"]
    finally:
        assert agent.stop() == 0


def test_unavailable_without_the_package(tmp_path: Path) -> None:
    # An environment whose `mooncake` has no engine: what a missing or wrong build looks like.
    (tmp_path / "shadow" / "mooncake").mkdir(parents=True)
    (tmp_path / "shadow" / "mooncake" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "shadow")}
    agent = Agent(_extra(MiB), env, tmp_path / "agent.log")
    try:
        _assert_says_what_to_install(agent.started)
        assert "No module named 'mooncake.engine'" in agent.started["message"]
    finally:
        assert agent.stop() == 0


def test_importing_the_module_does_not_load_mooncake() -> None:
    code = (
        "import sys, omni_runtime.connectors.mooncake as m; "
        "assert m.MooncakeTransferEngineConnector; "
        "print(sorted(n for n in sys.modules if n.split('.')[0] == 'mooncake'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_library_path_precedence(tmp_path: Path) -> None:
    code = "from omni_runtime.connectors.mooncake import mooncake_library_path as f; print(f())"

    def run(**env: str) -> str:
        base = {k: v for k, v in os.environ.items() if k != "OMNI_MOONCAKE_LIBRARY_PATH"}
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**base, **env},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return out.stdout.strip()

    cache = tmp_path / "cache"
    assert run(OMNI_CACHE_DIR=str(cache)) == "None"  # nothing extracted there
    root = cache / "mooncake-libs" / "k1"
    for sub, lib in [
        ("usr/lib/x86_64-linux-gnu", "libibverbs.so.1"),
        ("usr/lib/x86_64-linux-gnu", "librdmacm.so.1"),
        ("usr/lib/x86_64-linux-gnu", "libnl-route-3.so.200"),
        ("lib/x86_64-linux-gnu", "libnl-3.so.200"),
    ]:
        (root / sub).mkdir(parents=True, exist_ok=True)
        (root / sub / lib).write_bytes(b"")
    (cache / "mooncake-libs" / "current").symlink_to("k1")
    assert run(OMNI_CACHE_DIR=str(cache)) == "None"  # not marked complete
    (root / ".complete").write_text("")
    resolved = root.resolve()
    want = f"{resolved}/usr/lib/x86_64-linux-gnu:{resolved}/lib/x86_64-linux-gnu"
    assert run(OMNI_CACHE_DIR=str(cache)) == want
    assert run(OMNI_CACHE_DIR=str(cache), OMNI_MOONCAKE_LIBRARY_PATH="/x:/y") == "/x:/y"
    assert run(OMNI_CACHE_DIR=str(cache), OMNI_MOONCAKE_LIBRARY_PATH="") == "None"


if __name__ == "__main__" and sys.argv[1:2] == ["--agent"]:
    sys.exit(_agent_main(sys.argv[2]))
