"""What serving adds to a two-stage request: `omni-runtime serve` against the same two
engines called in-process, with no router and no connector.

Pipeline: examples/tiny-text-to-image.yaml (an LLM stage whose `output: hidden_states`
reaches a diffusion stage through the shared-memory connector), on the tiny models at
`$OMNI_TINY_MODELS` (default ~/.cache/omni-operator/tiny-models; built if absent).

- serve: `omni-runtime serve -f PIPELINE`; chat completions from the official `openai`
  client with `modalities: ["image"]`, `--size`, `--steps` and `--seed`, one at a time:
  HTTP, router, LLM stage server and core, connector, diffusion stage server and core,
  PNG encoding, HTTP back.
- in-process: in this process, the pipeline's stage 0 through `start_stage_llm_client` (its
  vLLM core in its own process, as a stage has it) for the hidden states, then
  `InlineStageDiffusionClient` (the diffusion engine in this process) fed them as
  `prompt_embeds`, same params.

Each side: `--warmup` requests not counted, then `--requests` sequential requests: p50 and
mean latency, and the ratios serve / in-process (target: <= 1.05x). The two sides run one
after the other, never together (2 cores). Prints a markdown table; `--json` prints the
figures as JSON.

    .venv/bin/python bench/two_stage_overhead.py [--requests 20] [--warmup 3]
        [--size 64x64] [--steps 4] [--seed 1] [--pipeline examples/tiny-text-to-image.yaml]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from _load import (
    ManagedProcess,
    ServerStartError,
    collect_results,
    exit_on_sigterm,
    free_port,
    markdown_table,
    ms,
    percentile,
    ratio_cell,
    running,
    wait_http_ok,
)
from omni_runtime.config import PipelineConfig, load_pipeline
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR, TINY_MODELS_ENV
from omni_runtime.entrypoints.stage_process import resolve_model
from omni_runtime.tiny_models import ensure_tiny_models

PIPELINE = Path(__file__).resolve().parent.parent / "examples" / "tiny-text-to-image.yaml"
PROMPT = "draw a red cat in a garden"
TARGET = 1.05
STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 120.0


def image_params(args: argparse.Namespace) -> dict[str, int]:
    return {
        "height": args.height,
        "width": args.width,
        "num_inference_steps": args.steps,
        "seed": args.seed,
    }


def side(name: str, startup_s: float, latencies: list[float]) -> dict[str, Any]:
    return {
        "system": name,
        "startup_s": startup_s,
        "first_s": latencies[0] if latencies else math.nan,
        "latencies_s": latencies,
    }


# -- serve --------------------------------------------------------------------------------------


async def load_serve(base_url: str, args: argparse.Namespace) -> list[float]:
    client = AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )
    try:
        model = (await client.models.list()).data[0].id
        latencies = []
        for _ in range(args.warmup + args.requests):
            start = time.perf_counter()
            reply = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": PROMPT}],
                extra_body={"modalities": ["image"], **image_params(args)},
            )
            latencies.append(time.perf_counter() - start)
            # The answer is an image_url part; the openai types say str, the JSON says list.
            parts: Any = reply.choices[0].message.content
            if not (isinstance(parts, list) and parts and "image_url" in parts[0]):
                raise RuntimeError(f"no image in the answer: {str(parts)[:200]}")
        return latencies
    finally:
        await client.close()


def measure_serve(pipeline_file: Path, args: argparse.Namespace) -> dict[str, Any]:
    print("serve: starting", file=sys.stderr, flush=True)
    with (
        tempfile.TemporaryDirectory(prefix="bench-two-stage-") as tmp,
        running([]) as processes,
    ):
        port = free_port()
        command = [
            sys.executable, "-m", "omni_runtime.entrypoints.cli", "serve",
            "-f", str(pipeline_file),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--log-dir", tmp,
        ]  # fmt: skip
        began = time.monotonic()
        processes.append(ManagedProcess("serve", command, Path(tmp) / "serve.log"))
        wait_http_ok(f"http://127.0.0.1:{port}/health", STARTUP_TIMEOUT_S, processes)
        startup_s = time.monotonic() - began
        print(f"  ready in {startup_s:.1f} s", file=sys.stderr, flush=True)
        latencies = asyncio.run(load_serve(f"http://127.0.0.1:{port}/v1", args))
    return side("serve", startup_s, latencies)


# -- in-process -------------------------------------------------------------------------------


async def run_in_process(pipeline: PipelineConfig, args: argparse.Namespace) -> dict[str, Any]:
    # Imported here: vLLM and diffusers take seconds to import, and the serve side runs
    # in other processes without them.
    from omni_runtime.diffusion.engine import DiffusionEngineConfig
    from omni_runtime.diffusion.stage.generate import generate
    from omni_runtime.diffusion.stage.inline_stage_diffusion_client import (
        InlineStageDiffusionClient,
    )
    from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest
    from omni_runtime.engine.stage.stage_llm_core_client import start_stage_llm_client

    llm_stage, diffusion_stage = sorted(pipeline.stages, key=lambda s: s.stage_id)
    print("in-process: starting", file=sys.stderr, flush=True)
    began = time.monotonic()
    llm = start_stage_llm_client(llm_stage, resolve_model(pipeline.stage_model(llm_stage)))
    try:
        # The engine config a stage process builds for this stage (stage_process.py).
        diffusion = InlineStageDiffusionClient(
            DiffusionEngineConfig(
                model=resolve_model(pipeline.stage_model(diffusion_stage)),
                dtype=diffusion_stage.dtype or "float32",
                default_params=dict(diffusion_stage.default_sampling_params),
                device="cpu" if diffusion_stage.devices == "cpu" else "auto",
            )
        )
        try:
            startup_s = time.monotonic() - began
            print(f"  ready in {startup_s:.1f} s", file=sys.stderr, flush=True)
            latencies = []
            for index in range(args.warmup + args.requests):
                request_id = f"bench-{index}"
                start = time.perf_counter()
                await llm.add_prompt_async(
                    request_id, messages=[{"role": "user", "content": PROMPT}]
                )
                encoded = (await collect_results(llm, [request_id], REQUEST_TIMEOUT_S))[request_id]
                if encoded.error is not None or encoded.hidden_states is None:
                    raise RuntimeError(f"LLM stage: {encoded.error or 'no hidden states'}")
                request = StageDiffusionCoreRequest(
                    request_id=request_id,
                    prompt_embeds=encoded.hidden_states.numpy(),
                    params=image_params(args),
                )
                image = (await generate(diffusion, [request], REQUEST_TIMEOUT_S))[request_id]
                latencies.append(time.perf_counter() - start)
                if image.error is not None or image.images is None:
                    raise RuntimeError(f"diffusion stage: {image.error or 'no image'}")
        finally:
            diffusion.shutdown()
    finally:
        llm.shutdown()
    return side("in-process", startup_s, latencies)


# -- the report -------------------------------------------------------------------------------


def summarise(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    measured = result["latencies_s"][warmup:]
    return {
        **result,
        "requests": len(measured),
        "p50_s": percentile(measured, 50),
        "mean_s": statistics.fmean(measured) if measured else math.nan,
        "min_s": min(measured, default=math.nan),
        "max_s": max(measured, default=math.nan),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20, help="measured requests per side")
    parser.add_argument("--warmup", type=int, default=3, help="requests not counted, first")
    parser.add_argument("--size", default="64x64", help="WIDTHxHEIGHT")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pipeline", type=Path, default=PIPELINE)
    parser.add_argument(
        "--only", choices=["serve", "in-process"], help="measure one side alone (no ratio)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.width, args.height = (int(part) for part in args.size.lower().split("x"))
    exit_on_sigterm()
    # The pipeline names its models as $OMNI_TINY_MODELS/...; serve's child processes
    # and resolve_model here read the same variable.
    os.environ.setdefault(TINY_MODELS_ENV, str(DEFAULT_MODELS_DIR))
    ensure_tiny_models(os.environ[TINY_MODELS_ENV])
    # vLLM's CPU build sizes its KV cache from this (GiB); serve's stages default to 1 too.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    pipeline = load_pipeline(args.pipeline)
    results = []
    if args.only in (None, "serve"):
        try:
            results.append(summarise(measure_serve(args.pipeline, args), args.warmup))
        except ServerStartError as e:
            raise SystemExit(f"serve: {e}") from None
    if args.only in (None, "in-process"):
        results.append(summarise(asyncio.run(run_in_process(pipeline, args)), args.warmup))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"\n{args.pipeline.name}: chat -> hidden states -> {args.width}x{args.height} image, "
        f"{args.steps} steps, seed {args.seed}; {args.requests} sequential requests after "
        f"{args.warmup} warm-up; target serve <= {TARGET}x in-process\n"
    )
    rows: list[list[object]] = []
    for r in results:
        latencies = [ms(r[key]) for key in ("first_s", "p50_s", "mean_s", "min_s", "max_s")]
        rows.append([r["system"], f"{r['startup_s']:.1f}", r["requests"], *latencies])
    if len(results) == 2:
        serve, inline = results
        p50 = ratio_cell(serve["p50_s"] / inline["p50_s"], TARGET, False)
        mean = ratio_cell(serve["mean_s"] / inline["mean_s"], TARGET, False)
        rows.append(["serve / in-process", "", "", "", p50, mean, "", ""])
    headers = ["system", "startup s", "requests", "first ms", "p50 ms", "mean ms", "min", "max"]
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
