"""Pull over TCP: the producer serves its arrays, the consumer connects and asks for a key.

The producer keeps each array in its own memory under its key and, from its first put on,
runs a server thread on ``bind_host:port``. A consumer sends ``[key, token]`` and gets back a
small header, then the array's raw bytes sent straight from the array and received straight
into the new tensor's memory: no pickle, and no copy on either side beyond the kernel's.
The producer drops a key once the consumer has it all. The token is the handle's, made
for this hand-off at ``put``: a get without it is answered as if the key were unknown, before
any byte of the array is sent, and the array stays for its consumer.

``put`` keeps a contiguous CPU array by reference, not by copy (a snapshot cost 5-10% of
the throughput here): a caller must not write into it until it is fetched, released or
expired. Anything else (strided, another byte order, on a GPU) is copied at ``put``.

Plain blocking sockets, one thread per consumer connection: measured against a ZMQ ROUTER,
they add nothing to a bare socket's rate, and a large ``sendall`` runs without the GIL.
Consumers keep their connections to a producer open for the next gets.

No peer holds a producer's thread or socket for long: a connection idle between requests
closes after ``idle_seconds``; once a request's first byte is in, the request, the reply,
the array and its acknowledgement must all be through within ``timeout_seconds`` (what
the consumer's get waits, too); past ``max_connections`` a new one takes the place of the
connection idle longest, or is closed when none is idle. A consumer whose kept connection
was closed meanwhile takes a fresh one, as it does after a producer's restart.

Frames: a request is ``u32 length + msgpack [key]``; a reply is ``u32 length + msgpack
header`` then, if the header says so, exactly ``nbytes`` raw bytes, which the consumer
acknowledges with one byte: the producer drops the key only then, so that a consumer that
timed out (or died) mid-transfer leaves the key to a retry.

extra: ``host`` (what consumers connect to; "auto" or absent: this machine's address),
``bind_host`` (default 0.0.0.0), ``port`` (default 0: any free port), ``timeout_seconds``
(how long a get waits, default 30), ``idle_seconds`` (default 60), ``max_connections``
(default 256), ``ttl_seconds`` (base).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from omni_runtime.connectors import _arrays
from omni_runtime.connectors.base import (
    ConnectorError,
    ConnectorHandle,
    OmniConnector,
    new_token,
    token_matches,
)
from omni_runtime.net import advertised_host

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 30.0
# A consumer's kept connection saves a connect (well under a millisecond in a cluster);
# a minute of idleness means its stage is quiet, and reconnecting then costs nothing.
DEFAULT_IDLE_SECONDS = 60.0
# Consumers keep a connection or a few per producer each; 256 is many DiT replicas' worth,
# and far below a process's descriptors (the engine holds its own).
DEFAULT_MAX_CONNECTIONS = 256
_LENGTH = struct.Struct("!I")
# Requests and headers are a few dozen bytes; anything far larger is not this protocol.
_MAX_MESSAGE = 1 << 16
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
_ACK = b"\x01"
_REFUSAL_LOG_INTERVAL = 10.0


class _Request(msgspec.Struct, array_like=True):
    key: str
    token: str = ""


class _Reply(msgspec.Struct, array_like=True, omit_defaults=True):
    dtype: str = ""
    shape: list[int] = []
    nbytes: int = 0
    error: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode_request = msgspec.msgpack.Decoder(_Request).decode
_decode_reply = msgspec.msgpack.Decoder(_Reply).decode


@dataclass
class _Entry:
    dtype: str
    shape: list[int]
    payload: memoryview  # keeps the producer's copy alive
    deadline: float
    token: str


class _Server:
    """The producer's side: the arrays it holds, and the thread that serves them."""

    def __init__(
        self,
        bind_host: str,
        port: int,
        ttl: float,
        *,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        idle: float = DEFAULT_IDLE_SECONDS,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self.ttl = ttl
        self.timeout = timeout
        self.idle = idle
        self.max_connections = max_connections
        self.lock = threading.Lock()
        self.entries: dict[str, _Entry] = {}
        self.closed = False
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind((bind_host, port))
            self.listener.listen(64)
        except OSError as e:
            self.listener.close()
            raise ConnectorError(f"cannot listen on {bind_host}:{port}: {e}") from e
        # accept() wakes this often to expire keys nobody fetched.
        self.listener.settimeout(min(max(ttl / 4, 0.02), 1.0))
        self.port = int(self.listener.getsockname()[1])
        # Each connection, and since when it has waited for a request (None: serving one).
        self.connections: dict[socket.socket, float | None] = {}
        self.threads: list[threading.Thread] = []
        self.acceptor = threading.Thread(
            target=self._accept, name=f"omni-tcp-server-{self.port}", daemon=True
        )
        self.acceptor.start()

    def put(self, key: str, entry: _Entry) -> None:
        with self.lock:
            if self.closed:
                raise ConnectorError(f"cannot put {key!r}: the connector is closed")
            self.entries[key] = entry

    def release(self, key: str) -> None:
        with self.lock:
            self.entries.pop(key, None)

    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            for key in [k for k, e in self.entries.items() if e.deadline <= now]:
                logger.debug("tcp key %r expired unfetched", key)
                del self.entries[key]

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                self._expire()
                continue
            except OSError:
                return  # closed
            with self.lock:
                if self.closed:
                    conn.close()
                    return
                if len(self.connections) >= self.max_connections and not self._make_room():
                    _FullLog.note(self.max_connections)
                    conn.close()
                    continue
                self.connections[conn] = time.monotonic()
                self.threads = [t for t in self.threads if t.is_alive()]
                thread = threading.Thread(
                    target=self._serve, args=(conn,), name="omni-tcp-conn", daemon=True
                )
                self.threads.append(thread)
            thread.start()
            self._expire()

    def _make_room(self) -> bool:
        """Close the connection idle longest (under the lock); False when none is idle."""
        idle = [(since, conn) for conn, since in self.connections.items() if since is not None]
        if not idle:
            return False
        _, oldest = min(idle, key=lambda pair: pair[0])
        del self.connections[oldest]
        # Wakes its thread's recv(); the thread closes it.
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)
        return True

    def _set_idle(self, conn: socket.socket, idle: bool) -> None:
        with self.lock:
            if conn in self.connections:
                self.connections[conn] = time.monotonic() if idle else None

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                self._set_idle(conn, True)
                # A request's first byte may take up to ``idle``; from then on everything
                # until the acknowledgement is within ``timeout``.
                conn.settimeout(self.idle)
                prefix = bytearray(_LENGTH.size)
                try:
                    got = conn.recv_into(prefix)
                except TimeoutError:
                    return
                if got == 0:
                    return
                self._set_idle(conn, False)
                deadline = time.monotonic() + self.timeout
                body = _recv_message(conn, deadline, prefix, got)
                request = _decode_request(body)
                key = request.key
                with self.lock:
                    entry = self.entries.get(key)
                    # A wrong token is answered as a missing key, so that a peer without
                    # the handle learns nothing, and the array stays for its consumer.
                    if entry is not None and not token_matches(entry.token, request.token):
                        _RefusalLog.note(conn, key)
                        entry = None
                    elif entry is not None:
                        del self.entries[key]
                if entry is None:
                    reply = _Reply(error=f"unknown key {key!r} (fetched or expired)")
                    _send_message(conn, reply, deadline)
                    continue
                try:
                    header = _Reply(
                        dtype=entry.dtype, shape=entry.shape, nbytes=entry.payload.nbytes
                    )
                    _send_message(conn, header, deadline)
                    conn.settimeout(_remaining(deadline))
                    conn.sendall(entry.payload)
                    # Only a consumer that has it all says so; one that gave up (timed out,
                    # died) closes instead, and the key stays for another try.
                    conn.settimeout(_remaining(deadline))
                    if conn.recv(1) != _ACK:
                        raise ConnectionError("no acknowledgement")
                except OSError:
                    with self.lock:
                        if not self.closed:
                            self.entries.setdefault(key, entry)
                    raise
        except (OSError, msgspec.DecodeError, ValueError):
            pass  # a consumer that went away, stalled past its deadline or spoke another protocol
        finally:
            with self.lock:
                self.connections.pop(conn, None)
            conn.close()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.entries.clear()
            connections = list(self.connections)
            threads = list(self.threads)
        # shutdown() wakes threads blocked in accept() and recv(), where close() would not.
        for sock in [self.listener, *connections]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for thread in [self.acceptor, *threads]:
            if thread is not threading.current_thread():
                thread.join(timeout=5)


