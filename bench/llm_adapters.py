"""LoRA adapters on the LLM stage (vLLM CPU build, tiny Qwen2): what an adapter costs.

Through StageLLMFrontend, as a stage server drives it, on the tiny chat LLM with the rank-8
PEFT adapters of ``omni_runtime.tiny_models.llm_lora``:

- the adapter's load: resolving its source and checking its files, then the engine's
  add_lora (the client's load log), for each adapter's first request;
- the first request's added latency: its latency minus the median of that adapter's later
  requests;
- steady state, sequential requests of ``--tokens`` greedy tokens (median of ``--repeat``):
  on an engine without LoRA, and on the LoRA engine without an adapter (which on vLLM's
  CPU build runs with the zero adapter, lora_needs_zero_adapter) and with each adapter;
- a mixed batch: ``--concurrency`` requests at once spread over no adapter and both
  adapters, against the same number without adapters, in generated tokens per second.

``--shape qwen2-0.5b`` runs it on a model of Qwen2-0.5B's shape instead (24 layers, hidden
896, MLP 4864; random weights, the tiny tokenizer, built once under
~/.cache/omni-operator/bench-models): the adapter's ops cost about the same per layer on
both, so the tiny model's microsecond matmuls overstate their share of a real step.

    .venv/bin/python bench/llm_adapters.py [--tokens 16] [--repeat 20] [--concurrency 6]
                                           [--shape tiny|qwen2-0.5b] [--compiled]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from omni_runtime.config import PipelineConfig, StageConfig
from omni_runtime.connectors import StageConnectors
from omni_runtime.engine.stage.stage_core_types import (
    StageAdapter,
    StageServerOutput,
    StageServerRequest,
)
from omni_runtime.engine.stage.stage_llm_core_client import start_stage_llm_client
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR
from omni_runtime.stage_server.llm_frontend import StageLLMFrontend
from omni_runtime.tiny_models import LLM_SUBDIR, ensure_tiny_models
from omni_runtime.tiny_models.llm_lora import ATTN_LORA, MLP_LORA, build_llm_loras

PROMPT = "draw a red cat in a garden"
BENCH_MODELS = Path.home() / ".cache" / "omni-operator" / "bench-models"


def qwen2_half_b_shaped(tiny_llm: Path) -> Path:
    """A Qwen2 of Qwen2-0.5B's layer shapes with random weights and the tiny LLM's
    tokenizer (its 384-token vocabulary keeps the LM head small), built once."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    path = BENCH_MODELS / "qwen2-0.5b-shaped"
    if (path / "config.json").exists():
        return path
    staging = path.with_name(path.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llm)
    tokenizer.save_pretrained(staging)
    config = Qwen2Config(
        vocab_size=AutoConfig.from_pretrained(tiny_llm).vocab_size,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(staging)
    staging.rename(path)
    return path


class Bench:
    def __init__(self, frontend: StageLLMFrontend, loras: dict[str, Path], tokens: int) -> None:
        self.frontend = frontend
        self.loras = loras
        self.tokens = tokens
        self._count = 0

    def request(self, adapter: str | None) -> StageServerRequest:
        self._count += 1
        chosen = None if adapter is None else StageAdapter(adapter, str(self.loras[adapter]))
        return StageServerRequest(
            request_id=f"bench-{self._count}",
            prompt=PROMPT,
            params={"max_tokens": self.tokens, "ignore_eos": True, "temperature": 0.0},
            stream=False,
            adapter=chosen,
        )

    async def run(self, adapters: list[str | None]) -> float:
        """Add one request per entry of ``adapters`` at once; seconds until all finished."""
        requests = [self.request(adapter) for adapter in adapters]
        start = time.perf_counter()
        refused = await asyncio.gather(*(self.frontend.add(r) for r in requests))
        assert refused == [[]] * len(requests), refused
        waiting = {r.request_id for r in requests}
        async with asyncio.timeout(120):
            while waiting:
                outputs: list[StageServerOutput] = await self.frontend.next_outputs()
                for output in outputs:
                    if output.finished:
                        assert output.error is None, output.error
                        assert output.completion_tokens == self.tokens
                        waiting.discard(output.request_id)
        return time.perf_counter() - start

    async def median(self, adapter: str | None, repeat: int) -> float:
        return statistics.median([await self.run([adapter]) for _ in range(repeat)])


def stage(**fields: Any) -> StageConfig:
    return StageConfig.model_validate(
        {
            "stageId": 0,
            "name": "chat",
            "type": "llm",
            "dtype": "float32",
            "maxModelLen": 512,
            **fields,
        }
    )


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    model = ensure_tiny_models(DEFAULT_MODELS_DIR) / LLM_SUBDIR
    if args.shape == "qwen2-0.5b":
        model = qwen2_half_b_shaped(model)
    figures: dict[str, Any] = {"tokens": args.tokens, "repeat": args.repeat}
    with tempfile.TemporaryDirectory(prefix="bench-loras-") as scratch:
        loras = build_llm_loras(Path(scratch), model)
        names = [ATTN_LORA, MLP_LORA]
        eager = {"enforceEager": not args.compiled}
        plain, lora_stage = stage(**eager), stage(maxLoras=2, **eager)
        declared = [{"name": n, "stage": "chat", "source": str(loras[n])} for n in names]
        concurrency = args.concurrency
        for label, config, adapters in (
            ("plain", plain, None),
            ("lora", lora_stage, declared),
        ):
            pipeline = PipelineConfig.model_validate(
                {"model": str(model), "stages": [config], "adapters": adapters}
            )
            capacity = pipeline.adapter_capacity(config)
            start = time.perf_counter()
            client = start_stage_llm_client(config, str(model), adapter_capacity=capacity)
            figures[f"{label}_startup_s"] = time.perf_counter() - start
            try:
                frontend = StageLLMFrontend(pipeline, config, client, StageConnectors({}))
                bench = Bench(frontend, loras, args.tokens)
                await bench.run([None])  # warm-up
                if label == "plain":
                    figures["plain_median_s"] = await bench.median(None, args.repeat)
                    mixed = await bench.run([None] * concurrency)
                    figures["plain_concurrent_tok_s"] = concurrency * args.tokens / mixed
                    continue
                for name in names:
                    figures[f"{name}_first_s"] = await bench.run([name])
                    figures[f"{name}_median_s"] = await bench.median(name, args.repeat)
                    figures[f"{name}_first_added_s"] = (
                        figures[f"{name}_first_s"] - figures[f"{name}_median_s"]
                    )
                figures["base_median_s"] = await bench.median(None, args.repeat)
                cycle: list[str | None] = [None, *names]
                spread = [cycle[i % len(cycle)] for i in range(concurrency)]
                mixed = await bench.run(spread)
                figures["lora_concurrent_tok_s"] = concurrency * args.tokens / mixed
                figures["loads"] = [
                    {
                        "name": load.name,
                        "resolve_s": load.resolve_seconds,
                        "add_lora_s": load.add_lora_seconds,
                    }
                    for load in client.adapter_load_log
                ]
                figures["zero_adapter"] = client.base_lora is not None
            finally:
                client.shutdown()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument(
        "--compiled", action="store_true", help="vLLM's torch.compile'd model, not eager"
    )
    parser.add_argument("--shape", choices=("tiny", "qwen2-0.5b"), default="tiny")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # vLLM's CPU build sizes its KV cache from this (GiB); unset, it refuses to start.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    figures = asyncio.run(measure(args))
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    ms = 1000.0
    print(f"model: {args.shape}, {'compiled' if args.compiled else 'eager'}")
    print(
        f"engine start: {figures['plain_startup_s']:.1f} s without LoRA, "
        f"{figures['lora_startup_s']:.1f} s with (maxLoras 2)"
    )
    print(f"\nadapter load (first request of each; zero adapter: {figures['zero_adapter']})")
    print(f"{'adapter':<10}{'resolve+check ms':>18}{'add_lora ms':>14}")
    for load in figures["loads"]:
        print(f"{load['name']:<10}{load['resolve_s'] * ms:>18.1f}{load['add_lora_s'] * ms:>14.1f}")
    print(f"\nrequest latency, {figures['tokens']} tokens, median of {figures['repeat']}")
    print(f"{'request':<34}{'median ms':>11}{'first ms':>10}{'added ms':>10}")
    print(f"{'no adapter, engine without LoRA':<34}{figures['plain_median_s'] * ms:>11.1f}")
    print(f"{'no adapter, LoRA engine':<34}{figures['base_median_s'] * ms:>11.1f}")
    for name in (ATTN_LORA, MLP_LORA):
        median, first = figures[f"{name}_median_s"], figures[f"{name}_first_s"]
        added = figures[f"{name}_first_added_s"]
        print(f"{'adapter ' + name:<34}{median * ms:>11.1f}{first * ms:>10.1f}{added * ms:>10.1f}")
    print(f"\n{args.concurrency} concurrent requests, generated tokens/s")
    print(f"{'without LoRA, no adapters':<34}{figures['plain_concurrent_tok_s']:>11.1f}")
    print(f"{'LoRA engine, none/attn/mlp mixed':<34}{figures['lora_concurrent_tok_s']:>11.1f}")


if __name__ == "__main__":
    main()
