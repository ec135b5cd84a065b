"""Partial images in a family's DiT (the diffusion engine, in this process): at the steps
partial_steps chooses, decoded from the step's predicted clean latent by the family's own
VAE path, without changing the final image."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
from omni_runtime.diffusion.previews import PartialImages, partial_steps
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreOutput
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest as Request
from omni_runtime.families import FAMILIES
from omni_runtime.tiny_models import DIFFUSION_SUBDIR, QWEN_IMAGE_SUBDIR, Z_IMAGE_SUBDIR

pytestmark = pytest.mark.integration

STEPS = 8
CHECKPOINTS = {"qwen-image": QWEN_IMAGE_SUBDIR, "z-image": Z_IMAGE_SUBDIR}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def dit(request: pytest.FixtureRequest, tiny_models: Path) -> DiffusionEngine:
    family: str = request.param
    config = DiffusionEngineConfig(model=str(tiny_models / CHECKPOINTS[family]), family=family)
    return DiffusionEngine(config)


def run(dit: DiffusionEngine, partials: int | None = None) -> tuple[np.ndarray, list[Any]]:
    params: dict[str, Any] = {"num_inference_steps": STEPS, "height": 64, "width": 48, "seed": 3}
    if partials is not None:
        params["partial_images"] = partials
    request = Request(request_id=f"r-{partials}", prompt="a red fox", params=params)
    sent: list[StageDiffusionCoreOutput] = []
    dit.admit(request.request_id)
    output = dit.execute(request, emit=sent.append)
    assert output.error is None, output.error
    assert output.images is not None
    return output.images, sent


def test_partials_come_at_their_steps_and_leave_the_image_alone(dit: DiffusionEngine) -> None:
    alone, none_sent = run(dit)
    assert none_sent == []
    image, sent = run(dit, 3)
    assert np.array_equal(image, alone)
    assert len(sent) == len(partial_steps(STEPS, 3)) == 3
    assert [output.partial_index for output in sent] == [0, 1, 2]
    for output in sent:
        assert output.request_id == "r-3"
        assert output.images is not None
        assert output.images.shape == image.shape
        assert output.images.dtype == np.uint8
    # Later partials are nearer the image.
    distances = [np.abs(o.images.astype(np.int64) - image).mean() for o in sent]  # type: ignore[union-attr]
    assert distances == sorted(distances, reverse=True)


def test_the_last_steps_clean_latent_decodes_to_the_image(dit: DiffusionEngine) -> None:
    """At the last step sigma is 0, so the predicted clean latent is the final latent: its
    partial is the pipeline's own image, which checks the family's decoding path."""
    image, _ = run(dit)
    family = FAMILIES[dit.config.family or ""]
    assert family.dit.preview is not None
    sent: list[np.ndarray] = []
    previews = PartialImages(
        dit.pipeline, family.dit.preview, [STEPS - 1], lambda images, _: sent.append(images)
    )

    def on_step_end(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> Any:
        previews.after_step(step, tensors["latents"])
        return tensors

    watch = previews.watch()
    try:
        with torch.inference_mode():
            dit.pipeline(
                prompt="a red fox",
                num_inference_steps=STEPS,
                height=64,
                width=48,
                generator=torch.Generator("cpu").manual_seed(3),
                callback_on_step_end=on_step_end,
                output_type="np",
            )
    finally:
        if watch is not None:
            watch.remove()
    (last,) = sent
    assert last.shape == image.shape
    assert np.abs(last.astype(np.int64) - image).max() <= 1


def test_a_dit_without_a_preview_sends_none(tiny_models: Path) -> None:
    plain = DiffusionEngine(DiffusionEngineConfig(model=str(tiny_models / DIFFUSION_SUBDIR)))
    params = {"num_inference_steps": 4, "height": 32, "width": 32, "partial_images": 2}
    request = Request(request_id="sd", prompt="a fox", params=params)
    sent: list[StageDiffusionCoreOutput] = []
    plain.admit("sd")
    output = plain.execute(request, emit=sent.append)
    assert output.error is None
    assert sent == []
