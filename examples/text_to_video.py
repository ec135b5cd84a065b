"""A short clip through a real video pipeline, on this machine.

Builds the tiny models (once), starts ``omni-runtime serve -f examples/tiny-wan.yaml`` (a
tiny Wan2.2: one diffusion stage behind the OpenAI-compatible router, its jobs in an
embedded store), makes a clip with the official ``openai`` client's Videos API
(``videos.create_and_poll``, then ``download_content``), writes the MP4, and stops
everything. The weights are random: the clip is noise; the machinery is real.

    .venv/bin/python examples/text_to_video.py [--out out] [--prompt "..."] [--size 64x32]
        [--frames 9] [--image first-frame.png]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from pathlib import Path

import openai
from _serving import serving

PIPELINE = Path(__file__).resolve().parent / "tiny-wan.yaml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--prompt", default="a paper boat drifting on a pond")
    parser.add_argument("--size", default="64x32", help="WIDTHxHEIGHT, multiples of 16")
    parser.add_argument("--frames", type=int, default=9, help="1 + a multiple of 4")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--image", type=Path, help="the clip's first frame (image-to-video)")
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for serve")
    args = parser.parse_args()
    with serving(PIPELINE, args.port, args.timeout) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        with contextlib.ExitStack() as files:
            video = client.videos.create_and_poll(
                prompt=args.prompt,
                size=args.size,  # type: ignore[arg-type]
                input_reference=(
                    files.enter_context(args.image.open("rb")) if args.image else openai.omit
                ),
                extra_body={
                    "num_frames": args.frames,
                    "num_inference_steps": args.steps,
                    "seed": args.seed,
                },
                poll_interval_ms=200,
            )
        if video.status != "completed":
            print(f"the job failed: {video.error}", file=sys.stderr)
            return 1
        args.out.mkdir(parents=True, exist_ok=True)
        path = (args.out / "text-to-video.mp4").resolve()
        client.videos.download_content(video.id).write_to_file(path)
        print(f"wrote {path} ({video.size}, {video.seconds} s, job {video.id})")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # The client's videos.* warn of OpenAI's own hosted service shutting down; this is ours.
    warnings.filterwarnings("ignore", "The Sora API is scheduled", DeprecationWarning)
    sys.exit(main())
