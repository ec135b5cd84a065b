"""Throughput of the connectors against the plain copy each one competes with.

For each size (float32 arrays of that many MiB, or ``kv``: BAGEL-7B-MoT's context KV cache
for a 512x512 edit, bf16 [2, 28 layers, 2,350 tokens, 4 KV heads, 128], 129 MiB), side by
side in one run, the median over ``--repeat`` runs after ``--warmup`` of:

- SharedMemoryConnector: put + get (+ dropping the tensor, which hands the segment back),
  in this process, against a numpy copy into a preallocated buffer. Target: 0.8x.
- TCPConnector: the producer in another process, the consumer here; one run is "put this
  array" sent to the producer over a pipe, the handle back, and the get. Against a plain
  loopback TCP socket between two processes: "send N bytes" over the same kind of pipe,
  then the bytes from a preallocated array into a preallocated buffer. Target: 0.7x.
- MooncakeTransferEngineConnector (tcp transport), as the TCP connector, both ends in child
  processes (they need Mooncake's libraries at process start); skipped with a note where
  the engine does not load.

With ``kv``, one more shared-memory row: the put as BAGEL's thinker stage makes it, of the
thinker's rows (a token's keys and values per row, [tokens, 2 * layers * heads * dim]) seen
as [2, layers, tokens, heads, dim], so that the connector's one copy also reorders them.

Runs of the two sides of one row alternate, so that a noisy neighbour hits both alike.
Prints a markdown table; `--json` prints the figures as JSON.

    .venv/bin/python bench/connector_throughput.py [--sizes-mib 4,64,kv] [--repeat 15]
        [--warmup 3] [--no-mooncake] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import msgspec
import numpy as np

from omni_runtime.connectors import ConnectorError, ConnectorHandle, OmniConnector

MiB = 1 << 20
TARGETS = {"shared memory": 0.8, "tcp": 0.7, "mooncake": 0.7}
_SIZE = struct.Struct("!Q")
AGENT_START_TIMEOUT = 120.0


# BAGEL-7B-MoT's KV per request: keys and values, 28 layers, ~2,350 context tokens of a
# 512x512 edit (1,024 VAE + ~1,300 ViT + text), 4 KV heads of 128, bf16.
KV_SHAPE = (2, 28, 2350, 4, 128)
KV = "kv"


def payload_bytes(payload: str) -> int:
    """Bytes of a payload: "kv", or a number of MiB of float32."""
    return math.prod(KV_SHAPE) * 2 if payload == KV else int(payload) * MiB


def source_array(payload: str) -> Any:
    """The array a payload names: float32 numpy, or BAGEL's KV as a bf16 torch tensor."""
    if payload == KV:
        import torch

        generator = torch.Generator().manual_seed(0)
        return torch.randn(KV_SHAPE, generator=generator).to(torch.bfloat16)
    return np.random.default_rng(0).random(payload_bytes(payload) // 4, dtype=np.float32)


def raw_bytes(array: Any) -> memoryview:
    """The bytes of a numpy array or a (bf16) torch tensor, without a copy."""
    if isinstance(array, np.ndarray):
        return array.data.cast("B")
    import torch

    return memoryview(array.view(torch.uint8).numpy()).cast("B")


def same(got: Any, expected: Any) -> bool:
    return bytes(raw_bytes(got.contiguous())) == bytes(raw_bytes(expected))


def median_rate(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def alternate(
    first: Callable[[], None], second: Callable[[], None], warmup: int, repeat: int
) -> tuple[list[float], list[float]]:
    """Seconds per run of each, runs interleaved; the first ``warmup`` of each dropped."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(warmup + repeat):
        for run, out in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            run()
            if i >= warmup:
                out.append(time.perf_counter() - start)
    return times


# -- shared memory, in this process ----------------------------------------------------------


def measure_shared_memory(sizes: list[str], warmup: int, repeat: int) -> list[dict[str, Any]]:
    from omni_runtime.connectors.shared_memory import SharedMemoryConnector

    rows = []
    connector = SharedMemoryConnector("bench-shm")
    try:
        for payload in sizes:
            src = source_array(payload)
            dst = np.empty(payload_bytes(payload), dtype=np.uint8)

            def memcpy(src: Any = src, dst: np.ndarray = dst) -> None:
                np.copyto(dst, np.frombuffer(raw_bytes(src), dtype=np.uint8))

            def put_get(src: Any = src) -> None:
                tensor = connector.get(connector.put("bench", src))
                del tensor  # hands the segment back for the next put

            check = connector.get(connector.put("check", src))
            assert same(check, src)
            del check
            base, conn = alternate(memcpy, put_get, warmup, repeat)
            rows.append(_row("shared memory", "memcpy", payload, conn, base))
            if payload == KV:
                # The thinker's rows, reordered by the put (llm_frontend._hand_off_context).
                two, layers, tokens, heads, dim = KV_SHAPE
                thinker_rows = src.permute(2, 0, 1, 3, 4).contiguous().view(tokens, -1)
                view = thinker_rows.view(tokens, two, layers, heads, dim).permute(1, 2, 0, 3, 4)
                check = connector.get(connector.put("check", view))
                assert same(check, src)
                del check
                base, conn = alternate(memcpy, lambda v=view: put_get(v), warmup, repeat)
                row = _row("shared memory", "memcpy", payload, conn, base)
                row["connector"] = "shared memory, thinker rows reordered by the put"
                rows.append(row)
    finally:
        connector.close()
    return rows


def _row(
    kind: str, baseline: str, payload: str, conn: list[float], base: list[float]
) -> dict[str, Any]:
    nbytes = payload_bytes(payload)
    rate, base_rate = median_rate(nbytes, conn), median_rate(nbytes, base)
    return {
        "connector": kind,
        "baseline": baseline,
        "payload": f"BAGEL KV {nbytes / MiB:.0f} MiB bf16" if payload == KV else f"{payload} MiB",
        "ms": statistics.median(conn) * 1e3,
        "baseline_ms": statistics.median(base) * 1e3,
        "gb_s": rate,
        "baseline_gb_s": base_rate,
        "ratio": rate / base_rate,
        "target": TARGETS[kind],
    }


# -- pull connectors: a producer agent in a child process -------------------------------------


class Agent:
    """This script in a child process (``--agent KIND``), driven by JSON lines on stdin."""

    def __init__(self, kind: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--agent", kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.ready = self.read(AGENT_START_TIMEOUT)

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"agent exited (rc {self.proc.wait(timeout)})")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def make_pull_connector(kind: str, name: str) -> OmniConnector:
    if kind == "tcp":
        from omni_runtime.connectors.tcp import TCPConnector

        return TCPConnector(name, {"bind_host": "127.0.0.1"})
    from omni_runtime.connectors.mooncake import MooncakeTransferEngineConnector

    extra = {"host": "127.0.0.1", "protocol": "tcp", "memory_pool_size": 512 * MiB}
    return MooncakeTransferEngineConnector(name, extra)


def agent_main(kind: str) -> int:
    """A producer for ``kind`` (a connector, or "socket": the plain socket baseline)."""
    out = sys.stdout

    def reply(**fields: Any) -> None:
        out.write(json.dumps(fields) + "\n")
        out.flush()

    # Libraries must not write to the pipe the bench reads.
    sys.stdout = sys.stderr
    arrays: dict[str, Any] = {}
    if kind == "socket":
        return _socket_agent(reply, arrays)
    try:
        connector = make_pull_connector(kind, f"bench-{kind}")
    except ConnectorError as e:
        reply(error=str(e))
        return 0
    reply(ready=True)
    try:
        for line in sys.stdin:
            command = json.loads(line)
            payload = command["payload"]
            if payload not in arrays:
                arrays[payload] = source_array(payload)
            handle = connector.put(command["key"], arrays[payload])
            reply(handle=msgspec.json.encode(handle).decode())
    finally:
        connector.close()
    return 0


def _socket_agent(reply: Callable[..., None], arrays: dict[str, Any]) -> int:
    listener = socket.create_server(("127.0.0.1", 0))
    reply(ready=True, port=listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn, listener:
        for line in sys.stdin:
            payload = json.loads(line)["payload"]
            if payload not in arrays:
                arrays[payload] = source_array(payload)
            conn.sendall(raw_bytes(arrays[payload]))
    return 0


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("baseline producer closed the connection")
        got += n


def measure_pull(kind: str, sizes: list[str], warmup: int, repeat: int) -> list[dict[str, Any]]:
    """The connector ``kind`` (producer in a child, consumer here) against a plain socket."""
    env = None
    if kind == "mooncake":
        from omni_runtime.connectors.mooncake import with_mooncake_library_path

        env = with_mooncake_library_path(os.environ)
    producer = Agent(kind, env)
    plain = Agent("socket")
    consumer = make_pull_connector(kind, f"bench-{kind}")
    data = socket.create_connection(("127.0.0.1", int(plain.ready["port"])))
    data.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rows = []
    counter = itertools.count()
    try:
        for payload in sizes:
            nbytes = payload_bytes(payload)
            buffer = np.empty(nbytes, dtype=np.uint8)

            def pull(payload: str = payload, nbytes: int = nbytes) -> None:
                producer.send(key=f"k{next(counter)}", payload=payload)
                handle = msgspec.json.decode(producer.read()["handle"], type=ConnectorHandle)
                tensor = consumer.get(handle)
                assert tensor.numel() * tensor.element_size() == nbytes

            def socket_pull(payload: str = payload, buffer: np.ndarray = buffer) -> None:
                plain.send(payload=payload)
                _recv_into(data, buffer.data)

            producer.send(key="check", payload=payload)
            handle = msgspec.json.decode(producer.read()["handle"], type=ConnectorHandle)
            check = consumer.get(handle)
            assert same(check, source_array(payload))
            base, conn = alternate(socket_pull, pull, warmup, repeat)
            rows.append(_row(kind, "plain TCP socket", payload, conn, base))
    finally:
        data.close()
        consumer.close()
        producer.stop()
        plain.stop()
    return rows


def measure_mooncake(sizes: list[str], warmup: int, repeat: int) -> list[dict[str, Any]] | str:
    """Rows for Mooncake, or why there are none. Run in a child: the engine's libraries must
    be on LD_LIBRARY_PATH when the process starts."""
    try:
        from omni_runtime.connectors.mooncake import with_mooncake_library_path
    except ImportError as e:
        return f"omni_runtime.connectors.mooncake does not import ({e})"
    args = ["--mooncake-consumer", f"--warmup={warmup}", f"--repeat={repeat}"]
    args.append("--sizes-mib=" + ",".join(sizes))
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *args],
        capture_output=True,
        text=True,
        env=with_mooncake_library_path(os.environ),
        timeout=600,
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        return f"Mooncake run failed (rc {result.returncode}): {result.stderr.strip()[-300:]}"
    answer = json.loads(lines[-1])
    if "skipped" in answer:
        return str(answer["skipped"])
    rows: list[dict[str, Any]] = answer["rows"]
    return rows


def mooncake_consumer_main(sizes: list[str], warmup: int, repeat: int) -> int:
    out = sys.stdout
    sys.stdout = sys.stderr
    try:
        rows = measure_pull("mooncake", sizes, warmup, repeat)
    except (ConnectorError, RuntimeError) as e:
        out.write(json.dumps({"skipped": f"Mooncake unavailable: {e}"}) + "\n")
        return 0
    out.write(json.dumps({"rows": rows}) + "\n")
    return 0


def print_table(rows: list[dict[str, Any]], notes: list[str], out: TextIO) -> None:
    out.write(
        "| connector | payload | connector ms | GB/s | baseline | baseline ms | GB/s | ratio "
        "| target |\n"
    )
    out.write("|---|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        verdict = "ok" if r["ratio"] >= r["target"] else "MISSED"
        out.write(
            f"| {r['connector']} | {r['payload']} | {r['ms']:.1f} | {r['gb_s']:.2f} | "
            f"{r['baseline']} | {r['baseline_ms']:.1f} | {r['baseline_gb_s']:.2f} | "
            f"{r['ratio']:.2f}x | {r['target']}x {verdict} |\n"
        )
    for note in notes:
        out.write(f"\n{note}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes-mib",
        default="4,64,kv",
        help="comma-separated sizes: MiB of float32, or kv (BAGEL-7B's context KV, bf16)",
    )
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-mooncake", dest="mooncake", action="store_false")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--agent", help=argparse.SUPPRESS)
    parser.add_argument("--mooncake-consumer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        sys.exit(agent_main(args.agent))
    sizes = args.sizes_mib.split(",")
    for size in sizes:
        if size != KV and not size.isdigit():
            parser.error(f"--sizes-mib: {size!r} is neither a number of MiB nor {KV!r}")
    if args.mooncake_consumer:
        sys.exit(mooncake_consumer_main(sizes, args.warmup, args.repeat))
    rows = measure_shared_memory(sizes, args.warmup, args.repeat)
    rows += measure_pull("tcp", sizes, args.warmup, args.repeat)
    notes = [
        f"median of {args.repeat} runs after {args.warmup} warm-up runs; "
        f"{os.cpu_count()} CPUs; shared memory measured within one process."
    ]
    if args.mooncake:
        mooncake = measure_mooncake(sizes, args.warmup, args.repeat)
        if isinstance(mooncake, str):
            notes.append(f"Mooncake skipped: {mooncake}")
        else:
            rows += mooncake
    if args.json:
        print(json.dumps({"rows": rows, "notes": notes}, indent=2))
        return
    print_table(rows, notes, sys.stdout)


if __name__ == "__main__":
    main()