class _FullLog:
    """Connections closed at accept for want of room, logged at most every
    ``_REFUSAL_LOG_INTERVAL`` seconds with a count."""

    count = 0
    logged_at = float("-inf")

    @classmethod
    def note(cls, limit: int) -> None:
        cls.count += 1
        now = time.monotonic()
        if now - cls.logged_at < _REFUSAL_LOG_INTERVAL:
            return
        logger.warning(
            "tcp connector: %d connection(s) closed at once: all %d are serving requests",
            cls.count,
            limit,
        )
        cls.count = 0
        cls.logged_at = now


class _RefusalLog:
    """Gets refused for a wrong token, logged at most every ``_REFUSAL_LOG_INTERVAL``
    seconds with a count, so that a peer trying keys cannot fill the log. Counts are
    approximate under concurrent connections, which is all a log line needs."""

    count = 0
    logged_at = float("-inf")

    @classmethod
    def note(cls, conn: socket.socket, key: str) -> None:
        cls.count += 1
        now = time.monotonic()
        if now - cls.logged_at < _REFUSAL_LOG_INTERVAL:
            return
        try:
            peer = "{}:{}".format(*conn.getpeername()[:2])
        except OSError:
            peer = "a closed connection"
        logger.warning(
            "tcp connector: refused %d get(s) without the hand-off's token (last: key %r from %s)",
            cls.count,
            key,
            peer,
        )
        cls.count = 0
        cls.logged_at = now


