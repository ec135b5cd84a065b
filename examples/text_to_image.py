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
import sys
import time
from pathlib import Path

import openai
from _serving import serving

PIPELINE = Path(__file__).resolve().parent / "tiny-text-to-image.yaml"


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
    with serving(PIPELINE, args.port, args.timeout) as base_url:
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


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.exit(main())
