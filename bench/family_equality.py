"""The equality figures of each family's split against its own diffusers pipeline, on the
tiny checkpoints (fp32, CPU): the max abs difference of the embeddings the encoder stage
hands over (3 prompts, "" among them) against the reference, and of the image the DiT
stage makes from them against the monolithic pipeline's (uint8 levels, and the share of
identical pixels). tests/integration/test_family_pipelines.py asserts bounds on the same
quantities against the same references (omni_testkit.family_references); this prints them.

    .venv/bin/python bench/family_equality.py [--family z-image ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import numpy as np

from omni_runtime.connectors import StageConnectors
from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest
from omni_runtime.engine.stage.stage_llm_core_client import start_stage_llm_client
from omni_runtime.families import FAMILIES
from omni_runtime.stage_server.llm_frontend import StageLLMFrontend
from omni_runtime.tiny_models import ensure_tiny_models
from omni_testkit import family_references as t


async def main(families: list[str]) -> None:
    root = ensure_tiny_models(Path.home() / ".cache" / "omni-operator" / "tiny-models")
    print("| family | embeddings max abs diff | image max diff (levels) | identical pixels |")
    print("|---|---|---|---|")
    for family in families:
        pipeline = t.example(family, root)
        stage = pipeline.stages[0]
        client = start_stage_llm_client(stage, pipeline.model, encoder=FAMILIES[family].encoder)
        connectors = StageConnectors(pipeline.connectors)
        frontend = StageLLMFrontend(pipeline, stage, client, connectors)
        try:
            reference = t.monolithic(family, root)
            images = t.input_images(family, 3)
            worst = 0.0
            for n, prompt in enumerate([*t.PROMPTS, ""]):
                served = await t.encoded(frontend, connectors, f"{family}-{n}", prompt, images)
                expected = t.reference_embeds(family, reference, prompt, images)
                worst = max(worst, float((served - expected).abs().max()))
            negative = "blurry, dark" if family != "z-image" else None
            positive = await t.encoded(frontend, connectors, "p", t.PROMPTS[0], images)
            unwanted = await t.encoded(frontend, connectors, "n", negative or "", images)
            dit = DiffusionEngine(
                DiffusionEngineConfig(model=pipeline.model, family=family, text_from_upstream=True)
            )
            params: dict[str, object] = {
                "num_inference_steps": t.STEPS, "height": t.SIZE, "width": t.SIZE, "seed": 7,
            }  # fmt: skip
            if negative is not None:
                params["negative_prompt"] = negative
            request = StageDiffusionCoreRequest(
                request_id="image",
                params=params,
                prompt_embeds=positive.numpy(),
                negative_prompt_embeds=unwanted.numpy(),
                images=images,
            )
            dit.admit(request.request_id)
            output = dit.execute(request)
            assert output.images is not None, output.error
            expected_image = t.monolithic_image(family, root, t.PROMPTS[0], negative, 7, images)
            diff = np.abs(output.images[0].astype(np.int16) - expected_image.astype(np.int16))
            identical = 100 * float((diff == 0).mean())
            print(f"| {family} | {worst:.1e} | {int(diff.max())} | {identical:.2f}% |", flush=True)
        finally:
            client.shutdown()
            connectors.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--family",
        action="append",
        choices=list(t.CHECKPOINTS),
        help="a family to measure (repeatable; default: every one)",
    )
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    asyncio.run(main(args.family or list(t.CHECKPOINTS)))
