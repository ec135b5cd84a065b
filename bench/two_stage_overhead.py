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
  `InlineStageDiffusionClient` (the diffusion engine in this process, built from the
  config a stage process builds, `diffusion_engine_config`) fed them as `prompt_embeds`,
  same params.

Placement, the same on both sides. The LLM core is started by the same
StageLLMCoreProcManager on both, so vLLM's OMPProcessManager binds it alike (on x86: one CPU
reserved for the other processes, OMP_NUM_THREADS = the CPUs left, every thread of the core
on them; CPU 0 on 2 cores). The diffusion engine is not bound on either side, as in a pod:
the operator renders no CPU or thread variable into a stage container (render/stages.py), and a
stage leaves torch its default intra-op threads (`DiffusionEngineConfig.num_threads` is
never set; torch's default is one thread per CPU the process may run on, which a pod's CPU
limit does not lower); nothing reserves a CPU for the servers beside it. Serve goes first;
the torch threads its diffusion core got (read from its config, else what torch picks in
its environment and CPU affinity) are given to the in-process engine
(`torch.set_num_threads`), so the two run on the same thread count by construction. A
placement column says what each side got, and a table shows where each process's threads
may run; a side whose placement differs from the other's says so.

Each side: `--warmup` requests not counted, then `--requests` sequential requests: p50 and
mean latency, and the ratios serve / in-process (target: <= 1.05x). The two sides run one
after the other, never together (2 cores). Where serve's time goes: the CPU time (user +
system) of each process over the measured requests, per request, by process role (serve:
router, each stage server, the LLM core, the diffusion core; in-process: this script,
which runs the diffusion engine, and the LLM core; this script is also serve's client).
Prints markdown tables; `--json` prints the figures as JSON.

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
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import psutil
from openai import AsyncOpenAI

from _load import (
    THIS_SCRIPT,
    CpuSampler,
    CpuWindow,
    ManagedProcess,
    ServerStartError,
    collect_results,
    cpu_list,
    exit_on_sigterm,
    free_port,
    markdown_table,
    ms,
    otlp_sink,
    percentile,
    placement_of,
    process_role,
    process_tree,
    ratio_cell,
    role_order,
    running,
    thread_affinities,
    wait_http_ok,
)
from omni_runtime.config import PipelineConfig, load_pipeline
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR, TINY_MODELS_ENV
from omni_runtime.entrypoints.stage_process import diffusion_engine_config, resolve_model
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


def side(
    name: str,
    startup_s: float,
    latencies: list[float],
    placement: dict[str, Any] | None = None,
    cpu: CpuWindow | None = None,
) -> dict[str, Any]:
    return {
        "system": name,
        "startup_s": startup_s,
        "first_s": latencies[0] if latencies else math.nan,
        "latencies_s": latencies,
        "placement": placement or {},
        "cpu_s_by_process": cpu.seconds if cpu is not None else {},
        "processes_by_role": cpu.processes if cpu is not None else {},
    }


# -- placement ----------------------------------------------------------------------------------


def stage_labels(pipeline: PipelineConfig) -> dict[str, str]:
    """serve's stage processes by their ``--stages``: ``stage server (thinker)``."""
    return {str(stage.stage_id): f"stage server ({stage.name})" for stage in pipeline.stages}


def roles(pipeline: PipelineConfig) -> Callable[[psutil.Process], str]:
    labels = stage_labels(pipeline)
    return lambda proc: process_role(proc, labels)


def engine_cpus(proc: psutil.Process) -> set[int]:
    """Every CPU some thread of ``proc`` may run on."""
    cpus: set[int] = set()
    for affinity in thread_affinities(proc):
        cpus |= affinity
    return cpus


def torch_default_threads(proc: psutil.Process) -> int:
    """The intra-op threads torch picks in ``proc``'s environment and CPU affinity (what a
    diffusion core that sets none runs on): asked of a fresh interpreter placed alike."""
    cpus = sorted(os.sched_getaffinity(proc.pid))
    code = (
        f"import os; os.sched_setaffinity(0, {cpus}); import torch; print(torch.get_num_threads())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=proc.environ(),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return int(done.stdout.strip().splitlines()[-1])


def diffusion_core_threads(proc: psutil.Process) -> int:
    """The torch threads of serve's diffusion core: its config's, else torch's default."""
    cmdline = proc.cmdline()
    config = json.loads(cmdline[cmdline.index("--config") + 1])
    threads = config.get("num_threads")
    return int(threads) if threads is not None else torch_default_threads(proc)


def observe(pipeline: PipelineConfig, diffusion_threads: int | None) -> dict[str, Any]:
    """What this side's processes got, once up: where each one's threads may run, the LLM
    core's CPUs and the diffusion engine's torch threads and CPUs (``diffusion_threads``:
    in this process, when the engine runs here; else read from serve's diffusion core)."""
    role_of = roles(pipeline)
    processes: list[list[str]] = []
    summary: dict[str, Any] = {}
    for proc in process_tree():
        try:
            role = role_of(proc)
            processes.append([role, placement_of(proc)])
            if role == "LLM stage core":
                summary["llm_core_cpus"] = cpu_list(engine_cpus(proc))
            if role == "diffusion core" or (role == THIS_SCRIPT and diffusion_threads):
                summary["diffusion_cpus"] = cpu_list(os.sched_getaffinity(proc.pid))
                summary["diffusion_threads"] = (
                    diffusion_threads if role == THIS_SCRIPT else diffusion_core_threads(proc)
                )
        except (psutil.Error, subprocess.SubprocessError, ValueError, KeyError):
            continue
    summary["processes"] = processes
    return summary


def placement_cell(placement: dict[str, Any]) -> str:
    if not placement:
        return "-"
    return (
        f"LLM core on CPU(s) {placement.get('llm_core_cpus', '?')}; diffusion "
        f"{placement.get('diffusion_threads', '?')} torch threads on CPU(s) "
        f"{placement.get('diffusion_cpus', '?')}"
    )


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


async def load_serve(
    base_urls: list[str], args: argparse.Namespace, sampler: CpuSampler | None = None
) -> tuple[list[list[float]], CpuWindow | None]:
    """``--warmup`` + ``--requests`` sequential requests to each server; with several,
    they take turns, the first of each round alternating. ``sampler`` covers the
    measured requests (after the warm-up)."""
    clients = [
        AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        for url in base_urls
    ]
    try:
        models = [(await client.models.list()).data[0].id for client in clients]
        latencies: list[list[float]] = [[] for _ in clients]
        for round_ in range(args.warmup + args.requests):
            if round_ == args.warmup and sampler is not None:
                sampler.start()
            order = range(len(clients)) if round_ % 2 == 0 else reversed(range(len(clients)))
            for k in order:
                latencies[k].append(await send_one(clients[k], models[k], args))
        return latencies, sampler.stop() if sampler is not None else None
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
    pipeline = load_pipeline(pipeline_file)
    with (
        otlp_sink() as sink,
        tempfile.TemporaryDirectory(prefix="bench-two-stage-") as tmp,
        running([]) as processes,
    ):
        traced_to = sink.endpoint if args.tracing == "on" else None
        url, startup_s = start_serve("serve", pipeline_file, Path(tmp), processes, traced_to)
        placement = observe(pipeline, None)
        sampler = CpuSampler(role_of=roles(pipeline))
        (latencies,), cpu = asyncio.run(load_serve([url], args, sampler))
    name = "serve, traced" if args.tracing == "on" else "serve"
    return side(name, startup_s, latencies, placement, cpu)


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
        (off, on), _ = asyncio.run(load_serve([off_url, on_url], args))
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


async def run_in_process(
    pipeline: PipelineConfig, args: argparse.Namespace, threads: int | None
) -> dict[str, Any]:
    """The in-process side; ``threads``: the diffusion engine's torch threads (serve's
    diffusion core's), None for torch's default."""
    # Imported here: vLLM and diffusers take seconds to import, and the serve side runs
    # in other processes without them.
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
        # The engine config a stage process builds for this stage, with serve's threads.
        model = resolve_model(pipeline.stage_model(diffusion_stage))
        config = diffusion_engine_config(pipeline, diffusion_stage, model)
        diffusion = InlineStageDiffusionClient(
            msgspec.structs.replace(config, num_threads=threads) if threads is not None else config
        )
        try:
            startup_s = time.monotonic() - began
            print(f"  ready in {startup_s:.1f} s", file=sys.stderr, flush=True)
            import torch

            placement = observe(pipeline, torch.get_num_threads())
            sampler = CpuSampler(role_of=roles(pipeline))
            latencies = []
            for index in range(args.warmup + args.requests):
                if index == args.warmup:
                    sampler.start()
                request_id = f"bench-{index}"
                start = time.perf_counter()
                await llm.add_request_async(
                    llm.request_builder.build(
                        request_id, messages=[{"role": "user", "content": PROMPT}]
                    )
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
            cpu = sampler.stop()
        finally:
            diffusion.shutdown()
    finally:
        llm.shutdown()
    return side("in-process", startup_s, latencies, placement, cpu)


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
        # The threads serve's diffusion core ran on, given to the in-process engine.
        threads = results[0]["placement"].get("diffusion_threads") if results else None
        results.append(summarise(asyncio.run(run_in_process(pipeline, args, threads)), args.warmup))
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
        placement = placement_cell(r["placement"])
        rows.append([r["system"], placement, f"{r['startup_s']:.1f}", r["requests"], *latencies])
    if len(results) == 2:
        serve, inline = results
        p50 = ratio_cell(serve["p50_s"] / inline["p50_s"], TARGET, False)
        mean = ratio_cell(serve["mean_s"] / inline["mean_s"], TARGET, False)
        rows.append(["serve / in-process", "", "", "", "", p50, mean, "", ""])
    headers = [
        "system", "placement", "startup s", "requests", "first ms", "p50 ms", "mean ms", "min",
        "max",
    ]  # fmt: skip
    print(markdown_table(headers, rows))
    print_cpu_and_placement(results)


def print_cpu_and_placement(results: list[dict[str, Any]]) -> None:
    """The CPU time per request of each process, and where each process's threads ran."""
    rows: list[list[object]] = []
    for r in results:
        seconds: dict[str, float] = r["cpu_s_by_process"]
        if not seconds or not r["requests"]:
            continue
        served = r["system"].startswith("serve")
        for role in sorted(seconds, key=role_order):
            per_request = seconds[role] / r["requests"] * 1000
            if per_request < 0.05:
                continue  # the resource tracker
            name = THIS_SCRIPT + (" (the client)" if served else "")
            rows.append([r["system"], name if role == THIS_SCRIPT else role, f"{per_request:.1f}"])
        # serve's total leaves its client out; in-process, this script is the system.
        total = sum(v for role, v in seconds.items() if not (served and role == THIS_SCRIPT))
        name = "all but the client" if served else "all"
        rows.append([r["system"], name, f"{total / r['requests'] * 1000:.1f}"])
    if rows:
        print("\nms of CPU (user + system) per measured request, per process\n")
        print(markdown_table(["system", "process", "ms CPU / request"], rows))
    rows = [
        [r["system"], role, where]
        for r in results
        for role, where in sorted(
            r["placement"].get("processes", []), key=lambda item: (role_order(item[0]), item[1])
        )
    ]
    if rows:
        print("\nwhere each process's threads may run, once up\n")
        print(markdown_table(["system", "process", "where its threads may run"], rows))
    if len(results) == 2:
        keys = ("llm_core_cpus", "diffusion_threads", "diffusion_cpus")
        first, second = ({k: r["placement"].get(k) for k in keys} for r in results)
        if first != second:
            print(
                f"\n- placements DIFFER: {results[0]['system']} {first}, "
                f"{results[1]['system']} {second}"
            )


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
