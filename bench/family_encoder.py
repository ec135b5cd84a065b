"""The reason to split a family's pipeline: its text encoder as a vLLM stage against the
family pipeline's own transformers ``encode_prompt``, on the tiny family checkpoints.

Per family (qwen-image, z-image, qwen-image-edit with one input image per prompt), fp32,
32 prompts, ``--threads`` torch/OpenMP threads on both sides:

- vLLM stage: the tiny example's encoder stage started as a stage process starts it
  (``start_stage_llm_client(stage, model, encoder=FAMILIES[family].encoder)`` behind a
  ``StageLLMFrontend`` with the pipeline's connectors; the core's OpenMP threads pinned by
  VLLM_CPU_OMP_THREADS_BIND to CPUs 0..threads-1). All 32 prompts are submitted at once;
  timed from the first ``add`` to the last embeddings put into the shared-memory
  connector (their handles in hand: what the stage hands the router).
- transformers: the monolithic diffusers pipeline's ``encode_prompt`` in this process,
  (a) one prompt per call, as the pipeline encodes a request, and (b) the 32 prompts as
  one call (its own batching: padded to the longest, or to 512 for Z-Image).

``--warmup`` rounds are not counted, then ``--rounds`` rounds per side: the median round
(and its spread, min-max), prompts/s, and vLLM's prompts/s over each transformers mode.
The sides run one after the other (the vLLM core is stopped before the next family).

    .venv/bin/python bench/family_encoder.py [--family qwen-image --family z-image]
        [--prompts 32] [--rounds 5] [--warmup 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from _load import exit_on_sigterm, markdown_table
from omni_runtime.config import PipelineConfig, load_pipeline
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR, TINY_MODELS_ENV
from omni_runtime.families import FAMILIES, FAMILY_NAMES, prompt_image_size
from omni_runtime.tiny_models import ensure_tiny_models

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 600.0
_SUBJECTS = ["a red cat", "an old lighthouse", "two blue birds", "a paper boat", "a fox"]
_PLACES = ["on a green hydrant", "under the moon", "in a busy market", "by a river at dawn"]


def tiny_root() -> Path:
    """The tiny models' root ($OMNI_TINY_MODELS, default ~/.cache/...), built if absent."""
    os.environ.setdefault(TINY_MODELS_ENV, str(DEFAULT_MODELS_DIR))
    return ensure_tiny_models(os.environ[TINY_MODELS_ENV])


def example(family: str, root: Path) -> PipelineConfig:
    """examples/tiny-FAMILY.yaml with its model under ``root``."""
    data = yaml.safe_load((REPO / "examples" / f"tiny-{family}.yaml").read_text())
    data["model"] = str(root / family)
    return load_pipeline(data)


