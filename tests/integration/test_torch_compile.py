"""A DiT stage's torchCompile: the transformer's repeated blocks compiled (diffusers'
regional compilation) make the eager images, with and without a step cache; a pipeline
with no such blocks is refused at load, naming the field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
from omni_runtime.diffusion.step_cache import StepCacheTier
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest as Request
from omni_runtime.tiny_models import DIFFUSION_SUBDIR, QWEN_IMAGE_SUBDIR

pytestmark = pytest.mark.integration

TIERS = {"fast": StepCacheTier(interval=2, warmup_steps=2)}


def images(dit: DiffusionEngine, name: str, **params: object) -> np.ndarray:
    request = Request(
        request_id=f"{name}-{sorted(params.items())}",
        prompt="a red fox in the snow",
        params={
            "num_inference_steps": 6,
            "height": 64,
            "width": 64,
            "seed": 7,
            "negative_prompt": "blurry",
            **params,
        },
    )
    dit.admit(request.request_id)
    output = dit.execute(request)
    assert output.error is None, output.error
    assert output.images is not None
    return output.images


def test_compiled_blocks_make_the_eager_images(tiny_models: Path) -> None:
    model = str(tiny_models / QWEN_IMAGE_SUBDIR)
    eager = DiffusionEngine(
        DiffusionEngineConfig(model=model, family="qwen-image", step_cache_tiers=TIERS)
    )
    compiled = DiffusionEngine(
        DiffusionEngineConfig(
            model=model, family="qwen-image", step_cache_tiers=TIERS, torch_compile=True
        )
    )
    blocks = compiled.pipeline.transformer.transformer_blocks
    assert all(block._compiled_call_impl is not None for block in blocks)
    # On this CPU inductor's kernels round as eager ones do: identical bytes.
    for params in ({}, {"step_cache": "fast"}, {"height": 96}):
        assert np.array_equal(images(compiled, "c", **params), images(eager, "e", **params))


def test_a_pipeline_without_repeated_blocks_is_refused(tiny_models: Path) -> None:
    config = DiffusionEngineConfig(model=str(tiny_models / DIFFUSION_SUBDIR), torch_compile=True)
    refusal = r"^torchCompile: this pipeline \(StableDiffusionPipeline\) has no transformer"
    with pytest.raises(ValueError, match=refusal):
        DiffusionEngine(config)
