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


async def start_probe_server(host: str, port: int, readiness: ReadinessCheck) -> asyncio.Server:
    """Serve /livez and /readyz on ``host:port`` until the returned server is closed."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 5)
            # Drain the headers; probes send a handful.
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request_line.decode("latin-1").split()
            path = parts[1] if len(parts) >= 2 else ""
            status, body = _answer(path, readiness)
            payload = json.dumps(body).encode()
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


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
