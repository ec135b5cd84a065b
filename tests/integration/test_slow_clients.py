"""Clients that stall, over real sockets: a real router (its server as ``omni-runtime
router`` and ``serve`` configure it, no ML stage), a real TCP connector and a stage's real
probe port. Each stalled connection must end by its deadline, never well before it, and
everything else must be served meanwhile.

The deadlines are set small here (1-3 s) so that the module stays fast; each case prints
how long the stall took to end (``pytest -s``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import msgspec
import numpy as np
import pytest
import torch  # noqa: F401  (a get makes a tensor: imported here, not in a timed get)
from serving import RunningRouter, pipeline_from, running_router, wait_until

from omni_runtime.connectors.base import ConnectorError, ConnectorHandle
from omni_runtime.connectors.tcp import TCPConnector
from omni_runtime.router.limits import RouterLimits
from omni_runtime.stage_server.probes import start_probe_server

pytestmark = pytest.mark.integration

PIPELINE = pipeline_from(
    {
        "model": "m",
        "stages": [{"stageId": 0, "name": "chat", "type": "llm"}],
        "router": {"servedModelName": "tiny"},
    }
)
# What a late answer may take beyond its deadline on a busy 2-core machine, and how much
# before it a deadline may fire (timer granularity).
SLACK_S = 2.0
EARLY_S = 0.1
# The router's socket reads in these tests wait at most this long for anything.
READ_S = 15.0


@contextmanager
def router_with(limits: RouterLimits) -> Iterator[RunningRouter]:
    """The router with ``limits``, served as ``omni-runtime router`` serves it
    (``running_router`` uses ``router_server_config``). Its one stage has no replica:
    nothing here needs one."""
    with running_router(PIPELINE, {}, limits=limits, wait_for_replicas=False) as running:
        yield running


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes; AssertionError if it does not within
    READ_S."""
    sock.settimeout(READ_S)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass  # closed, with what came before
    except TimeoutError:
        raise AssertionError(f"not closed within {READ_S} s; got {data[:300]!r}") from None
    return data


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


def assert_ended_by(elapsed: float, deadline: float, what: str) -> None:
    print(f"{what}: ended after {elapsed:.2f} s (deadline {deadline:g} s)")
    assert deadline - EARLY_S <= elapsed <= deadline + SLACK_S, (what, elapsed, deadline)


def request_head(path: str, *, method: str = "GET", length: int | None = None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: router\r\n"
    if length is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {length}\r\n"
    return (head + "\r\n").encode()


def get_on(sock: socket.socket, path: str) -> tuple[int, dict[str, str], bytes]:
    """A keep-alive GET on ``sock``: its response, read to its Content-Length."""
    sock.sendall(request_head(path))
    sock.settimeout(READ_S)
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += sock.recv(65536)
    status, headers, body = parse_response(raw)
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return status, headers, body


STALLS = RouterLimits(
    header_timeout_s=2.0, body_timeout_s=2.0, min_body_bytes_per_s=2000, send_timeout_s=2.0
)


def test_stalled_clients_end_by_their_deadlines_while_good_requests_are_served() -> None:
    with router_with(STALLS) as router, httpx.Client(base_url=router.url, timeout=5) as http:
        started = time.monotonic()
        body = router.connect(READ_S)
        body.sendall(request_head("/v1/chat/completions", method="POST", length=100_000))
        body.sendall(b" " * 200)
        head = router.connect(READ_S)
        head.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-")
        idle = router.connect(READ_S)

        # Served at once all the while, and before any stall has ended.
        for path, status in (("/v1/models", 200), ("/health", 503), ("/livez", 200)):
            t0 = time.monotonic()
            response = http.get(path)
            assert response.status_code == status, response.text
            assert time.monotonic() - t0 < 1.0, path
        assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
        for sock in (body, head, idle):
            readable, _, _ = select.select([sock], [], [], 0)
            assert not readable, "a stalled connection ended before its deadline"

        raw = read_to_close(body)
        assert_ended_by(time.monotonic() - started, STALLS.body_timeout_s, "stalled body")
        status, headers, payload = parse_response(raw)
        assert status == 408
        assert headers["connection"] == "close"
        error = json.loads(payload)["error"]
        assert error["code"] == 408
        assert error["type"] == "invalid_request_error"
        assert "200 bytes" in error["message"], error

        raw = read_to_close(head)
        assert_ended_by(time.monotonic() - started, STALLS.header_timeout_s, "stalled head")
        status, headers, payload = parse_response(raw)
        assert status == 408
        assert headers["connection"] == "close"
        assert "head" in json.loads(payload)["error"]["message"]

        # Nothing of a request came: closed without an answer a client could misread.
        assert read_to_close(idle) == b""
        assert_ended_by(time.monotonic() - started, STALLS.header_timeout_s, "idle connection")

        for sock in (body, head, idle):
            sock.close()
        assert http.get("/v1/models").status_code == 200


def test_a_stalled_multipart_body_at_images_edits_gets_a_408() -> None:
    # The form is parsed as it streams in: the stall is in the middle of its image.
    boundary = "b0undary"
    part = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n'
            "Content-Type: image/png\r\n\r\n"
        ).encode()
        + b"\x89PNG"
        + b"\x00" * 100
    )
    head = (
        "POST /v1/images/edits HTTP/1.1\r\nHost: router\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
        "Content-Length: 100000\r\n\r\n"
    ).encode()
    with router_with(STALLS) as router:
        sock = router.connect(READ_S)
        sock.sendall(head + part)
        started = time.monotonic()
        status, _, payload = parse_response(read_to_close(sock))
        assert_ended_by(time.monotonic() - started, STALLS.body_timeout_s, "stalled form")
        assert status == 408
        assert json.loads(payload)["error"]["code"] == 408
        sock.close()


