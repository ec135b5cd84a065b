"""Latency and memory of the LLM stage (client -> StageLLMCoreProc over ZMQ, vLLM CPU build).

Measures, on the tiny Qwen2 model built from configs: the stage's start time (config,
core process, model, KV cache, handshake), the latency of sequential requests (the first
reported apart as warm-up) and the peak RSS of the whole process tree (this client, the
core processes, and for data parallelism the DP coordinator), sampled every 20 ms. Prints
a table; `--json` prints the figures as JSON.

    .venv/bin/python bench/llm_latency.py [--tokens 16] [--repeat 20]
        [--output text|hidden_states] [--data-parallel-size 2] [--no-enforce-eager]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time

import psutil

from _load import collect_results
from omni_runtime.config import StageConfig
from omni_runtime.engine.stage.stage_llm_core_client import start_stage_llm_client
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR
from omni_runtime.tiny_models import LLM_SUBDIR, ensure_tiny_models


class TreeRSSPeak:
    """The largest summed RSS of this process and its descendants seen while running."""

    def __init__(self, period_s: float = 0.02) -> None:
        self.peak = 0
        self.processes = 0
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> TreeRSSPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(self._period_s):
            total, count = 0, 0
            for proc in [me, *me.children(recursive=True)]:
                try:
                    total += proc.memory_info().rss
                    count += 1
                except psutil.NoSuchProcess:
                    pass
            if total > self.peak:
                self.peak, self.processes = total, count


async def measure(args: argparse.Namespace) -> dict[str, object]:
    model = str(ensure_tiny_models(DEFAULT_MODELS_DIR) / LLM_SUBDIR)
    stage = StageConfig.model_validate(
        {
            "stageId": 0,
            "type": "llm",
            "output": args.output,
            "dtype": "float32",
            "maxModelLen": 512,
            "enforceEager": args.enforce_eager,
            "dataParallelSize": args.data_parallel_size,
        }
    )
    encodes = args.output == "hidden_states"
    params = {} if encodes else {"max_tokens": args.tokens, "ignore_eos": True, "temperature": 0}
    with TreeRSSPeak() as rss:
        start = time.perf_counter()
        client = start_stage_llm_client(stage, model)
        figures: dict[str, object] = {
            "output": args.output,
            "data_parallel_size": args.data_parallel_size,
            "enforce_eager": args.enforce_eager,
            "startup_s": time.perf_counter() - start,
            "tokens": 0 if encodes else args.tokens,
        }
        try:
            latencies = []
            for i in range(args.repeat + 1):
                request_id = f"bench-{i}"
                t0 = time.perf_counter()
                request = client.request_builder.build(
                    request_id, prompt="draw a red cat in a garden", params=params
                )
                await client.add_request_async(request)
                result = (await collect_results(client, [request_id], timeout=60))[request_id]
                latencies.append(time.perf_counter() - t0)
                assert result.error is None, result.error
                assert encodes or len(result.token_ids) == args.tokens
        finally:
            client.shutdown()
    figures.update(
        first_s=latencies[0],
        median_s=statistics.median(latencies[1:]),
        min_s=min(latencies[1:]),
        max_s=max(latencies[1:]),
        peak_tree_rss_gib=rss.peak / 2**30,
        processes_at_peak=rss.processes,
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--output", choices=["text", "hidden_states"], default="text")
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument(
        "--no-enforce-eager",
        dest="enforce_eager",
        action="store_false",
        help="let vLLM compile the model (slower start)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # vLLM's CPU build sizes its KV cache from this (GiB); unset, it refuses to start.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    figures = asyncio.run(measure(args))
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    what = "hidden states" if args.output == "hidden_states" else f"{args.tokens} tokens"
    print(
        f"stage start: {figures['startup_s']:.2f} s (data parallel {args.data_parallel_size}, "
        f"enforce_eager {args.enforce_eager})"
    )
    print(
        f"request ({what}): first {figures['first_s'] * 1000:.1f} ms, median "
        f"{figures['median_s'] * 1000:.1f} ms (min {figures['min_s'] * 1000:.1f}, max "
        f"{figures['max_s'] * 1000:.1f}) over {args.repeat}"
    )
    print(
        f"peak RSS of the process tree: {figures['peak_tree_rss_gib']:.2f} GiB "
        f"({figures['processes_at_peak']} processes)"
    )


if __name__ == "__main__":
    main()
