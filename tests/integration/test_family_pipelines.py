"""Qwen-Image, Qwen-Image-Edit, Qwen-Image-Edit-Plus and Z-Image split over a vLLM encoder
and a diffusers DiT.

On each family's tiny random checkpoint: the embeddings the encoder stage hands over equal
the family's own (diffusers' ``encode_prompt``; for the edit families transformers called
with ``mm_token_type_ids``, which diffusers 0.42.1 leaves out), and the image `serve`
returns equals the image the monolithic diffusers pipeline makes from the same weights,
prompt, negative prompt, seed, steps and size.

Image tolerance: the two paths compute the same function on the same CPU, but the
embeddings come from different kernels (vLLM's and transformers', equal to ~1e-6), so a
pixel may round to the neighbouring uint8 value: at most 1 level apart, and nearly all
pixels identical.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
import yaml
from PIL import Image
from serving import CLI, served_base_url

from omni_runtime.config import PipelineConfig, load_pipeline
from omni_runtime.connectors import StageConnectors
from omni_runtime.engine.stage.stage_core_types import StageServerOutput, StageServerRequest
from omni_runtime.engine.stage.stage_llm_core_client import start_stage_llm_client
from omni_runtime.families import FAMILIES, prompt_image_size
from omni_runtime.stage_server.llm_frontend import StageLLMFrontend
from omni_runtime.tiny_models import (
    QWEN_IMAGE_EDIT_PLUS_SUBDIR,
    QWEN_IMAGE_EDIT_SUBDIR,
    QWEN_IMAGE_SUBDIR,
    Z_IMAGE_SUBDIR,
)

pytestmark = pytest.mark.integration

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


@pytest.fixture(scope="module", autouse=True)
def engine_environment(llm_engine_environment: None) -> None:
    """vLLM's CPU environment for this module's cores (tests/conftest.py)."""


def example(family: str, tiny_models: Path) -> PipelineConfig:
    """The tiny example pipeline of ``family``, its models under ``tiny_models``."""
    data = yaml.safe_load((REPO / "examples" / f"tiny-{family}.yaml").read_text())
    data["model"] = str(tiny_models / CHECKPOINTS[family])
    return load_pipeline(data)


def input_image(seed: int = 0, size: tuple[int, int] = (80, 48)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


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
    return np.clip(np.round(np.asarray(images) * 255.0), 0, 255).astype(np.uint8)


def assert_same_image(served: np.ndarray, reference: np.ndarray) -> None:
    assert served.shape == reference.shape
    difference = np.abs(served.astype(np.int16) - reference.astype(np.int16))
    assert difference.max() <= 1, difference.max()
    assert (difference == 0).mean() > 0.99


# --- the references: the family's own diffusers pipeline, whole, in this process


_MONOLITHIC: dict[str, Any] = {}


def monolithic(family: str, tiny_models: Path) -> Any:
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


@torch.inference_mode()
def reference_embeds(family: str, pipeline: Any, prompt: str, images: list[np.ndarray]) -> Any:
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
    assert FAMILIES[family].encoder.drop_prefix == pipeline.prompt_template_encode_start_idx
    return hidden[0][pipeline.prompt_template_encode_start_idx :]


# --- the encoder stage, in this process, as a stage server runs it


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def encoder(request: pytest.FixtureRequest, tiny_models: Path) -> Iterator[Any]:
    family: str = request.param
    pipeline = example(family, tiny_models)
    stage = pipeline.stages[0]
    client = start_stage_llm_client(
        stage, pipeline.model, encoder=FAMILIES[family].encoder, startup_timeout=240
    )
    connectors = StageConnectors(pipeline.connectors)
    frontend = StageLLMFrontend(pipeline, stage, client, connectors)
    try:
        yield family, pipeline, frontend, connectors
    finally:
        client.shutdown()
        connectors.close()


async def encoded(
    frontend: StageLLMFrontend,
    connectors: StageConnectors,
    request_id: str,
    prompt: str,
    images: list[np.ndarray],
) -> torch.Tensor:
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


async def test_encoder_stage_hands_over_the_familys_own_embeddings(
    encoder: Any, tiny_models: Path
) -> None:
    family, _, frontend, connectors = encoder
    reference_pipeline = monolithic(family, tiny_models)
    images = input_images(family)
    if family == "qwen-image-edit-plus":
        # The template is the pipeline's own.
        assert FAMILIES[family].encoder.template == reference_pipeline.prompt_template_encode
        assert FAMILIES[family].encoder.image_prompt == PLUS_IMAGE_PROMPT
    for n, prompt in enumerate([*PROMPTS, ""]):
        served = await encoded(frontend, connectors, f"{family}-{n}", prompt, images)
        reference = reference_embeds(family, reference_pipeline, prompt, images)
        assert served.shape == reference.shape
        assert torch.allclose(served.float(), reference.float(), atol=1e-4, rtol=0), (
            family,
            (served - reference).abs().max(),
        )


async def test_encoder_stage_refuses_what_its_family_does_not_take(encoder: Any) -> None:
    family, _, frontend, _ = encoder
    takes_image = FAMILIES[family].encoder.takes_image
    request = StageServerRequest(
        request_id=f"{family}-wrong",
        prompt="a cat",
        images=[] if takes_image else [input_image()],
        output_connector="shared_memory_connector",
    )
    (refusal,) = await frontend.add(request)
    assert refusal.error is not None
    assert refusal.error.param == "image"
    chat = StageServerRequest(
        request_id=f"{family}-chat", messages=[{"role": "user", "content": "a cat"}]
    )
    (refusal,) = await frontend.add(chat)
    assert refusal.error is not None
    assert refusal.error.param == "prompt"


# --- serve, end to end, against the monolithic pipeline


def write_pipeline(family: str, tiny_models: Path, path: Path, encoder_replicas: int) -> Path:
    data = yaml.safe_load((REPO / "examples" / f"tiny-{family}.yaml").read_text())
    data["model"] = str(tiny_models / CHECKPOINTS[family])
    data["stages"][0]["replicas"] = encoder_replicas
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def served(
    request: pytest.FixtureRequest, tiny_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, openai.OpenAI]]:
    """``omni-runtime serve`` of the family's tiny example; Qwen-Image's encoder with two
    replicas, so that a request's two embeddings may come from different replicas."""
    family: str = request.param
    workdir = tmp_path_factory.mktemp(f"serve-{family}")
    replicas = 2 if family == "qwen-image" else 1
    config = write_pipeline(family, tiny_models, workdir / "pipeline.yaml", replicas)
    log_path = workdir / "serve.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed in the finally
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(
        [*CLI, "serve", "-f", str(config), "--port", "0"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        base_url = served_base_url(proc, log_path, 300)
        client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=DEADLINE_S)
        assert client.models.list().data
        yield family, client
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def decoded(b64: str | None) -> np.ndarray:
    assert b64 is not None
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def monolithic_image(
    family: str, tiny_models: Path, prompt: str, negative: str | None, seed: int,
    images: list[np.ndarray] | None = None, **call: Any,
) -> np.ndarray:  # fmt: skip
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
    (only,) = to_uint8(result.images)
    return only


def test_served_image_equals_the_monolithic_pipelines(
    served: tuple[str, openai.OpenAI], tiny_models: Path
) -> None:
    family, client = served
    negative = "blurry, dark" if family != "z-image" else None
    extra = {"negative_prompt": negative, "num_inference_steps": STEPS, "seed": 7}
    images = input_images(family, 3)
    if images:
        files = [(f"in{n}.png", png(image), "image/png") for n, image in enumerate(images)]
        answer = client.images.edit(
            model=client.models.list().data[0].id,
            # One file as one (the "image" part), several as a list ("image[]").
            image=files if len(files) > 1 else files[0],
            prompt=PROMPTS[0],
            size=f"{SIZE}x{SIZE}",  # type: ignore[arg-type]
            extra_body=extra,
        )
    else:
        answer = client.images.generate(
            model=client.models.list().data[0].id,
            prompt=PROMPTS[0],
            size=f"{SIZE}x{SIZE}",  # type: ignore[arg-type]
            extra_body=extra,
        )
    assert answer.data is not None
    served_image = decoded(answer.data[0].b64_json)
    reference = monolithic_image(family, tiny_models, PROMPTS[0], negative, 7, images)
    assert_same_image(served_image, reference)


@pytest.mark.parametrize("served", ["z-image", "qwen-image"], indirect=True)
def test_z_images_own_guidance_knobs_are_its_pipelines(
    served: tuple[str, openai.OpenAI], tiny_models: Path
) -> None:
    """cfg_normalization and cfg_truncation reach ZImagePipeline as its own arguments (the
    image equals diffusers' with them); a pipeline without them refuses them by name."""
    family, client = served
    knobs = {"guidance_scale": 3.0, "cfg_normalization": True, "cfg_truncation": 0.5}
    extra = {"num_inference_steps": STEPS, "seed": 11, **knobs}
    if family == "qwen-image":
        with pytest.raises(openai.BadRequestError) as refused:
            client.images.generate(
                model=client.models.list().data[0].id, prompt=PROMPTS[0], extra_body=extra
            )
        assert "cfg_normalization" in str(refused.value)
        return
    answer = client.images.generate(
        model=client.models.list().data[0].id,
        prompt=PROMPTS[0],
        size=f"{SIZE}x{SIZE}",  # type: ignore[arg-type]
        extra_body=extra,
    )
    assert answer.data is not None
    reference = monolithic_image(family, tiny_models, PROMPTS[0], None, 11, **knobs)
    assert_same_image(decoded(answer.data[0].b64_json), reference)
    plain = monolithic_image(family, tiny_models, PROMPTS[0], None, 11, guidance_scale=3.0)
    assert not np.array_equal(plain, reference), "the knobs must change the image"


@pytest.mark.parametrize("served", EDITS, indirect=True)
def test_chat_completion_with_an_image_edits_it(
    served: tuple[str, openai.OpenAI], tiny_models: Path
) -> None:
    """The seed's request: image_url data URLs (one, or for the several-image family two)
    and an instruction, modalities image."""
    family, client = served
    images = input_images(family, 5)
    parts: list[Any] = [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(png(image)).decode()},
        }
        for image in images
    ]
    response = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": PROMPTS[1]}]}],
        extra_body={
            "modalities": ["image"],
            "height": SIZE,
            "width": SIZE,
            "num_inference_steps": STEPS,
            "seed": 11,
        },
    )
    content = response.choices[0].message.content
    assert isinstance(content, list)
    data_url = content[0]["image_url"]["url"]
    served_image = decoded(data_url.split(",", 1)[1])
    reference = monolithic_image(family, tiny_models, PROMPTS[1], None, 11, images)
    assert_same_image(served_image, reference)