def _remaining(deadline: float) -> float:
    """Seconds left until ``deadline``; TimeoutError when none are."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    return remaining


def _send_message(conn: socket.socket, message: msgspec.Struct, deadline: float) -> None:
    body = _encode(message)
    conn.settimeout(_remaining(deadline))
    conn.sendall(_LENGTH.pack(len(body)) + body)


def _recv_message(
    conn: socket.socket, deadline: float, prefix: bytearray | None = None, got: int = 0
) -> bytes:
    """One length-prefixed message, all of it by ``deadline`` (TimeoutError), the first
    ``got`` bytes of its prefix already in ``prefix``; ConnectionError if the peer closes
    before its end."""
    prefix = prefix if prefix is not None else bytearray(_LENGTH.size)
    rest = memoryview(prefix)[got:]
    if rest.nbytes and _recv_into(conn, rest, deadline) == 0:
        raise ConnectionError("connection closed before a message")
    (length,) = _LENGTH.unpack(prefix)
    if length > _MAX_MESSAGE:
        raise ValueError(f"message of {length} bytes")
    body = bytearray(length)
    if _recv_into(conn, memoryview(body), deadline) == 0 and length:
        raise ConnectionError(f"connection closed before a message of {length} bytes")
    return bytes(body)


def _recv_into(conn: socket.socket, view: memoryview, deadline: float) -> int:
    """Fill ``view`` by ``deadline`` (TimeoutError); ConnectionError if the peer closes after
    some of it, 0 if before."""
    got = 0
    total = view.nbytes
    while got < total:
        # A socket's timeout is per call: a peer sending a byte at a time would restart it.
        conn.settimeout(_remaining(deadline))
        n = conn.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return 0
            raise ConnectionError(f"connection closed after {got} of {total} bytes")
        got += n
    return got


class _Connections:
    """A consumer's idle connections, per producer, kept for the next gets."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: dict[tuple[str, int], list[socket.socket]] = {}

    def take(self, address: tuple[str, int]) -> socket.socket | None:
        with self.lock:
            stack = self.idle.get(address)
            return stack.pop() if stack else None

    def give_back(self, address: tuple[str, int], conn: socket.socket) -> None:
        with self.lock:
            self.idle.setdefault(address, []).append(conn)

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, {}
        for stack in idle.values():
            for conn in stack:
                conn.close()


