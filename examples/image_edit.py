"""The main job: the seed's image edit through a real two-stage pipeline, on this machine.

Builds the tiny models (once), starts ``omni-runtime serve -f
examples/tiny-qwen-image-edit.yaml`` (a tiny Qwen-Image-Edit: its Qwen2.5-VL encoder on
vLLM reads the image and the instruction, its DiT on diffusers edits the image, shared
memory between them, behind the OpenAI-compatible router), sends the seed's request (a
chat completion whose user message holds the input image as a data URL, with
``modalities: ["image"]``) with the official ``openai`` client, writes the edited PNG, and
stops everything.

    .venv/bin/python examples/image_edit.py [--out out] [--image in.png] [--prompt "..."]
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys
from pathlib import Path

from _serving import chat_image, serving
from PIL import Image, ImageDraw

PIPELINE = Path(__file__).resolve().parent / "tiny-qwen-image-edit.yaml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--image", type=Path, help="the input image (default: one drawn here)")
    parser.add_argument("--prompt", default="turn the red cat into a gold sculpture")
    parser.add_argument("--size", default="64x64", help="WIDTHxHEIGHT of the edited image")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for serve")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.lower().split("x"))
    args.out.mkdir(parents=True, exist_ok=True)
    source = args.image.read_bytes() if args.image else _drawn_input(args.out / "input.png")
    data_url = "data:image/png;base64," + base64.b64encode(source).decode()

    # The seed's request: the image and the instruction in one user message.
    content = [
        {"type": "image_url", "image_url": {"url": data_url}},
        {"type": "text", "text": args.prompt},
    ]
    params = {
        "height": height,
        "width": width,
        "num_inference_steps": args.steps,
        "seed": args.seed,
    }
    with serving(PIPELINE, args.port, args.timeout) as base_url:
        chat_image(base_url, content, params, args.out / "edited.png")
    return 0


def _drawn_input(path: Path) -> bytes:
    """A small input picture (a red cat's head on a blue sky), also written to ``path``."""
    image = Image.new("RGB", (96, 64), (70, 130, 200))
    draw = ImageDraw.Draw(image)
    draw.ellipse((30, 18, 66, 54), fill=(200, 40, 30))
    draw.polygon([(32, 26), (38, 8), (46, 22)], fill=(200, 40, 30))
    draw.polygon([(64, 26), (58, 8), (50, 22)], fill=(200, 40, 30))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    path.write_bytes(buffer.getvalue())
    print(f"wrote the input image {path.resolve()}")
    return buffer.getvalue()


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.exit(main())