@pytest.mark.parametrize("served", ["qwen-image-edit"], indirect=True)
def test_an_edit_streams_its_partials_then_the_same_image(
    served: tuple[str, openai.OpenAI],
) -> None:
    family, client = served
    (image,) = input_images(family, 2)
    edit: dict[str, Any] = {
        "model": client.models.list().data[0].id,
        "image": ("in.png", png(image), "image/png"),
        "prompt": PROMPTS[1],
        "size": f"{SIZE}x{SIZE}",
        "extra_body": {"num_inference_steps": 6, "seed": 4},
    }
    answer = client.images.edit(**edit)
    assert answer.data is not None
    events = list(client.images.edit(stream=True, partial_images=2, **edit))
    assert [event.type for event in events] == [
        "image_edit.partial_image",
        "image_edit.partial_image",
        "image_edit.completed",
    ]
    assert [getattr(event, "partial_image_index", None) for event in events[:2]] == [0, 1]
    assert np.array_equal(decoded(events[-1].b64_json), decoded(answer.data[0].b64_json))


@pytest.mark.parametrize("served", ["qwen-image"], indirect=True)
def test_concurrent_requests_each_get_their_own_embeddings(
    served: tuple[str, openai.OpenAI], tiny_models: Path
) -> None:
    """Two encoder replicas, one DiT: every request's positive and negative embeddings
    (two requests to the encoder, maybe to different replicas) reach the DiT run that
    serves it, so each image is the one the monolithic pipeline makes for that request."""
    family, client = served
    model = client.models.list().data[0].id
    cases = [
        (f"{PROMPTS[n % 2]} number {n}", f"{'ugly' if n % 2 else 'blurry'} {n}", 100 + n)
        for n in range(6)
    ]

    def ask(case: tuple[str, str, int]) -> np.ndarray:
        prompt, negative, seed = case
        answer = client.images.generate(
            model=model,
            prompt=prompt,
            size=f"{SIZE}x{SIZE}",  # type: ignore[arg-type]
            extra_body={"negative_prompt": negative, "num_inference_steps": STEPS, "seed": seed},
        )
        assert answer.data is not None
        return decoded(answer.data[0].b64_json)

    with ThreadPoolExecutor(len(cases)) as pool:
        images = list(pool.map(ask, cases))
    for (prompt, negative, seed), image in zip(cases, images, strict=True):
        assert_same_image(image, monolithic_image(family, tiny_models, prompt, negative, seed))
