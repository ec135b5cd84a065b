"""What CURVE costs on the router's hop to a stage: the same stage and router processes with
and without the pipeline's stage keys, on bench/router_vs_vllm.py's single setup (the tiny
chat model, one LLM stage, 16 greedy tokens per request, the official openai client).

Each system is `omni-runtime stage` plus `omni-runtime router --replicas` (what a pod runs),
one with OMNI_STAGE_KEYS_DIR set on both (CURVE, and the ZAP handler on the stage's
socket), one without. They run one at a time, `--rounds` times each in ABBA order, each
loaded by a closed loop at every `--concurrency` for `--warmup` s and then `--duration` s
measured. Prints a markdown table:
p50/p99 latency and throughput per concurrency (means over the rounds), and the ratio
CURVE over plain.

    .venv/bin/python bench/stage_auth_overhead.py [--duration 20] [--warmup 5]
        [--concurrency 1,32] [--rounds 2] [--models-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from _load import (
    LoadResult,
    ManagedProcess,
    closed_loop,
    exit_on_sigterm,
    free_port,
    markdown_table,
    ms,
    running,
    wait_http_ok,
)
from omni_runtime.config import PipelineConfig
from omni_runtime.config.credentials import KEYS_DIR_ENV
from omni_runtime.engine.stage.stage_core_types import StageServerOutput, StageServerRequest
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR
from omni_runtime.router.remote_stage_client import RemoteStageClient
from omni_runtime.stage_keys import generate_keys, load_client_keys, load_server_keys
from omni_runtime.stage_server.frontend import StageFrontend
from omni_runtime.stage_server.server import StageServer
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
    ready = logs / f"stage-{label}-{time.monotonic_ns()}.ready"
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


class _Echo(StageFrontend):
    """A stage that finishes each request at once: only the hop is measured."""

    def __init__(self, pipeline: PipelineConfig) -> None:
        self.pipeline = pipeline
        self.stage = pipeline.stages[0]
        self._outputs: asyncio.Queue[StageServerOutput] = asyncio.Queue()

    async def add(self, request: StageServerRequest) -> list[StageServerOutput]:
        self._outputs.put_nowait(StageServerOutput(request.request_id, finished=True))
        return []

    async def next_outputs(self) -> list[StageServerOutput]:
        return [await self._outputs.get()]

    async def abort(self, request_ids: list[str]) -> None:
        return None

    @property
    def in_flight(self) -> int:
        return self._outputs.qsize()

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


async def hop(keys: Path | None, concurrency: int, image_bytes: int, seconds: float) -> LoadResult:
    """Round trips router -> stage server -> router of requests carrying ``image_bytes``
    of image, over real sockets on loopback, with or without CURVE."""
    pipeline = PipelineConfig.model_validate(
        {"model": "m", "stages": [{"stage_id": 0, "type": "llm"}]}
    )
    server_keys = load_server_keys(keys) if keys is not None else None
    server = StageServer(_Echo(pipeline), host="127.0.0.1", keys=server_keys)
    serving = asyncio.create_task(server.serve())
    client = RemoteStageClient(
        f"127.0.0.1:{server.port}", keys=load_client_keys(keys) if keys is not None else None
    )
    side = max(1, int((image_bytes / 3) ** 0.5))
    images = [np.zeros((side, side, 3), np.uint8)] if image_bytes else []
    waiting: dict[str, asyncio.Future[None]] = {}
    ids = itertools.count()

    async def read() -> None:
        while True:
            for output in (await client.get_outputs_async()).outputs:
                waiting.pop(output.request_id).set_result(None)

    async def send(_: int) -> int:
        request_id = f"r{next(ids)}"
        done = asyncio.get_running_loop().create_future()
        waiting[request_id] = done
        await client.add_request_async(StageServerRequest(request_id, prompt="x", images=images))
        await done
        return 0

    try:
        await client.wait_ready(10)
        reader = asyncio.create_task(read())
        load = await closed_loop(send, concurrency, 1.0, seconds)
        reader.cancel()
        return load
    finally:
        client.shutdown()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        server.close()


def hop_table(keys: Path, args: argparse.Namespace) -> str:
    rows = []
    for image_bytes in (0, 1 << 20):
        for concurrency in args.concurrency:
            # Alternating, as the end-to-end runs do.
            plain = asyncio.run(hop(None, concurrency, image_bytes, args.hop_seconds))
            curve = asyncio.run(hop(keys, concurrency, image_bytes, args.hop_seconds))
            rows.append(
                [
                    "1 MiB image" if image_bytes else "text only",
                    concurrency,
                    f"{plain.percentile(50) * 1e6:.0f}",
                    f"{curve.percentile(50) * 1e6:.0f}",
                    f"{plain.throughput:.0f}",
                    f"{curve.throughput:.0f}",
                    f"{curve.throughput / plain.throughput:.3f}",
                ]
            )
    return markdown_table(
        [
            "request",
            "concurrency",
            "p50 plain (us)",
            "p50 CURVE (us)",
            "req/s plain",
            "req/s CURVE",
            "req/s ratio",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32]
    )
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    parser.add_argument("--rounds", type=int, default=2, help="each system this many times")
    parser.add_argument("--hop-seconds", type=float, default=5.0, help="per hop-alone level")
    parser.add_argument("--hop-only", action="store_true", help="skip the end-to-end runs")
    args = parser.parse_args()
    exit_on_sigterm()
    model = ensure_tiny_models(args.models_dir) / LLM_SUBDIR
    with tempfile.TemporaryDirectory(prefix="omni-bench-curve-") as tmp:
        print("The hop alone (a stage that answers at once):\n")
        print(hop_table(generate_keys(Path(tmp) / "hop-keys"), args), flush=True)
    if args.hop_only:
        return
    with tempfile.TemporaryDirectory(prefix="omni-bench-curve-") as tmp:
        logs = Path(tmp)
        pipeline = write_pipeline(model, 1, logs)
        keys = generate_keys(logs / "keys")
        systems = {"plain": None, "CURVE": keys}
        # ABBA...: what runs first or second (a warmer machine) favours neither side.
        order = [
            ("plain", "CURVE") if r % 2 == 0 else ("CURVE", "plain") for r in range(args.rounds)
        ]
        runs: dict[str, list[SystemRun]] = {"plain": [], "CURVE": []}
        for pair in order:
            for label in pair:
                runs[label].append(
                    measure(
                        label,
                        lambda p, k=systems[label]: start_pair(pipeline, logs, k, p),
                        args,
                    )
                )

    def mean(label: str, concurrency: int, of: Callable[[LoadResult], float]) -> float:
        values = [of(run.loads[concurrency]) for run in runs[label]]
        return sum(values) / len(values)

    rows = []
    for concurrency in args.concurrency:
        p50 = [mean(label, concurrency, lambda load: load.percentile(50)) for label in runs]
        p99 = [mean(label, concurrency, lambda load: load.percentile(99)) for label in runs]
        rate = [mean(label, concurrency, lambda load: load.throughput) for label in runs]
        rows.append(
            [
                concurrency,
                ms(p50[0]),
                ms(p50[1]),
                f"{p50[1] / p50[0]:.3f}",
                ms(p99[0]),
                ms(p99[1]),
                f"{rate[0]:.1f}",
                f"{rate[1]:.1f}",
                f"{rate[1] / rate[0]:.3f}",
            ]
        )
    print("\nEnd to end (the tiny chat model, 16 tokens):\n")
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