def test_nine_hundred_idle_connections_all_end_by_their_deadline() -> None:
    # What was seen before: 900 idle connections to a chat pipeline, every one open past
    # 65 s. The defaults but the head's deadline: 512 held, the rest past the bound.
    limits = RouterLimits(header_timeout_s=2.0)
    with router_with(limits) as router:
        started = time.monotonic()
        idle = [router.connect(READ_S) for _ in range(900)]
        probe = router.connect(READ_S)
        probe.sendall(request_head("/livez"))
        assert parse_response(read_to_close(probe))[0] == 200
        probe.close()
        for sock in idle:
            assert read_to_close(sock) == b""
            sock.close()
        assert_ended_by(time.monotonic() - started, limits.header_timeout_s, "900 idle")
        with httpx.Client(base_url=router.url, timeout=5) as http:
            assert http.get("/v1/models").status_code == 200


def test_the_head_deadline_starts_again_with_the_next_requests_first_byte() -> None:
    with router_with(STALLS) as router:
        sock = router.connect(READ_S)
        status, _, _ = get_on(sock, "/v1/models")
        assert status == 200
        # Idle after an answer is keep-alive's (75 s), not the head's deadline.
        readable, _, _ = select.select([sock], [], [], STALLS.header_timeout_s + 1.0)
        assert not readable, "a kept-alive connection was closed at the head's deadline"
        status, _, _ = get_on(sock, "/v1/models")
        assert status == 200
        # The next request's first bytes start its head's clock.
        started = time.monotonic()
        sock.sendall(b"GET /v1/mo")
        status, _, _ = parse_response(read_to_close(sock))
        assert_ended_by(time.monotonic() - started, STALLS.header_timeout_s, "second head")
        assert status == 408
        sock.close()


def test_blank_lines_between_requests_do_not_hold_the_connection() -> None:
    # The parser skips them, so without a clock of their own they would hold it forever.
    with router_with(STALLS) as router:
        sock = router.connect(READ_S)
        assert get_on(sock, "/v1/models")[0] == 200
        started = time.monotonic()
        sock.sendall(b"\r\n")
        assert read_to_close(sock) == b""
        assert_ended_by(time.monotonic() - started, STALLS.header_timeout_s, "blank lines")
        sock.close()


def test_a_slow_but_steady_body_is_read_and_a_trickle_below_the_rate_is_not() -> None:
    limits = RouterLimits(header_timeout_s=2.0, body_timeout_s=1.0, min_body_bytes_per_s=2000)
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "bogus": 1}'
    body += b" " * (12_000 - len(body))
    with router_with(limits) as router:
        # 4000 bytes/s, twice the floor, for 3 s: three times the longest pause allowed.
        steady = router.connect(READ_S)
        steady.sendall(request_head("/v1/chat/completions", method="POST", length=len(body)))
        started = time.monotonic()
        for offset in range(0, len(body), 200):
            steady.sendall(body[offset : offset + 200])
            time.sleep(0.05)  # the client's pace, the thing under test
        took = time.monotonic() - started
        steady.settimeout(READ_S)
        raw = steady.recv(65536)
        status, _, payload = parse_response(raw)
        print(f"steady body: {len(body)} bytes in {took:.2f} s, answered {status}")
        assert took > 2 * limits.body_timeout_s
        # Read to its end: the body's unknown field is what the router refused.
        assert status == 400, payload
        assert json.loads(payload)["error"]["param"] == "bogus"
        steady.close()

        # 500 bytes/s, a quarter of the floor, never pausing for as long as 1 s: each 200
        # bytes buy 0.1 s, so its deadline moves 0.1 s per 0.4 s and is met about 1.2 s in.
        slow = router.connect(READ_S)
        slow.sendall(request_head("/v1/chat/completions", method="POST", length=len(body)))
        started = time.monotonic()
        status = 0
        for offset in range(0, len(body), 200):
            try:
                slow.sendall(body[offset : offset + 200])
            except (BrokenPipeError, ConnectionResetError):
                break
            readable, _, _ = select.select([slow], [], [], 0.4)
            if readable:
                status, _, _ = parse_response(read_to_close(slow))
                break
        elapsed = time.monotonic() - started
        print(f"trickle at 500 bytes/s: ended after {elapsed:.2f} s")
        assert status == 408
        assert limits.body_timeout_s <= elapsed <= 1.2 + 0.4 + SLACK_S
        slow.close()


