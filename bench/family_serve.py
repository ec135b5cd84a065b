"""A tiny family pipeline served split (`omni-runtime serve`: router, vLLM encoder stage,
diffusers DiT stage) against the family's monolithic diffusers pipeline in-process, on
the same weights.

- serve: `omni-runtime serve -f examples/tiny-FAMILY.yaml` (model under the tiny root),
  asked by the official `openai` client: ``images.generate`` at WIDTHxHEIGHT, ``--steps``,
  with a negative prompt, so that guidance runs and the router asks the encoder for the
  negative prompt's embeddings too (a companion request).
- monolithic: ``DiffusionPipeline.from_pretrained(checkpoint)`` in this process, called
  with the same prompt, negative prompt, size, steps and seed (a PIL image out). Its
  "concurrency 8" is the requests one after another: diffusers pipelines are not
  thread-safe, so sequential is what one process can honestly do.

- DiT engine alone: a reference, not a rival: in this process, what serve's DiT core runs
  per request (``DiffusionEngine``, the checkpoint without its text components), fed the
  monolithic pipeline's embeddings; serve's floor at concurrency 1.

Torch threads: the default everywhere (all CPUs) for the DiT and the monolithic pipeline;
serve's vLLM encoder core pins its OpenMP threads as vLLM does (auto binding). Each side
warms up, then ``--rounds`` rounds, the sides taking turns within each (an idle serve
costs ~1% CPU; taking turns keeps this machine's drift out of the ratios): ``--requests``
one at a time (p50 latency; target serve <= 1.1x monolithic), then ``--batch`` requests
``--concurrency`` at a time (throughput; target serve > monolithic). Medians over rounds,
spread min-max. Where serve's time goes: the router's /metrics (each stage's request time
as the router sees it) and each process's CPU time per image.

    .venv/bin/python bench/family_serve.py [--family qwen-image|z-image] [--rounds 5]
        [--requests 16] [--batch 32] [--concurrency 8] [--steps 4] [--size 64x64]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch
import yaml
from openai import AsyncOpenAI

from _load import (
    ManagedProcess,
    exit_on_sigterm,
    free_port,
    markdown_table,
    ms,
    percentile,
    ratio_cell,
    running,
    wait_http_ok,
)
from family_encoder import REPO, monolithic, tiny_root

PROMPT = "a red cat on a green hydrant"
NEGATIVE = "blurry, dark"
LATENCY_TARGET = 1.1
STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 120.0
_METRIC = re.compile(r'^(omni_\w+_duration_seconds)_(sum|count)\{\w+="([^"]+)"\} (\S+)$')
Send = Callable[[int], Awaitable[None]]


@dataclass
class Side:
    name: str
    send: Send
    concurrency: int
    # Marked as each of the side's phases ("c1", "batch") begins and ("end") ends.
    probe: Phased = field(default_factory=lambda: Phased(dict))
    p50s: list[float] = field(default_factory=list)
    batch_s: list[float] = field(default_factory=list)


async def worker(send: Send, counter: Iterator[int], left: Iterator[int]) -> None:
    """Send requests until ``left`` (shared by the workers of a batch) runs out."""
    for _ in left:
        await send(next(counter))


async def run_rounds(sides: Sequence[Side], args: argparse.Namespace) -> None:
    counter = iter(range(sys.maxsize))
    for side in sides:
        for _ in range(args.warmup):
            await side.send(next(counter))
        warm = iter(range(side.concurrency * 2))
        await asyncio.gather(*(worker(side.send, counter, warm) for _ in range(side.concurrency)))
    for _ in range(args.rounds):
        for side in sides:
            side.probe.mark("c1")
            latencies = []
            for _ in range(args.requests):
                start = time.perf_counter()
                await side.send(next(counter))
                latencies.append(time.perf_counter() - start)
            side.p50s.append(percentile(latencies, 50))
            side.probe.mark("end")
        for side in sides:
            side.probe.mark("batch")
            left = iter(range(args.batch))
            start = time.perf_counter()
            await asyncio.gather(
                *(worker(side.send, counter, left) for _ in range(side.concurrency))
            )
            side.batch_s.append(time.perf_counter() - start)
            side.probe.mark("end")


# -- where the time goes: the router's /metrics and each process's CPU time ---------------------


class Phased:
    """Counters read at each ``mark``; their growth summed per phase over the rounds."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self.read = read
        self.totals: dict[str, dict[str, float]] = {}
        self.phase = "end"
        self.last: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = self.read()
        if self.phase != "end":
            totals = self.totals.setdefault(self.phase, {})
            for key, value in now.items():
                totals[key] = totals.get(key, 0.0) + value - self.last.get(key, 0.0)
        self.phase, self.last = phase, now


