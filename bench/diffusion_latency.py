"""Request latency of the diffusion stage (client -> StageDiffusionCoreProc over ZMQ).

Measures, on the tiny pipeline built from configs: the proc's start time, and the latency
of sequential requests at each size (the first request at a size is reported apart as
warm-up). Prints a table; `--json` prints the figures as JSON.

    .venv/bin/python bench/diffusion_latency.py [--sizes 64 128] [--steps 20] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from omni_runtime.diffusion.engine import DiffusionEngineConfig
from omni_runtime.diffusion.stage.generate import generate
from omni_runtime.diffusion.stage.stage_diffusion_core_client import StageDiffusionCoreClient
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR
from omni_runtime.tiny_models import DIFFUSION_SUBDIR, ensure_tiny_models


async def measure(args: argparse.Namespace) -> dict[str, object]:
    model = str(ensure_tiny_models(DEFAULT_MODELS_DIR) / DIFFUSION_SUBDIR)
    start = time.perf_counter()
    client = StageDiffusionCoreClient(DiffusionEngineConfig(model=model))
    figures: dict[str, object] = {"startup_s": time.perf_counter() - start, "steps": args.steps}
    try:
        for size in args.sizes:
            latencies = []
            for i in range(args.repeat + 1):
                request = StageDiffusionCoreRequest(
                    request_id=f"{size}-{i}",
                    prompt="a gold sculpture of a cat",
                    params={
                        "height": size,
                        "width": size,
                        "num_inference_steps": args.steps,
                        "seed": i,
                    },
                )
                t0 = time.perf_counter()
                output = (await generate(client, [request]))[request.request_id]
                latencies.append(time.perf_counter() - t0)
                assert output.images is not None, output.error
            figures[f"{size}x{size}"] = {
                "first_s": latencies[0],
                "median_s": statistics.median(latencies[1:]),
                "min_s": min(latencies[1:]),
                "max_s": max(latencies[1:]),
            }
    finally:
        client.shutdown()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = asyncio.run(measure(args))
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"proc start: {figures['startup_s']:.2f} s; {args.steps} steps per request")
    for size in args.sizes:
        f = figures[f"{size}x{size}"]
        assert isinstance(f, dict)
        print(
            f"{size}x{size}: first {f['first_s']:.3f} s, median {f['median_s']:.3f} s "
            f"(min {f['min_s']:.3f}, max {f['max_s']:.3f}) over {args.repeat}"
        )


if __name__ == "__main__":
    main()
