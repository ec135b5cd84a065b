"""torchCompile (the DiT's repeated blocks compiled by torch.compile, regionally): what it
saves per image once compiled, what the first request of a shape waits for, and whether
the image changes.

Two tables, both on this CPU (inductor's C++ kernels; a GPU's are Triton's, and the
figures there are to be measured where one is lent):

1. Each family's tiny checkpoint through the DiT stage's engine (DiffusionEngine, as a
   stage runs it), guidance on: eager and compiled ms per image, the first compiled
   request's seconds, and whether the images are the same bytes.
2. Real-sized layers (bench/step_cache.py's: the published width, a few blocks, random
   weights, the tiny VAE), eager against compiled.

The inductor cache (``/tmp/torchinductor_$USER``) makes a second run's first request
faster; clear it for a cold figure.

    .venv/bin/python bench/torch_compile.py [--steps 8] [--sizes 64,128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from _load import markdown_table
from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR
from omni_runtime.tiny_models import ensure_tiny_models
from step_cache import SUBDIRS, real_width_pipeline, timed


def tiny_table(args: argparse.Namespace) -> str:
    root = ensure_tiny_models(DEFAULT_MODELS_DIR)
    rows: list[list[object]] = []
    counter = iter(range(10**9))
    for family, subdir in SUBDIRS.items():
        engines = {
            compiled: DiffusionEngine(
                DiffusionEngineConfig(
                    model=str(root / subdir), family=family, torch_compile=compiled
                )
            )
            for compiled in (False, True)
        }

        def run(engine: DiffusionEngine, size: int) -> np.ndarray:
            request = StageDiffusionCoreRequest(
                request_id=f"r{next(counter)}",
                prompt="a red fox in the snow",
                params={
                    "num_inference_steps": args.steps,
                    "height": size,
                    "width": size,
                    "seed": 7,
                    "negative_prompt": "blurry",
                },
            )
            engine.admit(request.request_id)
            output = engine.execute(request)
            assert output.images is not None, output.error
            return output.images

        eager_engine, compiled_engine = engines[False], engines[True]
        for size in args.sizes:
            start = time.perf_counter()
            run(compiled_engine, size)
            first_s = time.perf_counter() - start
            eager_ms, eager = timed(lambda e=eager_engine, size=size: run(e, size), args.repeat)
            compiled_ms, compiled = timed(
                lambda e=compiled_engine, size=size: run(e, size), args.repeat
            )
            rows.append(
                [
                    family,
                    f"{size}x{size}",
                    f"{eager_ms:.0f}",
                    f"{compiled_ms:.0f}",
                    f"{eager_ms / compiled_ms:.2f}x",
                    f"{first_s:.1f}",
                    "yes" if np.array_equal(eager, compiled) else "no",
                ]
            )
    headers = [
        "family",
        "size",
        "eager ms",
        "compiled ms",
        "speed-up",
        "first compiled request s",
        "same bytes",
    ]
    return markdown_table(headers, rows)


def real_width_table(args: argparse.Namespace) -> str:
    rows: list[list[object]] = []
    for family in SUBDIRS:
        pipeline, kwargs = real_width_pipeline(family, args.blocks)

        def run(pipeline: Any = pipeline, kwargs: Any = kwargs) -> np.ndarray:
            with torch.inference_mode():
                result = pipeline(
                    height=args.real_size,
                    width=args.real_size,
                    num_inference_steps=args.real_steps,
                    generator=torch.Generator("cpu").manual_seed(0),
                    output_type="np",
                    **kwargs,
                )
            return np.asarray(result.images)

        eager_ms, _ = timed(run, 1)
        pipeline.transformer.compile_repeated_blocks(fullgraph=False)
        start = time.perf_counter()
        run()
        first_s = time.perf_counter() - start
        compiled_ms, _ = timed(run, 1)
        rows.append(
            [
                family,
                f"{eager_ms:.0f}",
                f"{compiled_ms:.0f}",
                f"{eager_ms / compiled_ms:.2f}x",
                f"{first_s:.1f}",
            ]
        )
        del pipeline
    headers = ["family", "eager ms", "compiled ms", "speed-up", "first compiled run s"]
    return markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--sizes", type=lambda text: [int(s) for s in text.split(",")], default=[64, 128]
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=2, help="real-width blocks")
    parser.add_argument("--real-steps", type=int, default=4)
    parser.add_argument("--real-size", type=int, default=256)
    args = parser.parse_args()
    print(f"tiny checkpoints, {args.steps} steps, guidance on:\n")
    print(tiny_table(args))
    print(
        f"\nreal-width transformers, {args.blocks} blocks, {args.real_size}x{args.real_size}, "
        f"{args.real_steps} steps, guidance on:\n"
    )
    print(real_width_table(args))


if __name__ == "__main__":
    main()
