"""The router's HTTP connections, bounded in time and in number.

uvicorn's protocols bound only the wait between requests on a kept-alive connection
(``timeout_keep_alive``). A connection that never completes its request head, a body that
stops half way, a response its client stops reading: each holds a socket for as long as
the client likes, and a few thousand of them take every file descriptor of the pod (an
in-cluster endpoint is exactly where a broken client does this). ``GuardedHttpProtocol``
is uvicorn's httptools protocol with deadlines and a bound (``RouterLimits``):

- the head (request line and headers) must be complete within ``header_timeout_s`` of
  the connection's opening, or of the first byte after a response (until that byte the
  wait is the keep-alive timeout's). A partial head is answered 408; a connection that sent
  nothing is closed without a word;
- a body may pause at most ``body_timeout_s`` and must average at least
  ``min_body_bytes_per_s``, else 408; so no body takes longer than ``body_timeout_s`` +
  ``max_body_bytes`` / ``min_body_bytes_per_s``;
- a response its client leaves unread for ``send_timeout_s`` (the socket's buffer full)
  ends the connection;
- past ``max_connections`` a new connection is read for its head only, within a second:
  a probe (``PROBE_PATHS``) is answered, anything else is a 503 with Retry-After, and the
  connection closes either way. A few more than that wait for their heads at once; past
  them the longest waiting one is dropped for the newcomer.

Its 408s and 503s are OpenAI-shaped, as the router's other errors are, and each closes
the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import resource
from typing import Any, ClassVar, cast

import orjson
from starlette.requests import ClientDisconnect
from uvicorn._types import (
    ASGI3Application,
    ASGIReceiveCallable,
    ASGISendCallable,
    ASGISendEvent,
    Scope,
)
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from omni_runtime.router.errors import error_body
from omni_runtime.router.limits import RouterLimits

logger = logging.getLogger("omni_runtime.router")

# Past the bound a connection is only ever a probe or a 503, and a probe's request is
# there at once: the kubelet sends it with the connection and gives up after 1 s itself
# (timeoutSeconds' default), so a head that takes longer is nobody's probe.
OVERLOAD_HEAD_TIMEOUT_S = 1.0
# Connections past the bound cost descriptors too; this many may wait for their heads.
_MIN_OVERFLOW = 16
# What a router process holds besides its HTTP connections (stage sockets, ZMQ's own,
# the Kubernetes client, logs), for the descriptor check at start.
_OTHER_DESCRIPTORS = 128
_OVERLOAD_LOG_INTERVAL_S = 10.0
_RETRY_AFTER_S = 1


def overflow(max_connections: int) -> int:
    """How many connections past the bound may wait for their heads at once."""
    return max(_MIN_OVERFLOW, max_connections // 8)


def check_limits(limits: RouterLimits) -> None:
    """ValueError naming the first connection limit that cannot be used."""
    for name in ("header_timeout_s", "body_timeout_s", "send_timeout_s", "min_body_bytes_per_s"):
        value = getattr(limits, name)
        if not 0 < value < float("inf"):
            raise ValueError(f"RouterLimits.{name}: must be a positive number (got {value!r})")
    if limits.max_connections < 1:
        raise ValueError(
            f"RouterLimits.max_connections: must be at least 1 (got {limits.max_connections})"
        )


def descriptor_shortfall(limits: RouterLimits) -> str | None:
    """Why this process's descriptor limit may run out before ``max_connections`` does,
    or None when it will not."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = limits.max_connections + overflow(limits.max_connections) + _OTHER_DESCRIPTORS
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    return (
        f"the open-file limit ({soft}, ulimit -n) is below what {limits.max_connections} "
        f"HTTP connections need with the rest of the router (about {need}): lower "
        "RouterLimits.max_connections or raise the limit"
    )


def guarded_http_protocol(
    limits: RouterLimits, probe_paths: frozenset[str]
) -> type[GuardedHttpProtocol]:
    """The protocol class to give uvicorn (``Config(http=...)``) for one server."""
    check_limits(limits)
    shared = _Shared(limits, probe_paths)

    class _Protocol(GuardedHttpProtocol):
        _shared = shared

    return _Protocol