def test_an_early_answer_does_not_let_the_rest_of_the_body_hold_the_connection() -> None:
    # A declared length over the limit is a 413 before any of the body is read; the body
    # that follows still has its deadline.
    limits = RouterLimits(body_timeout_s=1.0, min_body_bytes_per_s=2000, max_body_bytes=1000)
    with router_with(limits) as router:
        sock = router.connect(READ_S)
        sock.sendall(request_head("/v1/chat/completions", method="POST", length=100_000))
        sock.settimeout(READ_S)
        status, _, _ = parse_response(sock.recv(65536))
        assert status == 413
        started = time.monotonic()
        sock.sendall(b" " * 200)
        read_to_close(sock)
        assert_ended_by(time.monotonic() - started, limits.body_timeout_s, "body after a 413")
        sock.close()


def test_a_response_nobody_reads_ends_by_the_send_deadline() -> None:
    limits = RouterLimits(send_timeout_s=1.0)
    requests = 400
    with router_with(limits) as router:
        sock = socket.socket()
        # Set before connecting, so that the window stays this small.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((router.host, router.port))
        # Pipelined GETs of the OpenAPI document (20 KiB each, 8 MB in all: past what the
        # kernel's buffers hold), never read: the router's writes stop.
        sock.sendall(request_head("/openapi.json") * requests)
        started = time.monotonic()
        connections = router.server.server_state.connections
        wait_until(lambda: connections, 10, "the router has the connection")
        wait_until(lambda: not connections, 30, "the router let go of a client that never reads")
        elapsed = time.monotonic() - started
        print(f"unread responses: let go after {elapsed:.2f} s (deadline 1 s once stuck)")
        assert elapsed >= limits.send_timeout_s - EARLY_S
        # What the kernel had taken still arrives, then the end: not every answer.
        received = read_to_close(sock)
        assert 0 < received.count(b"HTTP/1.1 200 OK") < requests
        sock.close()


def test_past_the_connection_bound_a_503_while_the_probes_answer() -> None:
    limits = RouterLimits(header_timeout_s=3.0, max_connections=8)
    with router_with(limits) as router:
        started = time.monotonic()
        held = [router.connect(READ_S) for _ in range(limits.max_connections)]

        over = router.connect(READ_S)
        over.sendall(request_head("/v1/models"))
        status, headers, payload = parse_response(read_to_close(over))
        assert status == 503, payload
        assert headers["retry-after"] == "1"
        assert headers["connection"] == "close"
        error = json.loads(payload)["error"]
        assert error["code"] == 503
        assert "limit of 8 connections" in error["message"]
        over.close()

        # The kubelet's probes are answered by the app itself, and the connection closes.
        probe = router.connect(READ_S)
        probe.sendall(request_head("/livez"))
        status, headers, payload = parse_response(read_to_close(probe))
        assert status == 200
        assert json.loads(payload) == {"status": "ok"}
        assert headers["connection"] == "close"
        probe.close()
        probe = router.connect(READ_S)
        probe.sendall(request_head("/health"))
        status, _, payload = parse_response(read_to_close(probe))
        # The app's own answer for a stage without a replica, not the bound's.
        assert status == 503
        assert "no live replica" in json.loads(payload)["error"], payload
        probe.close()
        assert time.monotonic() - started < limits.header_timeout_s, "too slow to tell"

        # Past the bound a head gets a second, not the header deadline.
        late = router.connect(READ_S)
        t0 = time.monotonic()
        assert read_to_close(late) == b""
        assert_ended_by(time.monotonic() - t0, 1.0, "idle connection past the bound")
        late.close()

        for sock in held:
            assert read_to_close(sock) == b""
            sock.close()
        assert_ended_by(time.monotonic() - started, limits.header_timeout_s, "held connections")
        with httpx.Client(base_url=router.url, timeout=5) as http:
            assert http.get("/v1/models").status_code == 200