def router_metrics(client: httpx.Client) -> dict[str, float]:
    """ "NAME LABEL sum|count" -> value, of the router's duration histograms."""
    found = {}
    for line in client.get("/metrics").text.splitlines():
        if match := _METRIC.match(line):
            name, part, label, value = match.groups()
            kind = "router" if "router" in name else "stage"
            found[f"{kind} {label}|{part}"] = float(value)
    return found


def cpu_seconds(root: psutil.Process, stage_names: dict[str, str]) -> dict[str, float]:
    """CPU seconds (user + system) of ``root`` and its descendants, by role."""
    found: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            command, times = " ".join(proc.cmdline()), proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        if "StageLLMCoreProc" in command:
            role = "vLLM core"
        elif "diffusion_core_proc" in command:
            role = "diffusion core"
        elif match := re.search(r"--stages (\S+)", command):
            role = f"stage server {stage_names.get(match[1], match[1])}"
        elif proc is root:
            role = "serve: router"
        else:
            continue  # multiprocessing's resource tracker
        found[f"cpu {role}"] = found.get(f"cpu {role}", 0.0) + times.user + times.system
    return found


def split_rows(probe: Phased, side: str, per_phase: dict[str, int]) -> list[list[object]]:
    """Rows: mean time per request the router measured, CPU ms per image by process."""
    rows: list[list[object]] = []
    for phase in ("c1", "batch"):
        totals = probe.totals.get(phase, {})
        for key, value in sorted(totals.items()):
            if key.endswith("|count") and value:
                what = key.removesuffix("|count")
                mean = totals[f"{what}|sum"] / value
                rows.append([phase, side, f"{what}: wall per request", int(value), ms(mean)])
        for key, value in sorted(totals.items()):
            if key.startswith("cpu "):
                images = per_phase[phase]
                what = f"{key.removeprefix('cpu ')}: CPU per image"
                rows.append([phase, side, what, images, ms(value / images)])
    return rows


# -- the two sides -----------------------------------------------------------------------------


def serve_sender(client: AsyncOpenAI, model: str, args: argparse.Namespace) -> Send:
    async def send(seed: int) -> None:
        answer = await client.images.generate(
            model=model,
            prompt=PROMPT,
            size=args.size,
            extra_body={
                "negative_prompt": NEGATIVE,
                "num_inference_steps": args.steps,
                "seed": seed,
            },
        )
        if not answer.data or not answer.data[0].b64_json:
            raise RuntimeError("no image in the answer")

    return send


def monolithic_sender(pipeline: Any, args: argparse.Namespace) -> Send:
    width, height = (int(side) for side in args.size.lower().split("x"))

    async def send(seed: int) -> None:
        # Blocks the loop: the one pipeline runs one call at a time (it is not thread-safe).
        with torch.inference_mode():
            pipeline(
                prompt=PROMPT,
                negative_prompt=NEGATIVE,
                num_inference_steps=args.steps,
                height=height,
                width=width,
                generator=torch.Generator("cpu").manual_seed(seed),
            )

    return send


def embeddings(family: str, pipeline: Any) -> tuple[Any, Any]:
    """The prompt's and negative prompt's embeddings, [tokens, width], as the monolithic
    pipeline's __call__ encodes them."""
    with torch.inference_mode():
        if family == "z-image":
            (positive,), (negative,) = pipeline.encode_prompt(
                prompt=PROMPT, device="cpu", negative_prompt=NEGATIVE
            )
        else:
            positive = pipeline.encode_prompt(prompt=PROMPT, device="cpu")[0][0]
            negative = pipeline.encode_prompt(prompt=NEGATIVE, device="cpu")[0][0]
    return positive.numpy(), negative.numpy()


def engine_sender(
    family: str, root: Path, embeds: tuple[Any, Any], args: argparse.Namespace
) -> Send:
    """What the DiT stage's core runs per request, here in-process: DiffusionEngine (the
    checkpoint without its text components) fed the embeddings, one call at a time."""
    from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
    from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest

    config = DiffusionEngineConfig(model=str(root / family), family=family, text_from_upstream=True)
    engine = DiffusionEngine(config)
    width, height = (int(side) for side in args.size.lower().split("x"))
    params = {"num_inference_steps": args.steps, "height": height, "width": width}

    async def send(seed: int) -> None:
        request = StageDiffusionCoreRequest(
            request_id=f"engine-{seed}",
            prompt_embeds=embeds[0],
            negative_prompt_embeds=embeds[1],
            params={**params, "seed": seed},
        )
        engine.admit(request.request_id)
        output = engine.execute(request)
        if output.error is not None:
            raise RuntimeError(output.error.message)

    return send