class TCPConnector(OmniConnector):
    """Arrays pulled over TCP from the producer's memory: works between any two hosts."""

    def __init__(
        self,
        name: str,
        extra: Mapping[str, Any] | None = None,
        *,
        advertise_host: str | None = None,
    ) -> None:
        super().__init__(name, extra)
        self.bind_host = str(self.extra.get("bind_host", "0.0.0.0"))
        self.port = int(self.extra.get("port", 0))
        self.timeout = float(self.extra.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS))
        self.idle = float(self.extra.get("idle_seconds", DEFAULT_IDLE_SECONDS))
        self.max_connections = int(self.extra.get("max_connections", DEFAULT_MAX_CONNECTIONS))
        host = advertise_host or str(self.extra.get("host", "auto"))
        if host == "auto" and self.bind_host not in _WILDCARD_HOSTS:
            host = self.bind_host
        # What consumers connect to; set it (or pass advertise_host) before the first put.
        self.advertise_host = advertised_host() if host == "auto" else host
        self._state = _State()
        # At exit too: the server's threads and sockets go with the connector.
        self._finalizer = weakref.finalize(self, self._state.close)

    def _started_server(self) -> _Server:
        state = self._state
        with state.lock:
            if state.closed:
                raise ConnectorError(f"connector {self.name} is closed")
            if state.server is None:
                state.server = _Server(
                    self.bind_host,
                    self.port,
                    self.ttl,
                    timeout=self.timeout,
                    idle=self.idle,
                    max_connections=self.max_connections,
                )
            return state.server

    def put(self, key: str, array: torch.Tensor | np.ndarray) -> ConnectorHandle:
        dtype, shape, nbytes = _arrays.describe(array)
        server = self._started_server()
        payload = _arrays.host_bytes(array)
        token = new_token()
        server.put(key, _Entry(dtype, shape, payload, time.monotonic() + self.ttl, token))
        return ConnectorHandle(
            connector=self.name,
            key=key,
            dtype=dtype,
            shape=shape,
            nbytes=nbytes,
            host=self.advertise_host,
            port=server.port,
            token=token,
        )

    def get(self, handle: ConnectorHandle, device: str = "cpu") -> torch.Tensor:
        _arrays.check_layout(handle.dtype, handle.shape, handle.nbytes, f"key {handle.key!r}")
        _arrays.check_device(device)
        address = (handle.host, handle.port)
        producer = f"producer {handle.host}:{handle.port}"
        deadline = time.monotonic() + self.timeout
        # A kept connection may have been closed by its producer since; only a fresh one's
        # failure is the answer.
        conn = self._state.connections.take(address)
        if conn is not None:
            try:
                return self._fetch(conn, address, handle, device, deadline, producer)
            except _StaleConnection:
                pass
        try:
            conn = socket.create_connection(address, timeout=_remaining(deadline))
        except TimeoutError:
            raise self._timed_out(handle, producer) from None
        except OSError as e:
            raise ConnectorError(
                f"cannot fetch key {handle.key!r}: {producer} is unreachable ({e.strerror or e}); "
                "has the producing stage exited?"
            ) from None
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            return self._fetch(conn, address, handle, device, deadline, producer)
        except _StaleConnection as e:
            raise ConnectorError(
                f"cannot fetch key {handle.key!r}: {producer} closed the connection ({e.__cause__})"
            ) from None

    def _fetch(
        self,
        conn: socket.socket,
        address: tuple[str, int],
        handle: ConnectorHandle,
        device: str,
        deadline: float,
        producer: str,
    ) -> torch.Tensor:
        """Ask ``conn`` for the key; _StaleConnection if it failed before any reply."""
        try:
            _send_message(conn, _Request(handle.key, handle.token), deadline)
            reply = _decode_reply(_recv_message(conn, deadline))
        except TimeoutError:
            conn.close()
            raise self._timed_out(handle, producer) from None
        except (OSError, msgspec.DecodeError, ValueError) as e:
            conn.close()
            raise _StaleConnection() from e
        except BaseException:
            conn.close()
            raise
        if reply.error:
            self._state.connections.give_back(address, conn)
            raise ConnectorError(f"cannot fetch key {handle.key!r} from {producer}: {reply.error}")
        if (reply.dtype, reply.shape, reply.nbytes) != (handle.dtype, handle.shape, handle.nbytes):
            conn.close()  # its payload is on the way, unread
            raise ConnectorError(
                f"key {handle.key!r} from {producer}: sent {reply.dtype}{reply.shape}, "
                f"the handle says {handle.dtype}{handle.shape}"
            )
        try:
            target, tensor = _receive_buffer(handle, device)
            if target.nbytes and _recv_into(conn, target, deadline) == 0:
                raise ConnectionError("closed before sending the array")
            conn.settimeout(_remaining(deadline))
            conn.sendall(_ACK)
        except TimeoutError:
            conn.close()
            raise self._timed_out(handle, producer) from None
        except OSError as e:
            conn.close()
            raise ConnectorError(f"cannot fetch key {handle.key!r} from {producer}: {e}") from None
        except BaseException:
            conn.close()
            raise
        self._state.connections.give_back(address, conn)
        return tensor if device == "cpu" else _to_device(tensor, device)

    def _timed_out(self, handle: ConnectorHandle, producer: str) -> ConnectorError:
        return ConnectorError(
            f"timed out after {self.timeout:g} s fetching key {handle.key!r} from {producer} "
            "(is the producing stage alive?)"
        )

    def release(self, key: str) -> None:
        server = self._state.server
        if server is not None:
            server.release(key)

    def close(self) -> None:
        self._finalizer()


