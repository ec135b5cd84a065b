"""LoRA adapters on a DiT: what loading one costs and what running with one costs, on the
tiny Z-Image DiT with its tiny adapters (tiny_models.dit_lora), in this process.

- read: resolving the source and reading the file (the pipeline class's lora_state_dict,
  and the checks against the DiT's modules), which the engine does on a thread of its own;
- inject: putting a read adapter into the transformer and activating it (the engine's
  thread, between batches), evicting the least recently used one first;
- first request: how much longer a request takes whose adapter is not loaded yet (its read
  and injection, done in line here) than one whose adapter is;
- per image, median of N, one request at a time: no adapter ever loaded; with an adapter;
  with one loaded but the request using none (PEFT's layers wrap the modules, switched off);
  and a request that switches (none after an adapter, an adapter after none). Measured
  interleaved, round by round, on one torch thread each, so that other load on the
  machine weighs on every kind alike.

    .venv/bin/python bench/dit_adapters.py [--runs 8] [--steps 4] [--size 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from itertools import count
from pathlib import Path

from _load import markdown_table, ms
from omni_runtime.diffusion.adapters import DiTAdapters, linear_modules, read_adapter
from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
from omni_runtime.engine.stage.stage_core_types import StageAdapter, StageDiffusionCoreRequest
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR
from omni_runtime.tiny_models import Z_IMAGE_SUBDIR, ensure_tiny_models
from omni_runtime.tiny_models.dit_lora import build_dit_loras

INK, NEON = "z-image-ink", "z-image-neon"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()

    checkpoint = ensure_tiny_models(DEFAULT_MODELS_DIR) / Z_IMAGE_SUBDIR
    folder = Path(tempfile.mkdtemp(prefix="dit-loras-"))
    loras = build_dit_loras(folder, checkpoint)

    # Two engines on one thread each: one that never loads an adapter, and one that does.
    # Their requests are measured interleaved, round by round, so that what else the
    # machine runs weighs on each kind alike.
    def new_engine(max_loras: int) -> DiffusionEngine:
        config = DiffusionEngineConfig(
            model=str(checkpoint), family="z-image", max_loras=max_loras, num_threads=1
        )
        return DiffusionEngine(config)

    plain, engine = new_engine(0), new_engine(2)
    ids = count()

    def run(dit: DiffusionEngine, adapter: StageAdapter | None) -> float:
        n = next(ids)
        request = StageDiffusionCoreRequest(
            request_id=f"r{n}",
            prompt="a lighthouse at night",
            params={
                "num_inference_steps": args.steps,
                "height": args.size,
                "width": args.size,
                "seed": n,
                "negative_prompt": "blurry",
            },
            adapter=adapter,
        )
        dit.admit(request.request_id)
        start = time.perf_counter()
        output = dit.execute(request)
        elapsed = time.perf_counter() - start
        assert output.error is None, output.error
        return elapsed

    def adapter(name: str, as_name: str | None = None) -> StageAdapter:
        return StageAdapter(as_name or name, str(loras[name]))

    # Loading, apart from any request, on the plain engine's pipeline (whose own cache
    # stays empty: it takes none).
    pipeline = plain.pipeline
    modules = linear_modules(pipeline.transformer)
    reads = []
    for _ in range(args.runs):
        start = time.perf_counter()
        read_adapter(adapter(INK), type(pipeline), modules)
        reads.append(time.perf_counter() - start)
    cache = DiTAdapters(pipeline, capacity=1)
    injects = []
    for index in range(args.runs):
        # A new name each time: read, then injected (evicting the last one).
        chosen = adapter(INK, f"ink-{index}")
        deadline = time.monotonic() + 60
        while not cache.ready(chosen):
            assert time.monotonic() < deadline, "the read never ended"
            time.sleep(0.001)
        start = time.perf_counter()
        cache.activate(chosen)
        injects.append(time.perf_counter() - start)
    cache.activate(None)
    cache.close()
    # The plain engine's transformer now has (disabled) LoRA layers: a fresh one measures
    # the weights alone.
    plain.close()
    plain = new_engine(0)

    run(plain, None)  # warm up
    run(engine, None)
    first_s = run(engine, adapter(INK))
    kinds: dict[str, list[float]] = {
        "plain": [],
        "switch on": [],
        "with": [],
        "switch off": [],
        "loaded, none": [],
    }
    for _ in range(args.runs):
        kinds["plain"].append(run(plain, None))
        kinds["switch on"].append(run(engine, adapter(INK)))
        kinds["with"].append(run(engine, adapter(INK)))
        kinds["switch off"].append(run(engine, None))
        kinds["loaded, none"].append(run(engine, None))
    medians = {kind: statistics.median(times) for kind, times in kinds.items()}
    plain.close()
    engine.close()

    print(
        f"tiny Z-Image DiT, {args.size}x{args.size}, {args.steps} steps, "
        f"median of {args.runs}, one request at a time, 1 torch thread\n"
    )
    rows = [
        ("adapter read (resolve + read + check)", ms(statistics.median(reads))),
        ("adapter inject (+ evict one, activate)", ms(statistics.median(injects))),
        ("first request's added latency (read + inject in line)", ms(first_s - medians["with"])),
        ("per image, no adapter ever loaded", ms(medians["plain"])),
        ("per image, with an adapter", ms(medians["with"])),
        ("per image, adapter loaded, request uses none", ms(medians["loaded, none"])),
        ("per image, switching none -> adapter", ms(medians["switch on"])),
        ("per image, switching adapter -> none", ms(medians["switch off"])),
    ]
    print(markdown_table(["what", "ms"], rows))


if __name__ == "__main__":
    main()