def measure(family: str, root: Path, args: argparse.Namespace) -> tuple[list[Side], list[Any]]:
    data = yaml.safe_load((REPO / "examples" / f"tiny-{family}.yaml").read_text())
    data["model"] = str(root / family)
    stage_names = {str(stage["stageId"]): stage["name"] for stage in data["stages"]}
    with (
        tempfile.TemporaryDirectory(prefix="bench-family-serve-") as tmp,
        running([]) as processes,
    ):
        config = Path(tmp) / "pipeline.yaml"
        config.write_text(yaml.safe_dump(data))
        port = free_port()
        command = [
            sys.executable, "-m", "omni_runtime.entrypoints.cli", "serve", "-f", str(config),
            "--host", "127.0.0.1", "--port", str(port), "--log-dir", tmp,
        ]  # fmt: skip
        processes.append(ManagedProcess("serve", command, Path(tmp) / "serve.log"))
        base = f"http://127.0.0.1:{port}"
        ready_s = wait_http_ok(f"{base}/health", STARTUP_TIMEOUT_S, processes)
        print(f"serve: ready in {ready_s:.1f} s", file=sys.stderr, flush=True)
        pipeline = monolithic(family, root)
        engine = engine_sender(family, root, embeddings(family, pipeline), args)
        served, here = psutil.Process(processes[0].proc.pid), psutil.Process()

        def own_cpu(role: str) -> dict[str, float]:
            times = here.cpu_times()
            return {f"cpu {role}": times.user + times.system}

        async def run() -> list[Side]:
            client = AsyncOpenAI(
                base_url=f"{base}/v1",
                api_key="unused",
                max_retries=0,
                timeout=REQUEST_TIMEOUT_S,
            )
            try:
                with httpx.Client(base_url=base) as metrics:
                    model = (await client.models.list()).data[0].id
                    serve = Side("serve", serve_sender(client, model, args), args.concurrency)
                    serve.probe = Phased(
                        lambda: (
                            router_metrics(metrics)
                            | cpu_seconds(served, stage_names)
                            | own_cpu("this process: openai client")
                        )
                    )
                    mono = Side("monolithic", monolithic_sender(pipeline, args), 1)
                    mono.probe = Phased(lambda: own_cpu("this process: the pipeline"))
                    dit = Side("DiT engine alone, in-process", engine, 1)
                    dit.probe = Phased(lambda: own_cpu("this process: DiffusionEngine"))
                    sides = [serve, mono, dit]
                    await run_rounds(sides, args)
                    return sides
            finally:
                await client.close()

        sides = asyncio.run(run())
    per_phase = {"c1": args.requests * args.rounds, "batch": args.batch * args.rounds}
    rows = [row for side in sides for row in split_rows(side.probe, side.name, per_phase)]
    return sides, rows


def cells(values: Sequence[float], scale: float = 1.0, digits: int = 1) -> list[str]:
    scaled = [value * scale for value in values]
    low, high = min(scaled), max(scaled)
    return [f"{statistics.median(scaled):.{digits}f}", f"{low:.{digits}f}-{high:.{digits}f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=["qwen-image", "z-image"], default="qwen-image")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=16, help="one at a time, per round")
    parser.add_argument("--batch", type=int, default=32, help="concurrent requests, per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", default="64x64", help="WIDTHxHEIGHT")
    args = parser.parse_args()
    exit_on_sigterm()
    sides, split = measure(args.family, tiny_root(), args)
    print(
        f"\n{args.family}: images.generate {args.size}, {args.steps} steps, negative prompt "
        f"(guidance on); {args.rounds} rounds after warm-up, the sides taking turns: "
        f"{args.requests} requests one at a time, then {args.batch} at concurrency "
        f"{args.concurrency} (in-process sides: one after another); median over rounds, "
        f"spread min-max; torch threads {torch.get_num_threads()} in this process\n"
    )
    rows: list[list[object]] = []
    for side in sides:
        rate = [args.batch / seconds for seconds in side.batch_s]
        rows.append([side.name, *cells(side.p50s, 1000), side.concurrency, *cells(rate, digits=2)])
    serve, mono = sides[0], sides[1]
    p50 = statistics.median(serve.p50s) / statistics.median(mono.p50s)
    speedup = statistics.median(mono.batch_s) / statistics.median(serve.batch_s)
    latency, throughput = ratio_cell(p50, LATENCY_TARGET, False), ratio_cell(speedup, 1, True)
    rows.append(["serve / monolithic", latency, "", "", throughput, ""])
    headers = ["system", "c1 p50 ms", "spread", "batch concurrency", "images/s", "spread"]
    print(markdown_table(headers, rows))
    print(
        "\nWhere the time goes, over the measured rounds: the router's /metrics (a stage's wall "
        "time runs from the router's send to its last output, queueing included), each "
        "process's CPU time per image\n"
    )
    print(markdown_table(["phase", "side", "what", "requests", "ms"], split))


if __name__ == "__main__":
    main()
