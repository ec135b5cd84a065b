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

Tracing (`--tracing`): `off` (the default) serves with no `OTEL_*` variable, so no process
traces; `on` has serve's processes export every span over OTLP/HTTP to a sink in this
script (a loopback collector that counts them), so that the serve row is tracing's. `compare`
measures tracing itself, without the in-process side: two serves, tracing off and on, up
at once, requests alternating between them (which goes first alternating too) so that the
machine's drift hits both alike; p50 and mean of each, the ratios, the median of the
paired differences, the spans the sink received; then, in this process, what the tracing
code of one request costs by itself (the router's middleware and stage spans, each
stage's spans; off, then on with a provider exporting to the sink).

    .venv/bin/python bench/two_stage_overhead.py [--requests 20] [--warmup 3]
        [--size 64x64] [--steps 4] [--seed 1] [--pipeline examples/tiny-text-to-image.yaml]
        [--tracing off|on|compare]
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
    otlp_sink,
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


async def send_one(client: AsyncOpenAI, model: str, args: argparse.Namespace) -> float:
    """One chat completion for an image; its latency."""
    start = time.perf_counter()
    reply = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        extra_body={"modalities": ["image"], **image_params(args)},
    )
    latency = time.perf_counter() - start
    # The answer is an image_url part; the openai types say str, the JSON says list.
    parts: Any = reply.choices[0].message.content
    if not (isinstance(parts, list) and parts and "image_url" in parts[0]):
        raise RuntimeError(f"no image in the answer: {str(parts)[:200]}")
    return latency


async def load_serve(base_urls: list[str], args: argparse.Namespace) -> list[list[float]]:
    """``--warmup`` + ``--requests`` sequential requests to each server; with several,
    they take turns, the first of each round alternating."""
    clients = [
        AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        for url in base_urls
    ]
    try:
        models = [(await client.models.list()).data[0].id for client in clients]
        latencies: list[list[float]] = [[] for _ in clients]
        for round_ in range(args.warmup + args.requests):
            order = range(len(clients)) if round_ % 2 == 0 else reversed(range(len(clients)))
            for k in order:
                latencies[k].append(await send_one(clients[k], models[k], args))
        return latencies
    finally:
        for client in clients:
            await client.close()


def serve_environment(traced_to: str | None) -> dict[str, str]:
    """This environment without OTEL_* (no tracing), or exporting spans to ``traced_to``."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    if traced_to is not None:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = traced_to
    return env


def start_serve(
    name: str,
    pipeline_file: Path,
    logs: Path,
    processes: list[ManagedProcess],
    traced_to: str | None,
) -> tuple[str, float]:
    """`omni-runtime serve` (added to ``processes``), once ready: its base URL, and how
    long it took to be."""
    print(f"{name}: starting", file=sys.stderr, flush=True)
    port = free_port()
    command = [
        sys.executable, "-m", "omni_runtime.entrypoints.cli", "serve",
        "-f", str(pipeline_file),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--log-dir", str(logs / name),
    ]  # fmt: skip
    began = time.monotonic()
    processes.append(
        ManagedProcess(name, command, logs / f"{name}.log", env=serve_environment(traced_to))
    )
    wait_http_ok(f"http://127.0.0.1:{port}/health", STARTUP_TIMEOUT_S, processes)
    startup_s = time.monotonic() - began
    print(f"  ready in {startup_s:.1f} s", file=sys.stderr, flush=True)
    return f"http://127.0.0.1:{port}/v1", startup_s


def measure_serve(pipeline_file: Path, args: argparse.Namespace) -> dict[str, Any]:
    with (
        otlp_sink() as sink,
        tempfile.TemporaryDirectory(prefix="bench-two-stage-") as tmp,
        running([]) as processes,
    ):
        traced_to = sink.endpoint if args.tracing == "on" else None
        url, startup_s = start_serve("serve", pipeline_file, Path(tmp), processes, traced_to)
        (latencies,) = asyncio.run(load_serve([url], args))
    name = "serve, traced" if args.tracing == "on" else "serve"
    return side(name, startup_s, latencies)


def measure_tracing(pipeline_file: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Serve with tracing off and on, requests alternating; then the tracing code alone."""
    with (
        otlp_sink() as sink,
        tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp,
        running([]) as processes,
    ):
        off_url, off_startup = start_serve("untraced", pipeline_file, Path(tmp), processes, None)
        on_url, on_startup = start_serve(
            "traced", pipeline_file, Path(tmp), processes, sink.endpoint
        )
        before = sink.count  # spans of the startup (vLLM's own), not of a request
        off, on = asyncio.run(load_serve([off_url, on_url], args))
        # The processes export in batches (every 5 s by default): wait for the last.
        expected = before + SPANS_PER_REQUEST * (args.warmup + args.requests)
        deadline = time.monotonic() + 30
        while sink.count < expected and time.monotonic() < deadline:
            time.sleep(0.2)
        spans = sink.count - before
        code = tracing_code_cost(load_pipeline(pipeline_file), sink.endpoint)
    return {
        "sides": [
            summarise(side("serve, tracing off", off_startup, off), args.warmup),
            summarise(side("serve, tracing on", on_startup, on), args.warmup),
        ],
        "paired_diff_s": [
            b - a for a, b in zip(off[args.warmup :], on[args.warmup :], strict=True)
        ],
        "spans": spans,
        "spans_per_request": spans / (args.warmup + args.requests),
        "code_cost_s": code,
    }


