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

from omni_runtime.connectors import StageConnectors
from omni_runtime.engine.stage.stage_core_types import StageServerRequest
from omni_runtime.engine.stage.stage_llm_core_client import start_stage_llm_client
from omni_runtime.families import FAMILIES
from omni_runtime.stage_server.llm_frontend import StageLLMFrontend
from omni_testkit.family_references import (
    CHECKPOINTS,
    DEADLINE_S,
    EDITS,
    PLUS_IMAGE_PROMPT,
    PROMPTS,
    REPO,
    SIZE,
    STEPS,
    encoded,
    example,
    input_image,
    input_images,
    monolithic,
    monolithic_image,
    png,
    reference_embeds,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def engine_environment(llm_engine_environment: None) -> None:
    """vLLM's CPU environment for this module's cores (tests/conftest.py)."""


def assert_same_image(served: np.ndarray, reference: np.ndarray) -> None:
    assert served.shape == reference.shape
    difference = np.abs(served.astype(np.int16) - reference.astype(np.int16))
    assert difference.max() <= 1, difference.max()
    assert (difference == 0).mean() > 0.99


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
