"""The tiny BAGEL served (`omni-runtime serve -f examples/tiny-bagel.yaml`: router, vLLM
thinker stage, BAGEL DiT stage) against BAGEL's own inference code on the same weights.

One job is the seed's TI2I request at the tiny size: an input image and the seed's
instruction, ``--steps`` points (BAGEL's num_timesteps), BAGEL's edit defaults (text and
image guidance: three velocities per step), one seed. Side by side, ``--jobs`` jobs one
after another (the seed's test plan runs ten):

- serve: the official ``openai`` client's chat completion, as the seed sends it;
- in-process: ``BagelGenerator`` (what the DiT stage runs) in this process: serve's floor;
- reference: BAGEL's ``InterleaveInferencer.interleave_inference`` in its own process and
  environment (omni_testkit.bagel_reference), timed per job inside that process
  (model already loaded), as a user of the reference code would run it.

Torch threads: 1 everywhere (the reference's results depend on the thread count, and the
tests compare at 1). Prints a markdown table of p50 / min / max seconds per job.

    .venv/bin/python bench/bagel_serve.py [--jobs 10] [--steps 30] [--size 64]
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from openai import OpenAI
from PIL import Image

from _load import ManagedProcess, markdown_table, running, wait_http_ok
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR
from omni_runtime.modeling.bagel.generation import BagelGenerator, default_guidance
from omni_runtime.tiny_models import BAGEL_SUBDIR, ensure_tiny_models
from omni_testkit.bagel_reference.harness import guidance_spec, reference_dir, run_reference

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "<|im_start|>Turn the main subject into a polished gold sculpture.<|im_end|>"
SEED = 42


def input_image(size: int) -> np.ndarray:
    return np.random.default_rng(3).integers(0, 256, (size, size, 3), dtype=np.uint8)


def png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def serve_jobs(checkpoint: Path, args: argparse.Namespace, workdir: Path) -> list[float]:
    data = yaml.safe_load((ROOT / "examples" / "tiny-bagel.yaml").read_text())
    data["model"] = str(checkpoint)
    port = data["router"]["port"] = args.port
    config = workdir / "pipeline.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [sys.executable, "-m", "omni_runtime.entrypoints.cli", "serve", "-f", str(config)]
    url = "data:image/png;base64," + base64.b64encode(png(input_image(args.size))).decode()
    messages: Any = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": PROMPT},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]
    extra = {
        "modalities": ["image"],
        "height": args.size,
        "width": args.size,
        "num_inference_steps": args.steps,
        "seed": SEED,
    }
    processes: list[ManagedProcess] = []
    with running(processes):
        processes.append(ManagedProcess("serve", command, workdir / "serve.log", env))
        wait_http_ok(f"http://127.0.0.1:{port}/health", 300, processes)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300)
        client.chat.completions.create(model="tiny-bagel", messages=messages, extra_body=extra)
        before = stage_seconds(port)
        times = []
        for _ in range(args.jobs):
            start = time.perf_counter()
            client.chat.completions.create(model="tiny-bagel", messages=messages, extra_body=extra)
            times.append(time.perf_counter() - start)
        after = stage_seconds(port)
    for stage in sorted(after):
        total = after[stage][0] - before.get(stage, (0.0, 0))[0]
        count = after[stage][1] - before.get(stage, (0.0, 0))[1]
        print(f"serve: stage {stage}: {count} requests, {1000 * total / max(count, 1):.1f} ms each")
    return times


def stage_seconds(port: int) -> dict[str, tuple[float, int]]:
    """(seconds, requests) each stage spent so far, as the router measured them (from a
    request's dispatch to its last output, hand-off included)."""
    import httpx

    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    found: dict[str, list[float]] = {}
    for line in metrics.splitlines():
        for suffix, slot in (("_sum", 0), ("_count", 1)):
            name = f"omni_stage_request_duration_seconds{suffix}{{"
            if line.startswith(name):
                stage = line.split('stage="', 1)[1].split('"', 1)[0]
                found.setdefault(stage, [0.0, 0.0])[slot] += float(line.split()[-1])
    return {stage: (seconds, int(count)) for stage, (seconds, count) in found.items()}


def in_process_jobs(checkpoint: Path, args: argparse.Namespace) -> list[float]:
    torch.set_num_threads(1)
    generator = BagelGenerator.load(checkpoint)
    guidance = replace(default_guidance(True), num_timesteps=args.steps)
    picture = Image.fromarray(input_image(args.size))
    times = []
    for job in range(args.jobs + 1):
        start = time.perf_counter()
        rng = torch.Generator().manual_seed(SEED)
        contexts = generator.contexts(PROMPT, generator.prepare_image(picture), 0, 0, rng)
        generator.generate(contexts, guidance, rng)
        if job:  # the first warms up
            times.append(time.perf_counter() - start)
    return times


def reference_jobs(checkpoint: Path, args: argparse.Namespace, workdir: Path) -> list[float]:
    if reference_dir() is None:
        raise SystemExit("no BAGEL reference code (set OMNI_BAGEL_REFERENCE)")
    guidance = replace(default_guidance(True), num_timesteps=args.steps)
    image = workdir / "input.png"
    image.write_bytes(png(input_image(args.size)))
    spec = {
        "checkpoint": str(checkpoint),
        "prompt": PROMPT,
        "image": str(image),
        "seed": SEED,
        **guidance_spec(guidance),
        "height": args.size,
        "width": args.size,
        "out": str(workdir / "reference.npz"),
        "repeat": args.jobs + 1,
    }
    seconds: list[float] = run_reference(spec, workdir)["job_seconds"].tolist()
    return seconds[1:]  # the first warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--port", type=int, default=8131)
    args = parser.parse_args()
    # The processes started here (serve's stages, the reference) run on one thread too.
    os.environ["OMP_NUM_THREADS"] = "1"
    checkpoint = ensure_tiny_models(DEFAULT_MODELS_DIR) / BAGEL_SUBDIR
    with tempfile.TemporaryDirectory(prefix="bagel-bench-") as tmp:
        workdir = Path(tmp)
        sides = {
            "reference (BAGEL's code, in its process)": reference_jobs(checkpoint, args, workdir),
            "in-process (BagelGenerator)": in_process_jobs(checkpoint, args),
            "serve (router, thinker, DiT; openai client)": serve_jobs(checkpoint, args, workdir),
        }
    rows = [
        [name, f"{statistics.median(t):.3f}", f"{min(t):.3f}", f"{max(t):.3f}"]
        for name, t in sides.items()
    ]
    print(
        f"{args.jobs} TI2I jobs, {args.size}x{args.size}, {args.steps} points, edit guidance, "
        "one at a time (seconds per job)\n"
    )
    print(markdown_table(["side", "p50", "min", "max"], rows))


if __name__ == "__main__":
    main()
