"""What CURVE costs on the router's hop to a stage: the same stage and router processes with
and without the pipeline's stage keys, on bench/router_vs_vllm.py's single setup (the tiny
chat model, one LLM stage, 16 greedy tokens per request, the official openai client).

Each system is `omni-runtime stage` plus `omni-runtime router --replicas` (what a pod runs),
one with OMNI_STAGE_KEYS_DIR set on both (CURVE, and the ZAP handler on the stage's
socket), one without. They run one at a time, each loaded by a closed loop at every
`--concurrency` for `--warmup` s and then `--duration` s measured. Prints a markdown table:
p50/p99 latency and throughput per concurrency, and the ratio CURVE over plain.

    .venv/bin/python bench/stage_auth_overhead.py [--duration 20] [--warmup 5]
        [--concurrency 1,32] [--models-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _load import (
    ManagedProcess,
    exit_on_sigterm,
    free_port,
    markdown_table,
    ms,
    running,
    wait_http_ok,
)
from omni_runtime.config.credentials import KEYS_DIR_ENV
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR
from omni_runtime.stage_keys import generate_keys
from omni_runtime.tiny_models import LLM_SUBDIR, ensure_tiny_models
from router_vs_vllm import (
    STARTUP_TIMEOUT_S,
    SystemRun,
    drive,
    vllm_env,
    write_pipeline,
)

CLI = [sys.executable, "-m", "omni_runtime.entrypoints.cli"]


def start_pair(
    pipeline: Path, logs: Path, keys: Path | None, processes: list[ManagedProcess]
) -> str:
    """A stage process and a router over it (with ``keys`` on both, or none); the base URL."""
    label = "curve" if keys is not None else "plain"
    env = vllm_env()
    if keys is not None:
        env[KEYS_DIR_ENV] = str(keys)
    ready = logs / f"stage-{label}.ready"
    stage = [
        *CLI, "stage", "-f", str(pipeline), "--stages", "0",
        "--host", "127.0.0.1", "--port", "0=0", "--health-port", "none",
        "--ready-file", str(ready),
    ]  # fmt: skip
    processes.append(ManagedProcess(f"stage-{label}", stage, logs / f"stage-{label}.log", env))
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not ready.exists():
        processes[-1].check_alive()
        if time.monotonic() > deadline:
            raise SystemExit(f"stage-{label} not ready in {STARTUP_TIMEOUT_S} s")
        time.sleep(0.2)
    stage_port = json.loads(ready.read_text())["stages"]["0"]
    port = free_port()
    router = [
        *CLI, "router", "-f", str(pipeline), "--host", "127.0.0.1", "--port", str(port),
        "--replicas", f"0=127.0.0.1:{stage_port}",
    ]  # fmt: skip
    processes.append(ManagedProcess(f"router-{label}", router, logs / f"router-{label}.log", env))
    wait_http_ok(f"http://127.0.0.1:{port}/health", STARTUP_TIMEOUT_S, processes)
    return f"http://127.0.0.1:{port}/v1"


def measure(
    label: str, start: Callable[[list[ManagedProcess]], str], args: argparse.Namespace
) -> SystemRun:
    run = SystemRun("single", label)
    processes: list[ManagedProcess] = []
    with running(processes):
        began = time.monotonic()
        base_url = start(processes)
        run.startup_s = time.monotonic() - began
        asyncio.run(drive(base_url, run, args))
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32]
    )
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    args = parser.parse_args()
    exit_on_sigterm()
    model = ensure_tiny_models(args.models_dir) / LLM_SUBDIR
    with tempfile.TemporaryDirectory(prefix="omni-bench-curve-") as tmp:
        logs = Path(tmp)
        pipeline = write_pipeline(model, 1, logs)
        keys = generate_keys(logs / "keys")
        runs = [
            measure("plain", lambda p: start_pair(pipeline, logs, None, p), args),
            measure("CURVE", lambda p: start_pair(pipeline, logs, keys, p), args),
        ]
    plain, curve = runs
    rows = []
    for concurrency in args.concurrency:
        a, b = plain.loads[concurrency], curve.loads[concurrency]
        rows.append(
            [
                concurrency,
                ms(a.percentile(50)),
                ms(b.percentile(50)),
                f"{b.percentile(50) / a.percentile(50):.3f}",
                ms(a.percentile(99)),
                ms(b.percentile(99)),
                f"{a.throughput:.1f}",
                f"{b.throughput:.1f}",
                f"{b.throughput / a.throughput:.3f}",
            ]
        )
    print(
        markdown_table(
            [
                "concurrency",
                "p50 plain (ms)",
                "p50 CURVE (ms)",
                "p50 ratio",
                "p99 plain (ms)",
                "p99 CURVE (ms)",
                "req/s plain",
                "req/s CURVE",
                "req/s ratio",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