def test_past_the_bound_the_longest_waiting_head_gives_way_to_a_newer_one() -> None:
    # Past the bound only so many wait for their heads at once (16 for a small bound): a
    # flood of idle ones cannot keep a probe out.
    limits = RouterLimits(header_timeout_s=10.0, max_connections=2)
    with router_with(limits) as router:
        held = [router.connect(READ_S) for _ in range(limits.max_connections)]
        first_waiting = time.monotonic()
        waiting = [router.connect(READ_S) for _ in range(16)]
        probe = router.connect(READ_S)
        probe.sendall(request_head("/livez"))
        status, _, _ = parse_response(read_to_close(probe))
        assert status == 200
        # Before any of them is a second old (their deadline past the bound), the first to
        # wait was dropped for the probe, and only it.
        assert time.monotonic() - first_waiting < 1.0, "too slow to tell"
        readable, _, _ = select.select(waiting, [], [], 0)
        assert readable == [waiting[0]]
        assert read_to_close(waiting[0]) == b""
        for sock in held + waiting + [probe]:
            sock.close()


# -- the TCP connector ---------------------------------------------------------------------

_LENGTH = struct.Struct("!I")


@contextmanager
def tcp_pair(**extra: object) -> Iterator[tuple[TCPConnector, TCPConnector, ConnectorHandle]]:
    producer = TCPConnector("tcp", {"bind_host": "127.0.0.1", **extra})
    consumer = TCPConnector("tcp", {"timeout_seconds": 5})
    try:
        yield producer, consumer, producer.put("first", np.arange(1000, dtype=np.float32))
    finally:
        consumer.close()
        producer.close()


def assert_fetches(producer: TCPConnector, consumer: TCPConnector, key: str) -> None:
    array = np.full(4096, 7, dtype=np.int64)
    t0 = time.monotonic()
    got = consumer.get(producer.put(key, array))
    assert np.array_equal(got.numpy(), array)
    assert time.monotonic() - t0 < 1.0, "a get waited on a stalled peer"


def test_tcp_a_peer_that_sends_nothing_is_dropped_while_gets_go_on() -> None:
    with tcp_pair(idle_seconds=1.0, timeout_seconds=1.0) as (producer, consumer, handle):
        peer = socket.create_connection((handle.host, handle.port))
        started = time.monotonic()
        assert_fetches(producer, consumer, "during")
        assert np.array_equal(consumer.get(handle).numpy(), np.arange(1000, dtype=np.float32))
        assert read_to_close(peer) == b""
        assert_ended_by(time.monotonic() - started, 1.0, "tcp: idle peer")
        peer.close()


@pytest.mark.parametrize("pace", [None, 0.3], ids=["half-request", "trickle"])
def test_tcp_a_peer_that_stalls_mid_request_is_dropped_by_the_deadline(pace: float | None) -> None:
    # The request deadline is the whole request's: a byte per 0.3 s, each well within a
    # per-read timeout, does not stretch it.
    with tcp_pair(idle_seconds=30.0, timeout_seconds=1.0) as (producer, consumer, handle):
        peer = socket.create_connection((handle.host, handle.port))
        request = _LENGTH.pack(100) + b"\x92\xa5first"
        peer.sendall(request[:1])
        started = time.monotonic()
        if pace is None:
            peer.sendall(request[1:8])
        else:
            for byte in request[1:]:
                try:
                    peer.sendall(bytes([byte]))
                except (BrokenPipeError, ConnectionResetError):
                    break
                readable, _, _ = select.select([peer], [], [], pace)
                if readable:
                    break
        assert_fetches(producer, consumer, "during")
        assert read_to_close(peer) == b""
        what = "tcp: trickling request" if pace else "tcp: half a request"
        assert_ended_by(time.monotonic() - started, 1.0, what)
        peer.close()


