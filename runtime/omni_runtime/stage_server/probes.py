"""The HTTP port a stage process answers Kubernetes probes on.

``GET /livez``: 200 while the process serves (its event loop turns). ``GET /readyz``: 200
when every stage of the process has a live core, else 503 naming the ones that have not.
Deliberately tiny (asyncio streams, no framework): a probe must answer even when the
process is busy, and kubelet needs nothing more.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

# What readiness asks: stage name -> why it is not ready (None when it is).
ReadinessCheck = Callable[[], dict[str, str | None]]

# The kubelet sends a probe's request as it connects and gives up after its timeoutSeconds
# (1 s by default): a whole head in 5 s is generous, and no peer that stalls or trickles
# holds a connection longer. Its head is a few hundred bytes.
HEAD_TIMEOUT_S = 5.0
MAX_HEAD_BYTES = 8 * 1024
# The kubelet probes one at a time per probe; past this many connections at once the
# oldest goes, so that a flood of idle ones neither takes the process's descriptors nor
# keeps a probe out (a probe's connection is the newest, and done within milliseconds).
MAX_CONNECTIONS = 32


async def start_probe_server(
    host: str,
    port: int,
    readiness: ReadinessCheck,
    *,
    head_timeout: float = HEAD_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
) -> asyncio.Server:
    """Serve /livez and /readyz on ``host:port`` until the returned server is closed."""
    # Open connections, oldest first.
    connections: dict[asyncio.StreamWriter, None] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(connections) >= max_connections:
            oldest = next(iter(connections))
            del connections[oldest]
            oldest.transport.abort()
        connections[writer] = None
        try:
            async with asyncio.timeout(head_timeout):
                request_line = await reader.readline()
                # Drain the headers; probes send a handful.
                size = len(request_line)
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    size += len(line)
                    if size > MAX_HEAD_BYTES:
                        return
            if writer.is_closing():
                return
            parts = request_line.decode("latin-1").split()
            path = parts[1] if len(parts) >= 2 else ""
            status, body = _answer(path, readiness)
            payload = json.dumps(body).encode()
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload
            )
            await asyncio.wait_for(writer.drain(), head_timeout)
        # ValueError: a line past the reader's limit.
        except (TimeoutError, ConnectionError, UnicodeDecodeError, ValueError):
            pass
        finally:
            connections.pop(writer, None)
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=MAX_HEAD_BYTES)


def _answer(path: str, readiness: ReadinessCheck) -> tuple[str, dict[str, object]]:
    if path == "/livez":
        return "200 OK", {"status": "alive"}
    if path == "/readyz":
        stages = readiness()
        waiting = {name: why for name, why in stages.items() if why is not None}
        if waiting:
            return "503 Service Unavailable", {"status": "not ready", "stages": waiting}
        return "200 OK", {"status": "ready", "stages": sorted(stages)}
    return "404 Not Found", {"error": f"unknown path {path!r}; try /livez or /readyz"}
