"""Batched DiT requests: images per second at concurrency 8 with the stage's maxNumSeqs 8
against 1 (each request alone), and latency one at a time with each, through the diffusion
core process (StageDiffusionCoreProc) on each family's tiny checkpoint.

    .venv/bin/python bench/dit_batches.py [--requests 32] [--concurrency 8] [--steps 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from _load import markdown_table
from omni_runtime.diffusion.engine import DiffusionEngineConfig
from omni_runtime.diffusion.stage.generate import generate
from omni_runtime.diffusion.stage.stage_diffusion_core_client import StageDiffusionCoreClient
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR
from omni_runtime.tiny_models import QWEN_IMAGE_SUBDIR, Z_IMAGE_SUBDIR, ensure_tiny_models

SUBDIRS = {"qwen-image": QWEN_IMAGE_SUBDIR, "z-image": Z_IMAGE_SUBDIR}
PROMPTS = ["a red fox in the snow", "a lighthouse at night", "two cats on a sofa"]


async def measure(family: str, max_batch: int, args: argparse.Namespace) -> tuple[float, float]:
    """(p50 seconds one at a time, images per second at the concurrency)."""
    root = ensure_tiny_models(DEFAULT_MODELS_DIR)
    config = DiffusionEngineConfig(
        model=str(root / SUBDIRS[family]), family=family, max_batch=max_batch
    )
    client = StageDiffusionCoreClient(config)
    count = iter(range(10**9))

    def request() -> StageDiffusionCoreRequest:
        n = next(count)
        return StageDiffusionCoreRequest(
            request_id=f"{family}-{max_batch}-{n}",
            prompt=PROMPTS[n % len(PROMPTS)],
            params={
                "num_inference_steps": args.steps,
                "height": args.size,
                "width": args.size,
                "seed": n,
                "negative_prompt": "blurry",
            },
        )

    try:
        for _ in range(2):
            await generate(client, [request()])
        alone = []
        for _ in range(args.alone):
            start = time.perf_counter()
            await generate(client, [request()])
            alone.append(time.perf_counter() - start)
        # A closed loop: each of the clients sends its next request when its last is
        # answered; one task reads the client's outputs for all of them.
        done: dict[str, asyncio.Event] = {}
        total = args.requests

        async def reader() -> None:
            finished = 0
            while finished < total:
                outputs = await client.get_outputs_async()
                for output in outputs.outputs:  # type: ignore[attr-defined]
                    if output.partial_index is None:
                        finished += 1
                        done.setdefault(output.request_id, asyncio.Event()).set()

        sent = iter(range(total))

        async def one_client() -> None:
            for _ in sent:
                req = request()
                answered = done.setdefault(req.request_id, asyncio.Event())
                await client.add_request_async(req)
                await answered.wait()

        start = time.perf_counter()
        await asyncio.gather(reader(), *(one_client() for _ in range(args.concurrency)))
        throughput = total / (time.perf_counter() - start)
    finally:
        client.shutdown()
    return statistics.median(alone), throughput


async def main_async(args: argparse.Namespace) -> None:
    rows = []
    for family in SUBDIRS:
        one_p50, one_rate = await measure(family, 1, args)
        many_p50, many_rate = await measure(family, args.concurrency, args)
        rows.append(
            [
                family,
                f"{one_p50 * 1e3:.0f}",
                f"{many_p50 * 1e3:.0f}",
                f"{(many_p50 / one_p50 - 1) * 100:+.1f}%",
                f"{one_rate:.2f}",
                f"{many_rate:.2f}",
                f"{many_rate / one_rate:.2f}x",
            ]
        )
    headers = [
        "family",
        "c1 p50 ms, alone",
        f"c1 p50 ms, maxNumSeqs {args.concurrency}",
        "change",
        f"images/s at {args.concurrency}, alone",
        f"images/s at {args.concurrency}, batched",
        "speed-up",
    ]
    print(
        f"tiny checkpoints, {args.size}x{args.size}, {args.steps} steps, guidance on, "
        f"{args.requests} requests at concurrency {args.concurrency}:\n"
    )
    print(markdown_table(headers, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--alone", type=int, default=8, help="requests one at a time")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
