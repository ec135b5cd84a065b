"""Our router (`omni-runtime serve`) against vLLM's own OpenAI server, same model, same load.

Side by side in one run, on the tiny chat model (`omni-runtime make-tiny-models`):

- single: vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`, the
  `vllm serve` console script fails with the CPU build) against `omni-runtime serve` of a
  one-stage pipeline (LLM, float32, eager, max model len 512, served as `tiny`).
- two replicas: `vllm-router` (round robin; installed with pip into a venv of its own,
  `--vllm-router-venv`, never into .venv) in front of two vLLM servers, against
  `omni-runtime serve` of the same pipeline with `replicas: 2` (round robin).

Every system answers the same chat requests from the official `openai` client
(AsyncOpenAI, no retries): 16 greedy tokens (`max_tokens=16, temperature=0`; our router
refuses vLLM's `ignore_eos` like any unknown field, so both get only standard fields and
each answer's `usage.completion_tokens` is checked to be 16). A closed loop runs at each
`--concurrency` for `--warmup` s, then `--duration` s measured: p50 and p99 latency of the
requests sent in the window and throughput (requests finished in it per second). Systems
run one at a time (never two on the 2 cores at once); startup is the time from launch to
`GET /health` answering 200 (and, for vllm-router, its workers' too). Ratios are ours over
vLLM's; targets: latency <= 1.05x, throughput >= 0.95x. Prints one markdown table;
`--json` prints the figures as JSON.

    .venv/bin/python bench/router_vs_vllm.py [--duration 20] [--warmup 5]
        [--concurrency 1,8,32] [--skip-two-replicas] [--models-dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from _load import (
    LoadResult,
    ManagedProcess,
    ServerStartError,
    closed_loop,
    exit_on_sigterm,
    free_port,
    markdown_table,
    ms,
    ratio_cell,
    running,
    wait_http_ok,
)
from omni_runtime.entrypoints.cli import DEFAULT_CACHE_DIR, DEFAULT_MODELS_DIR
from omni_runtime.tiny_models import LLM_SUBDIR, ensure_tiny_models

SERVED_NAME = "tiny"
MAX_TOKENS = 16
MAX_MODEL_LEN = 512
LATENCY_TARGET = 1.05
THROUGHPUT_TARGET = 0.95
STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 120.0
VLLM_ROUTER_PIN = "vllm-router==0.1.17"
# Varied a little so that no system gains from serving one identical prompt; request i
# uses PROMPTS[i % len(PROMPTS)] on every system.
PROMPTS = [
    "draw a red cat in a garden",
    "paint a blue river under the moon",
    "a portrait of a dog wearing a hat",
    "write a short poem about the sea",
]


@dataclass
class SystemRun:
    """One system of one setup: how it started and what each concurrency gave."""

    setup: str
    system: str
    startup_s: float = math.nan
    loads: dict[int, LoadResult] = field(default_factory=dict)
    # Completion tokens and text of one request per prompt, sent before the load.
    check_tokens: list[int] = field(default_factory=list)
    check_texts: list[str] = field(default_factory=list)
    error: str | None = None


# -- the systems ------------------------------------------------------------------------------


def vllm_env() -> dict[str, str]:
    env = dict(os.environ)
    # vLLM's CPU build sizes its KV cache from this (GiB); unset, it refuses to start.
    # `serve` sets the same 1 GiB for its LLM stages, so both sides get the same cache.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def start_vllm(model: Path, logs: Path, label: str) -> tuple[ManagedProcess, int]:
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--served-model-name", SERVED_NAME,
        "--enforce-eager",
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--host", "127.0.0.1",
        "--port", str(port),
        # Per-request access lines and engine statistics cost the baseline CPU time that
        # our router and stages do not spend: off, the baseline is at its fastest.
        "--disable-uvicorn-access-log",
        "--disable-log-stats",
    ]  # fmt: skip
    return ManagedProcess(label, command, logs / f"{label}.log", env=vllm_env()), port


def start_vllm_single(model: Path, logs: Path, processes: list[ManagedProcess]) -> str:
    process, port = start_vllm(model, logs, "vllm")
    processes.append(process)
    wait_http_ok(f"http://127.0.0.1:{port}/health", STARTUP_TIMEOUT_S, processes)
    return f"http://127.0.0.1:{port}/v1"


def start_vllm_router(
    model: Path, logs: Path, router_bin: Path, processes: list[ManagedProcess]
) -> str:
    # Both workers start at once, as serve starts its two replicas.
    ports = []
    for index in range(2):
        process, port = start_vllm(model, logs, f"vllm-{index}")
        processes.append(process)
        ports.append(port)
    for port in ports:
        wait_http_ok(f"http://127.0.0.1:{port}/health", STARTUP_TIMEOUT_S, processes)
    port = free_port()
    command = [
        str(router_bin),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", *(f"http://127.0.0.1:{p}" for p in ports),
        "--policy", "round_robin",
        # Its default would bind a fixed port (29000) on every address.
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(free_port()),
        # The workers are up already; the default check interval is 30 s.
        "--worker-startup-check-interval", "1",
        "--log-level", "warning",
    ]  # fmt: skip
    processes.append(ManagedProcess("vllm-router", command, logs / "vllm-router.log"))
    wait_http_ok(f"http://127.0.0.1:{port}/health", STARTUP_TIMEOUT_S, processes)
    return f"http://127.0.0.1:{port}/v1"


def write_pipeline(model: Path, replicas: int, directory: Path) -> Path:
    pipeline = {
        "model": str(model),
        "stages": [
            {
                "stageId": 0,
                "name": "chat",
                "type": "llm",
                "dtype": "float32",
                "enforceEager": True,
                "maxModelLen": MAX_MODEL_LEN,
                "replicas": replicas,
            }
        ],
        "router": {"servedModelName": SERVED_NAME, "policy": "round-robin"},
    }
    path = directory / f"chat-{replicas}.yaml"
    path.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    return path


def start_serve(model: Path, replicas: int, logs: Path, processes: list[ManagedProcess]) -> str:
    pipeline_file = write_pipeline(model, replicas, logs)
    port = free_port()
    stage_logs = logs / f"serve-{replicas}"
    command = [
        sys.executable, "-m", "omni_runtime.entrypoints.cli", "serve",
        "-f", str(pipeline_file),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--log-dir", str(stage_logs),
    ]  # fmt: skip
    processes.append(
        ManagedProcess(f"serve-{replicas}", command, logs / f"serve-{replicas}.log", vllm_env())
    )
    wait_http_ok(f"http://127.0.0.1:{port}/health", STARTUP_TIMEOUT_S, processes)
    return f"http://127.0.0.1:{port}/v1"


def vllm_router_binary(venv: Path) -> Path:
    """vllm-router's launcher in ``venv``, installed there first if missing.

    A venv of its own: its dependencies (fastapi, uvicorn, aiohttp...) must not move the
    project's pins. RuntimeError with pip's or the launcher's own words if it cannot be had.
    """
    launcher = venv / "bin" / "vllm-router"
    if not launcher.exists():
        print(f"installing {VLLM_ROUTER_PIN} into {venv} ...", file=sys.stderr, flush=True)
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", VLLM_ROUTER_PIN],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
                raise RuntimeError(f"`{' '.join(step)}` failed ({done.returncode}):\n{tail}")
    # The Rust router ships as a compiled extension; --help loads it, so a wheel that
    # does not run on this machine fails here rather than mid-benchmark.
    done = subprocess.run(
        [str(launcher), "--help"], capture_output=True, text=True, check=False, timeout=60
    )
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"`{launcher} --help` failed ({done.returncode}):\n{tail}")
    return launcher


# -- the load ---------------------------------------------------------------------------------


def chat_messages(index: int) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}]


async def drive(base_url: str, run: SystemRun, args: argparse.Namespace) -> None:
    client = AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )

    async def send(index: int) -> int:
        reply = await client.chat.completions.create(
            model=SERVED_NAME,
            messages=chat_messages(index),
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        return reply.usage.completion_tokens if reply.usage is not None else -1

    try:
        for index in range(len(PROMPTS)):
            reply = await client.chat.completions.create(
                model=SERVED_NAME,
                messages=chat_messages(index),
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            run.check_tokens.append(reply.usage.completion_tokens if reply.usage else -1)
            run.check_texts.append(reply.choices[0].message.content or "")
        for concurrency in args.concurrency:
            run.loads[concurrency] = await closed_loop(
                send, concurrency, args.warmup, args.duration
            )
            load = run.loads[concurrency]
            print(
                f"  {run.setup} / {run.system}, concurrency {concurrency}: "
                f"{load.throughput:.1f} req/s, p50 {ms(load.percentile(50))} ms, "
                f"p99 {ms(load.percentile(99))} ms, {load.errors} errors",
                file=sys.stderr,
                flush=True,
            )
    finally:
        await client.close()


def measure(
    setup: str,
    system: str,
    start: Callable[[list[ManagedProcess]], str],
    args: argparse.Namespace,
) -> SystemRun:
    """Start one system, load it at each concurrency, stop it (whatever happens)."""
    run = SystemRun(setup, system)
    print(f"{setup} / {system}: starting", file=sys.stderr, flush=True)
    processes: list[ManagedProcess] = []
    with running(processes):
        began = time.monotonic()
        try:
            base_url = start(processes)
        except ServerStartError as e:
            run.error = f"did not start: {e}"
            return run
        run.startup_s = time.monotonic() - began
        print(f"  ready in {run.startup_s:.1f} s", file=sys.stderr, flush=True)
        try:
            asyncio.run(drive(base_url, run, args))
        except Exception as e:  # the other systems are still worth measuring
            run.error = f"failed: {type(e).__name__}: {e}"
    return run


# -- the report -------------------------------------------------------------------------------


def tokens_cell(load: LoadResult) -> str:
    counts = [t for t in load.tags if isinstance(t, int)]
    if not counts:
        return "-"
    low, high = min(counts), max(counts)
    return str(low) if low == high else f"{low}-{high}"


def table(runs: list[SystemRun], concurrencies: list[int]) -> str:
    headers = [
        "setup", "system", "startup s", "conc", "req/s", "p50 ms", "p99 ms", "errors",
        "tokens", "req/s ours/vLLM", "p50 ours/vLLM", "p99 ours/vLLM",
    ]  # fmt: skip
    rows: list[list[object]] = []
    baselines = {run.setup: run for run in runs if run.system != "ours"}
    for run in runs:
        startup = "-" if math.isnan(run.startup_s) else f"{run.startup_s:.1f}"
        if run.error is not None and not run.loads:
            rows.append([run.setup, run.system, startup, "-", "-", "-", "-", "-", "-", "", "", ""])
            continue
        base = baselines.get(run.setup) if run.system == "ours" else None
        for concurrency in concurrencies:
            load = run.loads.get(concurrency)
            if load is None:
                continue
            cells: list[object] = [
                run.setup, run.system, startup, concurrency, f"{load.throughput:.1f}",
                ms(load.percentile(50)), ms(load.percentile(99)), load.errors,
                tokens_cell(load),
            ]  # fmt: skip
            other = base.loads.get(concurrency) if base is not None else None
            if other is not None and other.throughput > 0:
                cells += [
                    ratio_cell(load.throughput / other.throughput, THROUGHPUT_TARGET, True),
                    ratio_cell(load.percentile(50) / other.percentile(50), LATENCY_TARGET, False),
                    ratio_cell(load.percentile(99) / other.percentile(99), LATENCY_TARGET, False),
                ]
            else:
                cells += ["", "", ""]
            rows.append(cells)
    return markdown_table(headers, rows)


def notes(runs: list[SystemRun], skipped: dict[str, str]) -> list[str]:
    lines = []
    for run in runs:
        if run.error is not None:
            lines.append(f"{run.setup} / {run.system}: {run.error}")
        if run.check_tokens and any(t != MAX_TOKENS for t in run.check_tokens):
            lines.append(
                f"{run.setup} / {run.system}: completion tokens per prompt {run.check_tokens}, "
                f"not all {MAX_TOKENS} (an early end of sequence): latencies are not comparable"
            )
        for load in run.loads.values():
            if load.first_error is not None:
                lines.append(
                    f"{run.setup} / {run.system}, concurrency {load.concurrency}: first error: "
                    f"{load.first_error}"
                )
    for setup, reason in skipped.items():
        lines.append(f"{setup}: {reason}")
    by_setup: dict[str, list[SystemRun]] = {}
    for run in runs:
        by_setup.setdefault(run.setup, []).append(run)
    for setup, pair in by_setup.items():
        texts = [run.check_texts for run in pair if run.check_texts]
        if len(texts) == 2:
            same = texts[0] == texts[1]
            lines.append(
                f"{setup}: greedy answers {'identical' if same else 'DIFFER'} across systems"
            )
    return lines


def figures(runs: list[SystemRun], skipped: dict[str, str]) -> dict[str, Any]:
    return {
        "runs": [
            {
                "setup": run.setup,
                "system": run.system,
                "startup_s": None if math.isnan(run.startup_s) else run.startup_s,
                "error": run.error,
                "check_completion_tokens": run.check_tokens,
                "loads": [
                    {
                        "concurrency": load.concurrency,
                        "requests": len(load.latencies),
                        "throughput_rps": load.throughput,
                        "p50_s": load.percentile(50),
                        "p99_s": load.percentile(99),
                        "errors": load.errors,
                        "first_error": load.first_error,
                    }
                    for load in run.loads.values()
                ],
            }
            for run in runs
        ],
        "skipped": skipped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=20.0, help="measured s per level")
    parser.add_argument("--warmup", type=float, default=5.0, help="unmeasured s before each")
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(part) for part in text.split(",")],
        default=[1, 8, 32],
        help="comma-separated closed-loop concurrencies (default 1,8,32)",
    )
    parser.add_argument("--skip-two-replicas", action="store_true")
    parser.add_argument(
        "--models-dir", type=Path, default=DEFAULT_MODELS_DIR, help="tiny models (built if absent)"
    )
    parser.add_argument(
        "--vllm-router-venv",
        type=Path,
        default=DEFAULT_CACHE_DIR / "bench-venv",
        help=f"venv holding {VLLM_ROUTER_PIN} (created with pip if absent)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    exit_on_sigterm()
    model = ensure_tiny_models(args.models_dir) / LLM_SUBDIR
    runs: list[SystemRun] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-router-vs-vllm-") as tmp:
        logs = Path(tmp)
        runs.append(measure("single", "vLLM", lambda ps: start_vllm_single(model, logs, ps), args))
        runs.append(measure("single", "ours", lambda ps: start_serve(model, 1, logs, ps), args))
        if args.skip_two_replicas:
            skipped["two replicas"] = "skipped (--skip-two-replicas)"
        else:
            try:
                router_bin = vllm_router_binary(args.vllm_router_venv)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                skipped["two replicas / vllm-router"] = f"not measured: {e}"
            else:
                runs.append(
                    measure(
                        "two replicas",
                        "vllm-router",
                        lambda ps: start_vllm_router(model, logs, router_bin, ps),
                        args,
                    )
                )
            runs.append(
                measure("two replicas", "ours", lambda ps: start_serve(model, 2, logs, ps), args)
            )
    if args.json:
        print(json.dumps(figures(runs, skipped), indent=2))
        return
    print(
        f"\nchat completions of {MAX_TOKENS} greedy tokens, closed loop, {args.warmup:g} s "
        f"warm-up + {args.duration:g} s per level; targets: latency <= {LATENCY_TARGET}x, "
        f"throughput >= {THROUGHPUT_TARGET}x of vLLM\n"
    )
    print(table(runs, args.concurrency))
    for line in notes(runs, skipped):
        print(f"- {line}")


if __name__ == "__main__":
    main()
