"""Which DiT replica a request goes to, for real: the tiny Qwen-Image served with two DiT
replicas (``omni-runtime serve``), a mix of small and large images, each router policy.

The simulator (bench/replica_choice_sim.py) isolates the choice; this runs it through the
real router, stage servers and cores. 80% of the requests are small (64x64, 2 steps) and
20% large (192x192, 24 steps), arriving as a Poisson stream at ``--rate`` per second.
Latency percentiles per policy, all requests and the small ones apart. On a machine of few
cores the two DiT replicas and the encoder share them, which blurs what the choice changes.

    .venv/bin/python bench/replica_choice_serve.py [--requests 120] [--rate 2.0]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml
from openai import AsyncOpenAI

from _load import ManagedProcess, free_port, markdown_table, percentile, running, wait_http_ok
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR
from omni_runtime.tiny_models import QWEN_IMAGE_SUBDIR, ensure_tiny_models

REPO = Path(__file__).resolve().parents[1]
SMALL = {"size": "64x64", "num_inference_steps": 2}
LARGE = {"size": "192x192", "num_inference_steps": 24}
POLICIES = ("round-robin", "least-outstanding-requests", "least-outstanding-work")


async def load(base: str, args: argparse.Namespace) -> list[tuple[bool, float]]:
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=600)
    rng = random.Random(args.seed)
    results: list[tuple[bool, float]] = []

    async def one(large: bool, n: int) -> None:
        shape = LARGE if large else SMALL
        start = time.perf_counter()
        await client.images.generate(
            prompt="a red fox",
            size=shape["size"],  # type: ignore[arg-type]
            extra_body={"num_inference_steps": shape["num_inference_steps"], "seed": n},
        )
        results.append((large, time.perf_counter() - start))

    for n in range(4):  # warm-up: both kinds on both replicas
        await one(n % 2 == 0, n)
    results.clear()
    tasks = []
    for n in range(args.requests):
        tasks.append(asyncio.create_task(one(rng.random() < args.large_share, n)))
        await asyncio.sleep(rng.expovariate(args.rate))  # the arrivals' schedule, not a wait
    await asyncio.gather(*tasks)
    return results


def measure(policy: str, root: Path, args: argparse.Namespace) -> list[tuple[bool, float]]:
    data = yaml.safe_load((REPO / "examples" / "tiny-qwen-image.yaml").read_text())
    data["model"] = str(root / QWEN_IMAGE_SUBDIR)
    data["stages"][1]["replicas"] = 2
    data["router"]["policy"] = policy
    with tempfile.TemporaryDirectory(prefix="bench-replica-choice-") as tmp, running([]) as procs:
        config = Path(tmp) / "pipeline.yaml"
        config.write_text(yaml.safe_dump(data))
        port = free_port()
        command = [
            sys.executable, "-m", "omni_runtime.entrypoints.cli", "serve", "-f", str(config),
            "--host", "127.0.0.1", "--port", str(port), "--log-dir", tmp,
        ]  # fmt: skip
        procs.append(ManagedProcess("serve", command, Path(tmp) / "serve.log"))
        base = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{base}/health", 300, procs)
        return asyncio.run(load(base, args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    parser.add_argument("--large-share", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    root = ensure_tiny_models(DEFAULT_MODELS_DIR)
    rows = []
    for policy in POLICIES:
        results = measure(policy, root, args)
        latencies = [latency for _, latency in results]
        smalls = [latency for large, latency in results if not large]
        rows.append(
            [
                policy,
                f"{statistics.median(latencies) * 1e3:.0f}",
                f"{percentile(latencies, 99) * 1e3:.0f}",
                f"{statistics.median(smalls) * 1e3:.0f}",
                f"{percentile(smalls, 99) * 1e3:.0f}",
            ]
        )
    print(
        f"tiny qwen-image, 2 DiT replicas; {args.requests} requests, Poisson at {args.rate}/s, "
        f"{args.large_share:.0%} large ({LARGE['size']}, {LARGE['num_inference_steps']} steps), "
        f"the rest {SMALL['size']}, {SMALL['num_inference_steps']} steps:\n"
    )
    print(markdown_table(["policy", "p50 ms", "p99 ms", "small p50 ms", "small p99 ms"], rows))


if __name__ == "__main__":
    main()
