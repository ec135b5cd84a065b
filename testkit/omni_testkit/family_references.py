"""The encoder -> DiT families (Qwen-Image, Qwen-Image-Edit(-Plus), Z-Image) on their tiny
checkpoints against their own diffusers pipelines: the references that
tests/integration/test_family_pipelines.py asserts equal to the served split and that
bench/family_equality.py prints the distance to.

The reference is the family's monolithic diffusers pipeline in this process (fp32, CPU);
for the edit families the embeddings are transformers' called with ``mm_token_type_ids``,
which diffusers 0.42.1 leaves out. ``encoded`` runs a prompt through an encoder stage's
frontend as a stage server does and reads the embeddings it hands over.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from PIL import Image

from omni_runtime.config import PipelineConfig, load_pipeline
from omni_runtime.connectors import StageConnectors
from omni_runtime.engine.stage.stage_core_types import StageServerOutput, StageServerRequest
from omni_runtime.families import FAMILIES, prompt_image_size
from omni_runtime.stage_server.llm_frontend import StageLLMFrontend
from omni_runtime.tiny_models import (
    QWEN_IMAGE_EDIT_PLUS_SUBDIR,
    QWEN_IMAGE_EDIT_SUBDIR,
    QWEN_IMAGE_SUBDIR,
    Z_IMAGE_SUBDIR,
)

REPO = Path(__file__).resolve().parents[2]
CHECKPOINTS = {
    "qwen-image": QWEN_IMAGE_SUBDIR,
    "qwen-image-edit": QWEN_IMAGE_EDIT_SUBDIR,
    "qwen-image-edit-plus": QWEN_IMAGE_EDIT_PLUS_SUBDIR,
    "z-image": Z_IMAGE_SUBDIR,
}
EDITS = ("qwen-image-edit", "qwen-image-edit-plus")
PROMPTS = ["a red cat on a green hydrant", "paint a blue river under the moon"]
STEPS = 3
SIZE = 64
DEADLINE_S = 120


def example(family: str, tiny_models: Path) -> PipelineConfig:
    """The tiny example pipeline of ``family``, its models under ``tiny_models``."""
    data = yaml.safe_load((REPO / "examples" / f"tiny-{family}.yaml").read_text())
    data["model"] = str(tiny_models / CHECKPOINTS[family])
    return load_pipeline(data)


def input_image(seed: int = 0, size: tuple[int, int] = (80, 48)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    image: np.ndarray = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return image


def input_images(family: str, seed: int = 0) -> list[np.ndarray]:
    """What an edit of ``family`` edits: one image, or for the several-image family two of
    different shapes (the last one sets the output's default size)."""
    if family not in EDITS:
        return []
    if family == "qwen-image-edit":
        return [input_image(seed)]
    return [input_image(seed), input_image(seed + 1, (40, 56))]


def png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def to_uint8(images: np.ndarray) -> np.ndarray:
    # As the DiT stage turns the pipeline's floats into pixels.
    pixels: np.ndarray = np.clip(np.round(np.asarray(images) * 255.0), 0, 255).astype(np.uint8)
    return pixels


# Loading a pipeline takes seconds; the tests and the benchmark ask for each family's often.
_MONOLITHIC: dict[str, Any] = {}


def monolithic(family: str, tiny_models: Path) -> Any:
    """The family's own diffusers pipeline, whole, in this process (loaded once)."""
    if family not in _MONOLITHIC:
        from diffusers import DiffusionPipeline

        pipeline = DiffusionPipeline.from_pretrained(
            tiny_models / CHECKPOINTS[family], local_files_only=True, dtype=torch.float32
        )
        pipeline.set_progress_bar_config(disable=True)
        _MONOLITHIC[family] = pipeline
    return _MONOLITHIC[family]


# What the edit pipelines resize an input image to for their text encoder (QwenImageEdit-
# Pipeline: ~1024x1024; QwenImageEditPlusPipeline: its CONDITION_IMAGE_SIZE).
PROMPT_IMAGE_AREA = {"qwen-image-edit": 1024 * 1024, "qwen-image-edit-plus": 384 * 384}
# QwenImageEditPlusPipeline._get_qwen_prompt_embeds's placeholder of input image N.
PLUS_IMAGE_PROMPT = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"


def edit_reference_inputs(family: str, pipeline: Any, prompt: str, images: list[np.ndarray]) -> Any:
    """What the edit pipeline gives its text encoder, plus the mm_token_type_ids that make
    transformers apply M-RoPE as Qwen2.5-VL defines it; the template and the dropped rows
    are the pipeline's own."""
    resized = []
    for image in images:
        picture = Image.fromarray(image)
        area = PROMPT_IMAGE_AREA[family]
        width, height = prompt_image_size(picture.width, picture.height, area)
        resized.append(pipeline.image_processor.resize(picture, height, width))
    text = pipeline.prompt_template_encode
    if family == "qwen-image-edit-plus":
        pictures = "".join(PLUS_IMAGE_PROMPT.format(n + 1) for n in range(len(images)))
        text = text.format(pictures + prompt)
    else:
        text = text.format(prompt)
    return pipeline.processor(
        text=[text],
        images=resized if len(resized) > 1 else resized[0],
        padding=True,
        return_tensors="pt",
    )


def reference_embeds(family: str, pipeline: Any, prompt: str, images: list[np.ndarray]) -> Any:
    """The prompt embeddings the family's own pipeline computes (one prompt, no batch)."""
    with torch.inference_mode():
        if family == "qwen-image":
            embeds, _ = pipeline.encode_prompt(prompt=prompt, device="cpu")
            return embeds[0]
        if family == "z-image":
            embeds, _ = pipeline.encode_prompt(
                prompt=prompt, device="cpu", do_classifier_free_guidance=False
            )
            return embeds[0]
        assert images
        inputs = edit_reference_inputs(family, pipeline, prompt, images)
        hidden = pipeline.text_encoder(**inputs, output_hidden_states=True).hidden_states[-1]
    recipe = FAMILIES[family].encoder
    assert recipe is not None
    assert recipe.drop_prefix == pipeline.prompt_template_encode_start_idx
    return hidden[0][pipeline.prompt_template_encode_start_idx :]


async def encoded(
    frontend: StageLLMFrontend,
    connectors: StageConnectors,
    request_id: str,
    prompt: str,
    images: list[np.ndarray],
) -> torch.Tensor:
    """The prompt embeddings an encoder stage hands over for ``prompt`` (and ``images``),
    read back from the shared-memory connector."""
    refused = await frontend.add(
        StageServerRequest(
            request_id=request_id,
            prompt=prompt,
            images=images,
            output_connector="shared_memory_connector",
        )
    )
    assert refused == []
    outputs: list[StageServerOutput] = []
    async with asyncio.timeout(DEADLINE_S):
        while not (outputs and outputs[-1].finished):
            outputs.extend(await frontend.next_outputs())
    (final,) = outputs
    assert final.error is None, final.error
    assert set(final.hand_offs) == {"prompt_embeds"}
    handle = final.hand_offs["prompt_embeds"].handle
    tensor: torch.Tensor = connectors.get(handle.connector).get(handle, "cpu")
    return tensor


def monolithic_image(
    family: str, tiny_models: Path, prompt: str, negative: str | None, seed: int,
    images: list[np.ndarray] | None = None, **call: Any,
) -> np.ndarray:  # fmt: skip
    """The image the family's own pipeline makes at STEPS steps, SIZE x SIZE, as uint8."""
    pipeline = monolithic(family, tiny_models)
    kwargs: dict[str, Any] = {
        **call,
        "num_inference_steps": STEPS,
        "height": SIZE,
        "width": SIZE,
        "generator": torch.Generator("cpu").manual_seed(seed),
        "output_type": "np",
    }
    if family in EDITS:
        assert images
        # The edit family's own embeddings, as Qwen2.5-VL computes them (see
        # reference_embeds): diffusers' encode_prompt would leave out M-RoPE.
        positive = reference_embeds(family, pipeline, prompt, images)[None]
        pictures = [Image.fromarray(image) for image in images]
        kwargs.update(
            image=pictures if family == "qwen-image-edit-plus" else pictures[0],
            prompt_embeds=positive,
            prompt_embeds_mask=torch.ones(positive.shape[:2], dtype=torch.long),
        )
        if negative is not None:
            negative_embeds = reference_embeds(family, pipeline, negative, images)[None]
            kwargs.update(
                negative_prompt_embeds=negative_embeds,
                negative_prompt_embeds_mask=torch.ones(negative_embeds.shape[:2], dtype=torch.long),
            )
    else:
        kwargs.update(prompt=prompt, negative_prompt=negative)
    with torch.inference_mode():
        result = pipeline(**kwargs)
    only: np.ndarray
    (only,) = to_uint8(result.images)
    return only
