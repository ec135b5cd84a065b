"""What the examples share: `omni-runtime serve` of a pipeline file, healthy, then stopped;
and the chat completion that asks it for an image."""

from __future__ import annotations

import base64
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai

CLI = [sys.executable, "-m", "omni_runtime.entrypoints.cli"]


@contextmanager
def serving(pipeline: Path, port: int = 0, timeout: float = 600.0) -> Iterator[str]:
    """Build the tiny models (once), serve ``pipeline`` on ``port`` (0: a free one) until
    healthy, yield its OpenAI base URL, and stop it on the way out."""
    port = port or _free_port()
    subprocess.run([*CLI, "make-tiny-models"], check=True)
    print(f"starting: omni-runtime serve -f {pipeline.name} --port {port}")
    # The server's own progress lines (stages ready, where it serves) show as they come.
    server = subprocess.Popen([*CLI, "serve", "-f", str(pipeline), "--port", str(port)])
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/health", server, timeout)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        print("stopped the pipeline")


def _wait_healthy(url: str, server: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"omni-runtime serve exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"the pipeline was not healthy within {timeout:.0f} s")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def chat_image(
    base_url: str, content: str | list[dict[str, Any]], params: dict[str, Any], path: Path
) -> None:
    """Ask the served pipeline for an image with one user message of ``content`` (text, or
    parts with an input image), vLLM-Omni's image fields ``params``; write it to ``path``."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=300)
    model = client.models.list().data[0].id
    print(f"asking {model} at {base_url} for an image ({params})")
    start = time.perf_counter()
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        extra_body={"modalities": ["image"], **params},
    )
    elapsed = time.perf_counter() - start
    parts = response.choices[0].message.content
    if not isinstance(parts, list) or not parts:
        raise SystemExit(f"no image in the answer: {parts!r}")
    url = parts[0]["image_url"]["url"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(url.split(",", 1)[1]))
    print(f"wrote {path.resolve()} ({elapsed:.2f} s for the request)")
