"""Text to image through a real two-stage pipeline, on this machine.

Builds the tiny models (once), starts ``omni-runtime serve -f
examples/tiny-text-to-image.yaml`` (an LLM stage whose hidden states reach a diffusion
stage through shared memory, behind the OpenAI-compatible router), asks it for an image
with the official ``openai`` client, writes the PNG, and stops everything.

    .venv/bin/python examples/text_to_image.py [--out out] [--prompt "..."] [--size 128x128]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from _serving import chat_image, serving

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
    params = {
        "height": height,
        "width": width,
        "num_inference_steps": args.steps,
        "seed": args.seed,
    }
    with serving(PIPELINE, args.port, args.timeout) as base_url:
        chat_image(base_url, args.prompt, params, args.out / "text-to-image.png")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.exit(main())