def monolithic(family: str, root: Path, **components: Any) -> Any:
    """The family's whole diffusers pipeline, fp32 (``components``: e.g. text_encoder=None)."""
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(
        root / family, local_files_only=True, dtype=torch.float32, **components
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def make_prompts(count: int) -> list[str]:
    """``count`` distinct prompts of varied length (so that a padded batch pads)."""
    return [
        f"{_SUBJECTS[i % 5]} {_PLACES[i % 4]}, picture {i}" + ", finely detailed" * (i % 7)
        for i in range(count)
    ]


def input_image(seed: int, size: tuple[int, int] = (80, 48)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


def spread(values: Sequence[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


# -- transformers: the pipeline's own encode_prompt ------------------------------------------


def transformers_encoder(
    family: str, pipeline: Any, images: list[np.ndarray] | None
) -> Callable[[list[str], list[int]], object]:
    """encode(prompts, indices): the pipeline's encode_prompt, as its __call__ calls it."""
    if family == "qwen-image":
        return lambda prompts, _: pipeline.encode_prompt(prompt=prompts, device="cpu")
    if family == "z-image":
        # list(): Z-Image's _encode_prompt writes the templated prompts into its argument.
        return lambda prompts, _: pipeline.encode_prompt(
            prompt=list(prompts), device="cpu", do_classifier_free_guidance=False
        )
    from PIL import Image

    assert images is not None
    area = FAMILIES[family].encoder.image_area
    assert area is not None

    def encode_edit(prompts: list[str], indices: list[int]) -> object:
        # Timed from the raw image, as the stage gets it: QwenImageEditPipeline.__call__
        # resizes its prompt image to about `area` pixels before encode_prompt.
        resized = []
        for index in indices:
            picture = Image.fromarray(images[index])
            width, height = prompt_image_size(picture.width, picture.height, area)
            resized.append(pipeline.image_processor.resize(picture, height, width))
        return pipeline.encode_prompt(prompt=prompts, image=resized, device="cpu")

    return encode_edit


def measure_transformers(
    family: str, root: Path, prompts: list[str], images: list[np.ndarray] | None, rounds: int
) -> tuple[list[float], list[float]]:
    """Seconds per round: one prompt per call, and all prompts as one call."""
    pipeline = monolithic(family, root)
    encode = transformers_encoder(family, pipeline, images)
    singles, batches = [], []
    with torch.inference_mode():
        for _ in range(rounds):
            start = time.perf_counter()
            for index, prompt in enumerate(prompts):
                encode([prompt], [index])
            singles.append(time.perf_counter() - start)
            start = time.perf_counter()
            encode(prompts, list(range(len(prompts))))
            batches.append(time.perf_counter() - start)
    del pipeline
    gc.collect()
    return singles, batches


# -- vLLM: the encoder stage -------------------------------------------------------------------


async def measure_vllm(
    family: str, root: Path, prompts: list[str], images: list[np.ndarray] | None, rounds: int
) -> tuple[list[float], list[float]]:
    """Seconds per round from the first add to the last handle (the put done), and of
    them the adds' (request building: tokenizing, image processing, sending to the core)."""
    from omni_runtime.connectors import StageConnectors
    from omni_runtime.engine.stage.stage_core_types import StageServerOutput, StageServerRequest
    from omni_runtime.engine.stage.stage_llm_core_client import start_stage_llm_client
    from omni_runtime.stage_server.llm_frontend import StageLLMFrontend

    pipeline = example(family, root)
    stage, dit = sorted(pipeline.stages, key=lambda s: s.stage_id)
    connector = next(iter(dit.input_connectors.values()))
    client = start_stage_llm_client(
        stage, pipeline.model, encoder=FAMILIES[family].encoder, startup_timeout=DEADLINE_S
    )
    connectors = StageConnectors(pipeline.connectors)
    frontend = StageLLMFrontend(pipeline, stage, client, connectors)
    times, adding = [], []
    try:
        for round_ in range(rounds):
            ids = [f"{family}-{round_}-{i}" for i in range(len(prompts))]
            done: dict[str, StageServerOutput] = {}
            start = time.perf_counter()
            async with asyncio.timeout(DEADLINE_S):
                for index, request_id in enumerate(ids):
                    request = StageServerRequest(
                        request_id=request_id,
                        prompt=prompts[index],
                        images=[images[index]] if images is not None else [],
                        output_connector=connector,
                    )
                    refused = await frontend.add(request)
                    if refused:
                        raise RuntimeError(f"refused: {refused[0].error}")
                adding.append(time.perf_counter() - start)
                while len(done) < len(ids):
                    done.update(
                        (o.request_id, o) for o in await frontend.next_outputs() if o.finished
                    )
            times.append(time.perf_counter() - start)
            for output in done.values():
                hand_off = output.hand_offs.get("prompt_embeds")
                if output.error is not None or hand_off is None:
                    raise RuntimeError(f"{output.request_id}: {output.error or 'no embeddings'}")
                connectors.get(connector).release(hand_off.handle.key)
    finally:
        client.shutdown()
        connectors.close()
    return times, adding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", action="append", choices=FAMILY_NAMES, help="repeatable")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per side")
    parser.add_argument("--warmup", type=int, default=1, help="rounds not counted, first")
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads, each side")
    args = parser.parse_args()
    exit_on_sigterm()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the tables
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    torch.set_num_threads(args.threads)
    root = tiny_root()
    prompts = make_prompts(args.prompts)
    skip = args.warmup
    print(
        f"\n{args.prompts} prompts, fp32, {args.threads} thread(s) each side (torch in this "
        f"process; the vLLM core's OpenMP on CPUs 0-{args.threads - 1}); median of "
        f"{args.rounds} rounds after {args.warmup} warm-up, spread min-max\n"
    )
    for family in args.family or list(FAMILY_NAMES):
        takes_image = FAMILIES[family].encoder.takes_image
        images = [input_image(i) for i in range(len(prompts))] if takes_image else None
        print(f"{family}: transformers", file=sys.stderr, flush=True)
        singles, batches = measure_transformers(family, root, prompts, images, skip + args.rounds)
        print(f"{family}: vLLM stage", file=sys.stderr, flush=True)
        served, adding = asyncio.run(
            measure_vllm(family, root, prompts, images, skip + args.rounds)
        )
        vllm_rate = len(prompts) / statistics.median(served[skip:])
        rows: list[list[object]] = []
        for name, times in (
            ("vLLM stage, all at once (put included)", served),
            ("transformers encode_prompt, one per call", singles),
            ("transformers encode_prompt, one batch", batches),
        ):
            rate = len(prompts) / statistics.median(times[skip:])
            ratio = "" if times is served else f"{vllm_rate / rate:.2f}x"
            adds = f"{statistics.median(adding[skip:]):.3f}" if times is served else ""
            median = f"{statistics.median(times[skip:]):.3f}"
            rows.append([name, median, spread(times[skip:]), adds, f"{rate:.0f}", ratio])
        print(f"### {family}" + (" (one 80x48 input image per prompt)" if takes_image else ""))
        headers = ["side", "s / round", "spread s", "of it adds s", "prompts/s", "vLLM / this"]
        print(markdown_table(headers, rows) + "\n", flush=True)


if __name__ == "__main__":
    main()