class _State:
    """What a connector holds, apart from it so that a finalizer can close it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.server: _Server | None = None
        self.connections = _Connections()
        self.closed = False

    def close(self) -> None:
        with self.lock:
            self.closed = True
            server, self.server = self.server, None
        if server is not None:
            server.close()
        self.connections.close()


class _StaleConnection(Exception):
    """A connection that failed before the producer answered: try a fresh one."""


def _receive_buffer(handle: ConnectorHandle, device: str) -> tuple[memoryview, torch.Tensor]:
    """Where the payload lands (the new tensor's own memory) and that tensor."""
    if device != "cpu":
        return _pinned_buffer(handle)
    data = np.empty(handle.shape, dtype=_arrays.numpy_dtype(handle.dtype))
    return data.reshape(-1).view(np.uint8).data, _arrays.tensor_over_array(data, handle.dtype)


# -- CUDA: kept apart, and reached only for gets onto a GPU ----------------------------------


def _pinned_buffer(handle: ConnectorHandle) -> tuple[memoryview, torch.Tensor]:
    # Received into page-locked memory (torch's caching host allocator: pinned once, then
    # reused), so that the copy to the device runs at the pinned rate.
    import torch

    staged = torch.empty(handle.nbytes, dtype=torch.uint8, pin_memory=True)
    view = memoryview(staged.numpy())
    tensor = staged.view(_arrays.torch_dtype(handle.dtype)).view(handle.shape)
    return view, tensor


def _to_device(tensor: torch.Tensor, device: str) -> torch.Tensor:
    return tensor.to(device)
