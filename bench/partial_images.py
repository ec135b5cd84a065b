"""What partial images (stream: true, partial_images K) cost the DiT.

1. Each family's tiny checkpoint through the DiT stage's engine: DiT ms per image at K = 0
   to 3, and the partials sent. The tiny DiT is so small that its VAE is a large share of
   a job, so the overhead here is an upper bound.
2. Real sizes, Qwen-Image: the real VAE's decode (diffusers' AutoencoderKLQwenImage at its
   published config, random weights) against the real-width transformer's step
   (bench/step_cache.py's, a few blocks, scaled to the real 60), on this CPU; the overhead
   of K partials on a 50-step job with guidance is K decodes over 50 x 2 transformer passes.

    .venv/bin/python bench/partial_images.py [--steps 20] [--size 128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from _load import markdown_table
from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
from omni_runtime.engine.stage.stage_core_types import (
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
)
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR
from omni_runtime.tiny_models import ensure_tiny_models
from step_cache import SUBDIRS, real_width_pipeline

REAL_BLOCKS = 60


def tiny_table(args: argparse.Namespace) -> str:
    root = ensure_tiny_models(DEFAULT_MODELS_DIR)
    rows: list[list[object]] = []
    for family, subdir in SUBDIRS.items():
        engine = DiffusionEngine(DiffusionEngineConfig(model=str(root / subdir), family=family))
        count = iter(range(10**9))

        def run(partials: int, engine: DiffusionEngine = engine, count: Any = count) -> int:
            request = StageDiffusionCoreRequest(
                request_id=f"r{next(count)}",
                prompt="a red fox in the snow",
                params={
                    "num_inference_steps": args.steps,
                    "height": args.size,
                    "width": args.size,
                    "seed": 7,
                    "negative_prompt": "blurry",
                    "partial_images": partials,
                },
            )
            sent: list[StageDiffusionCoreOutput] = []
            engine.admit(request.request_id)
            output = engine.execute(request, emit=sent.append)
            assert output.images is not None, output.error
            return len(sent)

        base = 0.0
        for partials in range(4):
            run(partials)
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                sent = run(partials)
                times.append((time.perf_counter() - start) * 1e3)
            ms = statistics.median(times)
            base = base or ms
            rows.append([family, partials, sent, f"{ms:.0f}", f"{(ms / base - 1) * 100:+.1f}%"])
    return markdown_table(["family", "partial_images", "sent", "DiT ms", "overhead"], rows)


def real_size_row(args: argparse.Namespace) -> str:
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage().eval()
    side = args.real_size // 8
    latents = torch.randn(1, 16, 1, side, side)
    with torch.inference_mode():
        vae.decode(latents)
        start = time.perf_counter()
        vae.decode(latents)
        decode_s = time.perf_counter() - start
    pipeline, kwargs = real_width_pipeline("qwen-image", args.blocks)
    steps = 4

    def run() -> None:
        with torch.inference_mode():
            pipeline(
                height=args.real_size,
                width=args.real_size,
                num_inference_steps=steps,
                output_type="np",
                **kwargs,
            )

    run()
    start = time.perf_counter()
    run()
    # Guidance on: two transformer passes a step.
    per_block_pass = (time.perf_counter() - start) / steps / 2 / args.blocks
    job_s = 50 * 2 * REAL_BLOCKS * per_block_pass
    rows = [
        [
            f"{args.real_size}x{args.real_size}",
            f"{decode_s * 1e3:.0f}",
            f"{per_block_pass * REAL_BLOCKS * 1e3:.0f}",
            f"{job_s:.0f}",
            *(f"{k * decode_s / job_s * 100:.2f}%" for k in (1, 2, 3)),
        ]
    ]
    headers = [
        "size",
        "VAE decode ms",
        "60-block pass ms",
        "50-step job s",
        "K=1",
        "K=2",
        "K=3",
    ]
    return markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=2, help="real-width blocks measured")
    parser.add_argument("--real-size", type=int, default=256)
    args = parser.parse_args()
    print(f"tiny checkpoints, {args.size}x{args.size}, {args.steps} steps, guidance on:\n")
    print(tiny_table(args))
    print("\nQwen-Image at real sizes (random weights, this CPU; the job from its parts):\n")
    print(real_size_row(args))


if __name__ == "__main__":
    main()