# One traced request's spans: the router's, two stage calls, each stage's queue and
# execution, the put and the get.
SPANS_PER_REQUEST = 9


def tracing_code_cost(pipeline: PipelineConfig, sink: str, rounds: int = 200) -> dict[str, float]:
    """Seconds per request of the tracing code a two-stage request runs (the router's
    middleware around a request, its two stage-call spans and their context, each stage's
    spans from that context), without the request: off, then on (this process then
    installs a provider exporting to ``sink``; nothing else runs here afterwards), and
    the export of those spans. ``rounds`` * 9 spans stay within the exporter's queue (2048
    by default), which would drop the rest."""
    from opentelemetry import trace

    from omni_runtime import tracing
    from omni_runtime.engine.stage.stage_core_types import StageServerOutput, StageServerRequest
    from omni_runtime.router.orchestrator import PipelineOrchestrator
    from omni_runtime.stage_server.frontend import RequestSpans

    orchestrator = PipelineOrchestrator(pipeline, {})
    stages = orchestrator.stages
    done = StageServerOutput(request_id="r", finished=True, finish_reason="stop")
    headers = [(b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}

    stage_requests = [StageServerRequest(request_id="r") for _ in stages]

    async def request(scope: Any, receive: Any, send: Any) -> None:
        for index, (stage, stage_request) in enumerate(zip(stages, stage_requests, strict=True)):
            with orchestrator._stage_span(stage, stage_request):
                # The stage's side, from the context the request carries.
                spans = RequestSpans.of(stage, stage_request)
                if spans is not None:
                    if index > 0:
                        with spans.connector("get", "shm", 6144):
                            pass
                        spans.queued()
                    spans.started()
                    if index == 0:
                        with spans.connector("put", "shm") as span:
                            span.set_attribute(tracing.BYTES, 6144)
                    spans.finished(done)

    async def nothing(message: Any) -> None:
        pass

    async def timed() -> tuple[float, float]:
        """Seconds per request: the spans' making (on the request's path), and their
        export (the exporter's thread, which takes the same CPUs)."""
        middleware = tracing.TraceRequests(request)
        start = time.perf_counter()
        for _ in range(rounds):
            await middleware(scope, nothing, nothing)
        made = time.perf_counter()
        provider: Any = trace.get_tracer_provider()
        if hasattr(provider, "force_flush"):
            provider.force_flush()
        return (made - start) / rounds, (time.perf_counter() - made) / rounds

    def best(runs: list[tuple[float, float]]) -> tuple[float, float]:
        return min(made for made, _ in runs), min(export for _, export in runs)

    off, _ = best([asyncio.run(timed()) for _ in range(5)])
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink
    # Exported when flushed, not meanwhile: the two costs apart.
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = str(3_600_000)
    tracing.configure("bench")
    on, export = best([asyncio.run(timed()) for _ in range(5)])
    return {"off": off, "on": on, "export": export}


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
    parser.add_argument(
        "--tracing",
        choices=["off", "on", "compare"],
        default="off",
        help="serve untraced, traced (spans to a local sink), or both compared (see above)",
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
    if args.tracing == "compare":
        try:
            report_tracing(measure_tracing(args.pipeline, args), args)
        except ServerStartError as e:
            raise SystemExit(f"serve: {e}") from None
        return
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


def report_tracing(result: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(result, indent=2))
        return
    off, on = result["sides"]
    print(
        f"\n{args.pipeline.name}: chat -> hidden states -> {args.width}x{args.height} image, "
        f"{args.steps} steps, seed {args.seed}; {args.requests} requests to each serve, "
        f"alternating, after {args.warmup} warm-up each\n"
    )
    rows: list[list[object]] = []
    for r in (off, on):
        latencies = [ms(r[key]) for key in ("first_s", "p50_s", "mean_s", "min_s", "max_s")]
        rows.append([r["system"], f"{r['startup_s']:.1f}", r["requests"], *latencies])
    p50 = f"{on['p50_s'] / off['p50_s']:.3f}x"
    mean = f"{on['mean_s'] / off['mean_s']:.3f}x"
    rows.append(["on / off", "", "", "", p50, mean, "", ""])
    headers = ["system", "startup s", "requests", "first ms", "p50 ms", "mean ms", "min", "max"]
    print(markdown_table(headers, rows))
    diffs = result["paired_diff_s"]
    spread = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    print(
        f"\npaired difference on - off: median {ms(statistics.median(diffs))} ms, "
        f"mean {ms(statistics.fmean(diffs))} ms (+- {ms(1.96 * spread)} ms, 95%)"
    )
    print(
        f"spans exported by the traced serve: {result['spans']} "
        f"({result['spans_per_request']:.1f} per request)"
    )
    code = result["code_cost_s"]
    print(
        f"tracing code of one request, by itself: off {code['off'] * 1e6:.1f} us; on "
        f"{code['on'] * 1e6:.1f} us making its spans + {code['export'] * 1e6:.1f} us "
        "exporting them (the sink's decoding, in this process, included)"
    )


if __name__ == "__main__":
    main()