class _Shared:
    """What the connections of one server share."""

    def __init__(self, limits: RouterLimits, probe_paths: frozenset[str]) -> None:
        self.limits = limits
        self.probe_paths = probe_paths
        self.overflow_size = overflow(limits.max_connections)
        # Connections past the bound waiting for their heads, oldest first.
        self.waiting: dict[GuardedHttpProtocol, None] = {}
        self.refused = 0
        self.logged_at = float("-inf")

    def over_bound(self, loop: asyncio.AbstractEventLoop) -> None:
        self.refused += 1
        now = loop.time()
        if now - self.logged_at >= _OVERLOAD_LOG_INTERVAL_S:
            logger.warning(
                "the router holds its limit of %d HTTP connections: %d more since the last "
                "report, each answered only if a probe (else 503) and closed",
                self.limits.max_connections,
                self.refused,
            )
            self.refused = 0
            self.logged_at = now


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and the bound above; made for a
    server by ``guarded_http_protocol``."""

    _shared: ClassVar[_Shared]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._limits = self._shared.limits
        self._inner_app: ASGI3Application = self.app
        self.app = self._serve
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._in_message = False
        # This connection's requests not yet answered: with pipelining, more than one.
        self._cycles: list[RequestResponseCycle] = []
        # When the body must have gone on by: bytes received push it later, at
        # min_body_bytes_per_s, never past body_timeout_s from now.
        self._body_deadline = 0.0
        self._body_received = 0
        self._body_started = 0.0

    # -- the connection ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        head_timeout = self._limits.header_timeout_s
        if len(self.connections) > self._limits.max_connections:
            shared = self._shared
            shared.over_bound(self.loop)
            if len(shared.waiting) >= shared.overflow_size:
                oldest = next(iter(shared.waiting))
                del shared.waiting[oldest]
                oldest.transport.abort()
            shared.waiting[self] = None
            self.app = self._overloaded
            head_timeout = min(head_timeout, OVERLOAD_HEAD_TIMEOUT_S)
        self._arm_head(head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clocks()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        # The connection is the WebSocket protocol's from here (with its own pings).
        self._stop_clocks()
        super().handle_websocket_upgrade()

    def data_received(self, data: bytes) -> None:
        # Bytes between requests start the next head's clock, even bytes the parser skips
        # (blank lines): otherwise a trickle of them would hold the connection forever.
        if not self._in_message and self._head_timer is None:
            self._arm_head(self._limits.header_timeout_s)
        super().data_received(data)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(
                self._limits.send_timeout_s, self._send_timed_out
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    # -- the parser's callbacks ----------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_message = True
        if self._head_timer is None:
            self._arm_head(self._limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._cancel_head()
        self._shared.waiting.pop(self, None)
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before:
            self._live_cycles().append(self.cycle)
        if _has_body(self.headers):
            now = self.loop.time()
            self._body_started = now
            self._body_received = 0
            self._body_deadline = now + self._limits.body_timeout_s
            self._body_timer = self.loop.call_at(self._body_deadline, self._body_check)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._body_received += len(body)
        self._body_deadline = min(
            self._body_deadline + len(body) / self._limits.min_body_bytes_per_s,
            self.loop.time() + self._limits.body_timeout_s,
        )

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_message = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        # Answered before its body was all in (a 413 on the declared length, say): the
        # answer's end armed the keep-alive timeout, and the body's bytes since disarmed it.
        if (
            self.cycle is not None
            and self.cycle.response_complete
            and self.timeout_keep_alive_task is None
            and not self.transport.is_closing()
        ):
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    # -- the clocks ----------------------------------------------------------------------

    def _arm_head(self, timeout: float) -> None:
        self._cancel_head()
        self._head_timer = self.loop.call_later(timeout, self._head_timed_out, timeout)

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _stop_clocks(self) -> None:
        self._cancel_head()
        for timer in (self._body_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._body_timer = self._send_timer = None
        self._shared.waiting.pop(self, None)

    def _live_cycles(self) -> list[RequestResponseCycle]:
        self._cycles = [c for c in self._cycles if not (c.response_complete or c.disconnected)]
        return self._cycles

    def _disconnect(self) -> None:
        """Have every request of this connection see its client gone: the app's reads end,
        and what it sends is dropped (a write on a transport closed under it would fail)."""
        for cycle in self._live_cycles():
            cycle.disconnected = True
            cycle.message_event.set()

    def _head_timed_out(self, timeout: float) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        # The next head's turn comes after the answer in progress: a client waiting for
        # it, or one whose reading uvicorn paused, is not stalling.
        if self._live_cycles() or self.flow.read_paused:
            self._arm_head(timeout)
            return
        if not self._in_message:
            # Nothing of a request: a client that reused this connection now would read a
            # 408 as the answer to its next request.
            self.transport.close()
            return
        self._end_with_408(
            f"the request's head (request line and headers) was not complete within {timeout:g} s",
            answered=False,
        )

    def _body_check(self) -> None:
        self._body_timer = None
        if not self._in_message or self.transport.is_closing():
            return
        now = self.loop.time()
        if self.flow.read_paused or any(c is not self.cycle for c in self._live_cycles()):
            # uvicorn stopped reading (the app has not taken what came, or a pipelined
            # request waits its turn): the client cannot send, so it is not stalling; nor
            # may an answer to this request go out before the ones to earlier requests.
            self._body_deadline = now + self._limits.body_timeout_s
        if self._body_deadline > now:
            self._body_timer = self.loop.call_at(self._body_deadline, self._body_check)
            return
        elapsed = now - self._body_started
        self._end_with_408(
            f"the request's body stalled: {self._body_received} bytes in {elapsed:.1f} s "
            f"(the router waits at most {self._limits.body_timeout_s:g} s for the next "
            f"bytes and needs at least {self._limits.min_body_bytes_per_s:g} bytes/s)",
            answered=self.cycle.response_started,
        )

    def _send_timed_out(self) -> None:
        self._send_timer = None
        self._disconnect()
        # Whatever is buffered goes nowhere: abort, as a close would wait for the client.
        self.transport.abort()

    def _end_with_408(self, message: str, *, answered: bool) -> None:
        """Close the connection, with a 408 unless the request was ``answered`` already
        (one answer per request: a client reads a second as the next one's)."""
        if not answered:
            self.transport.write(
                _raw_response(
                    408,
                    orjson.dumps(error_body(408, message, kind="invalid_request_error")),
                    self.server_state.default_headers,
                )
            )
        self._disconnect()
        self.transport.close()

    # -- the app, as this connection runs it ---------------------------------------------

    async def _serve(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        # Starlette's word for a body whose client left (or was cut off here): there is
        # no one to answer, and a traceback per such client would flood the log.
        with contextlib.suppress(ClientDisconnect):
            await self._inner_app(scope, receive, send)

    async def _overloaded(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "http" and scope["path"] in self._shared.probe_paths:

            async def closing(message: ASGISendEvent) -> None:
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (b"connection", b"close")]
                    message = cast(ASGISendEvent, {**message, "headers": headers})
                await send(message)

            await self._serve(scope, receive, closing)
            return
        limit = self._limits.max_connections
        body = orjson.dumps(
            error_body(
                503,
                f"the router holds its limit of {limit} connections; retry shortly",
            )
        )
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(_RETRY_AFTER_S).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    # A request has a body only if it says so (RFC 9112, 6.3).
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


def _raw_response(status: int, body: bytes, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A whole response written past the app (it may be reading the request still)."""
    phrase = http.HTTPStatus(status).phrase
    lines = [f"HTTP/1.1 {status} {phrase}".encode()]
    lines += [name + b": " + value for name, value in default_headers]
    lines += [
        b"content-type: application/json",
        b"content-length: " + str(len(body)).encode(),
        b"connection: close",
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body