def test_tcp_at_the_bound_idle_connections_make_room_and_busy_ones_refuse() -> None:
    with tcp_pair(idle_seconds=30.0, timeout_seconds=1.0, max_connections=4) as (
        producer,
        consumer,
        handle,
    ):
        idle = [socket.create_connection((handle.host, handle.port)) for _ in range(4)]
        # The consumer's connection takes the place of the one idle longest.
        assert_fetches(producer, consumer, "room")
        idle[0].settimeout(READ_S)
        assert read_to_close(idle[0]) == b""
        for sock in idle:
            sock.close()

        # Four peers each half way through a request: no room until their deadline.
        busy = []
        for _ in range(4):
            sock = socket.create_connection((handle.host, handle.port))
            sock.sendall(_LENGTH.pack(100) + b"\x92")
            busy.append(sock)
        server = producer._state.server
        assert server is not None
        fresh = TCPConnector("tcp", {"timeout_seconds": 5})
        try:
            # Each takes the place of an idle one (the consumer's kept one among them).
            wait_until(
                lambda: list(server.connections.values()) == [None] * 4,
                10,
                "the four busy peers all that the producer holds",
            )
            with pytest.raises(ConnectorError, match="closed the connection"):
                fresh.get(producer.put("refused", np.zeros(4)))
            for sock in busy:
                assert read_to_close(sock) == b""
                sock.close()
            assert np.array_equal(fresh.get(handle).numpy(), np.arange(1000, dtype=np.float32))
        finally:
            fresh.close()


def test_tcp_a_get_from_a_producer_that_trickles_ends_by_its_deadline() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = int(listener.getsockname()[1])
    stop = threading.Event()

    def trickling_producer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            header = msgspec.msgpack.encode(["uint8", [1000], 1000])
            conn.sendall(_LENGTH.pack(len(header)) + header)
            while not stop.wait(0.2):
                try:
                    conn.sendall(b"\x00")
                except OSError:
                    return

    thread = threading.Thread(target=trickling_producer, daemon=True)
    thread.start()
    consumer = TCPConnector("tcp", {"timeout_seconds": 1.0})
    handle = ConnectorHandle("tcp", "k", "uint8", [1000], 1000, host="127.0.0.1", port=port)
    try:
        started = time.monotonic()
        with pytest.raises(ConnectorError, match="timed out after 1 s"):
            consumer.get(handle)
        assert_ended_by(time.monotonic() - started, 1.0, "tcp: trickling producer")
    finally:
        stop.set()
        thread.join(timeout=10)
        consumer.close()
        listener.close()


# -- a stage's probe port --------------------------------------------------------------------


async def _read_to_close(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(), READ_S)


async def _probe(port: int, path: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request_head(path))
    status, _, _ = parse_response(await _read_to_close(reader))
    writer.close()
    return status


async def test_probe_port_drops_stalled_and_trickling_heads_and_answers_probes() -> None:
    server = await start_probe_server("127.0.0.1", 0, lambda: {"chat": None}, head_timeout=1.0)
    port = int(server.sockets[0].getsockname()[1])
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        trickle_reader, trickle_writer = await asyncio.open_connection("127.0.0.1", port)
        trickle_writer.write(b"GET /livez HTTP/1.1\r\n")

        async def trickle() -> None:
            # A header line per 0.3 s: each within a per-line timeout, not the head's.
            while not trickle_writer.is_closing():
                trickle_writer.write(b"X-Slow: 1\r\n")
                with contextlib.suppress(ConnectionError):
                    await trickle_writer.drain()
                await asyncio.sleep(0.3)  # the client's pace, the thing under test

        trickling = asyncio.create_task(trickle())
        assert await _probe(port, "/livez") == 200
        assert await _probe(port, "/readyz") == 200
        assert await _read_to_close(idle_reader) == b""
        assert_ended_by(loop.time() - started, 1.0, "probe port: idle")
        assert await _read_to_close(trickle_reader) == b""
        assert_ended_by(loop.time() - started, 1.0, "probe port: trickling head")
        trickling.cancel()
        idle_writer.close()
        trickle_writer.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_probe_port_flooded_with_idle_connections_still_answers_probes() -> None:
    # A head deadline far past the reads here: the flood's oldest goes only to make room.
    server = await start_probe_server(
        "127.0.0.1", 0, lambda: {"chat": "loading"}, head_timeout=60.0, max_connections=4
    )
    port = int(server.sockets[0].getsockname()[1])
    try:
        flood = [await asyncio.open_connection("127.0.0.1", port) for _ in range(8)]
        assert await _probe(port, "/livez") == 200
        assert await _probe(port, "/readyz") == 503
        # Room for four: the fifth flooding connection and each probe's took the place of
        # the oldest (the second probe's, of none: the first probe's was done).
        for reader, _ in flood[:5]:
            assert await _read_to_close(reader) == b""
        assert not any(reader.at_eof() for reader, _ in flood[5:])
        for _, writer in flood:
            writer.close()
            await writer.wait_closed()
        # A round trip more: the server has seen the flood's ends, its handlers are done.
        assert await _probe(port, "/livez") == 200
    finally:
        server.close()
        await server.wait_closed()
