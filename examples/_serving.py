"""What the examples share: `omni-runtime serve` of a pipeline file, healthy, then stopped;
and the chat completion that asks it for an image."""

from __future__ import annotations

import base64
import queue
import signal
import subprocess
import sys
import threading
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
    """Build the tiny models (once), serve ``pipeline`` on ``port`` (0: whichever port the
    server binds, read from its "serving" line) until healthy, yield its OpenAI base URL,
    and stop it on the way out."""
    subprocess.run([*CLI, "make-tiny-models"], check=True)
    print(f"starting: omni-runtime serve -f {pipeline.name} --port {port}")
    server = subprocess.Popen(
        [*CLI, "serve", "-f", str(pipeline), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    announced: queue.Queue[str] = queue.Queue()
    echo = threading.Thread(target=_echo, args=(server, announced), daemon=True)
    echo.start()
    try:
        base_url = _wait_announced(announced, server, timeout)
        _wait_healthy(base_url.removesuffix("/v1") + "/health", server, timeout)
        yield base_url
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        echo.join(timeout=10)
        print("stopped the pipeline")


def _echo(server: subprocess.Popen[str], announced: queue.Queue[str]) -> None:
    """The server's own progress lines, shown as they come; the URL of its "serving" line
    (the one place that says which port it bound) handed to ``announced``."""
    assert server.stdout is not None
    for line in server.stdout:
        print(line, end="", flush=True)
        if line.startswith("serving http://"):
            announced.put(line.split()[1])


def _wait_announced(
    announced: queue.Queue[str], server: subprocess.Popen[str], timeout: float
) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"omni-runtime serve exited with code {server.returncode}")
        try:
            return announced.get(timeout=0.5)
        except queue.Empty:
            pass
    raise SystemExit(f"the pipeline was not serving within {timeout:.0f} s")


def _wait_healthy(url: str, server: subprocess.Popen[str], timeout: float) -> None:
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
