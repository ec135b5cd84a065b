"""The main job: a real request through a real two-stage pipeline, on this machine.

Builds the tiny models (once), starts ``omni-runtime serve -f
examples/tiny-text-to-image.yaml`` (an LLM stage whose hidden states reach a diffusion
stage through shared memory, behind the OpenAI-compatible router), asks it for an image
with the official ``openai`` client, writes the PNG, and stops everything.

    .venv/bin/python examples/text_to_image.py [--out out] [--prompt "..."] [--size 128x128]
"""

from __future__ import annotations

import argparse
import base64
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

HERE = Path(__file__).resolve().parent
PIPELINE = HERE / "tiny-text-to-image.yaml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--prompt", default="a gold sculpture of a cat on a green hydrant")
    parser.add_argument("--size", default="128x128", help="WIDTHxHEIGHT")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for serve")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.lower().split("x"))
    port = args.port or _free_port()
    cli = [sys.executable, "-m", "omni_runtime.entrypoints.cli"]

    subprocess.run([*cli, "make-tiny-models"], check=True)
    print(f"starting: omni-runtime serve -f {PIPELINE.relative_to(HERE.parent)} --port {port}")
    # The server's own progress lines (stages ready, where it serves) show as they come.
    server = subprocess.Popen([*cli, "serve", "-f", str(PIPELINE), "--port", str(port)])
    try:
        base_url = f"http://127.0.0.1:{port}/v1"
        _wait_healthy(f"http://127.0.0.1:{port}/health", server, args.timeout)
        client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120)
        model = client.models.list().data[0].id
        print(f"asking {model} at {base_url} for a {width}x{height} image of {args.prompt!r}")
        start = time.perf_counter()
        response = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": args.prompt}],
            extra_body={
                "modalities": ["image"],
                "height": height,
                "width": width,
                "num_inference_steps": args.steps,
                "seed": args.seed,
            },
        )
        elapsed = time.perf_counter() - start
        parts = response.choices[0].message.content
        if not isinstance(parts, list) or not parts:
            raise SystemExit(f"no image in the answer: {parts!r}")
        url = parts[0]["image_url"]["url"]
        args.out.mkdir(parents=True, exist_ok=True)
        path = (args.out / "text-to-image.png").resolve()
        path.write_bytes(base64.b64decode(url.split(",", 1)[1]))
        print(f"wrote {path} ({elapsed:.2f} s for the request)")
        return 0
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


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.exit(main())
