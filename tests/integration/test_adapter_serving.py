"""LoRA adapters end to end: ``omni-runtime serve`` of the tiny Z-Image with adapters declared
on its DiT, called with the official client by ``model: "<served>:<adapter>"``.

The image with an adapter equals diffusers' own ZImagePipeline, whole, with
``load_lora_weights`` of the same file and ``set_adapters`` at the same scale: at most 1
level apart and nearly all pixels identical, as tests/integration/test_family_pipelines.py
allows a served image (the encoder's embeddings come from vLLM's kernels there, from
transformers' here, equal to ~1e-6).
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
import yaml
from PIL import Image
from serving import serving

from omni_runtime.tiny_models import LLM_SUBDIR, Z_IMAGE_SUBDIR
from omni_runtime.tiny_models.dit_lora import build_dit_loras
from omni_runtime.tiny_models.llm_lora import ATTN_LORA, MLP_LORA, WIDE_LORA, build_llm_loras

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SERVED = "tiny-z-image"
PROMPT = "a lighthouse on a cliff at dusk"
STEPS, SIZE, SEED = 3, 64, 5
INK_SCALE = 0.8


@pytest.fixture(scope="module")
def loras(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_dit_loras(tmp_path_factory.mktemp("loras"), tiny_models / Z_IMAGE_SUBDIR)


@pytest.fixture(scope="module")
def client(
    llm_engine_environment: None,
    tiny_models: Path,
    loras: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[openai.OpenAI]:
    workdir = tmp_path_factory.mktemp("serve-adapters")
    data = yaml.safe_load((REPO / "examples" / "tiny-z-image.yaml").read_text())
    data["model"] = str(tiny_models / Z_IMAGE_SUBDIR)
    data["stages"][1]["maxLoras"] = 1
    data["adapters"] = [
        {"name": "ink", "stage": "dit", "source": str(loras["z-image-ink"]), "scale": INK_SCALE},
        {"name": "neon", "stage": "dit", "source": str(loras["z-image-neon"])},
    ]
    config = workdir / "pipeline.yaml"
    config.write_text(yaml.safe_dump(data))
    with serving(config, workdir) as base_url:
        yield openai.OpenAI(base_url=base_url, api_key="unused", timeout=120)


def generate(client: openai.OpenAI, model: str, **extra: Any) -> np.ndarray:
    answer = client.images.generate(
        model=model,
        prompt=PROMPT,
        size=f"{SIZE}x{SIZE}",  # type: ignore[arg-type]
        extra_body={"num_inference_steps": STEPS, "seed": SEED, **extra},
    )
    assert answer.data is not None
    b64 = answer.data[0].b64_json
    assert b64 is not None
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def reference(tiny_models: Path, lora: Path | None, scale: float = 1.0) -> np.ndarray:
    """diffusers' own ZImagePipeline, whole, with the adapter loaded its own way."""
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(
        tiny_models / Z_IMAGE_SUBDIR, local_files_only=True, dtype=torch.float32
    )
    pipeline.set_progress_bar_config(disable=True)
    if lora is not None:
        pipeline.load_lora_weights(str(lora), adapter_name="reference")
        pipeline.set_adapters(["reference"], adapter_weights=[scale])
    with torch.inference_mode():
        result = pipeline(
            prompt=PROMPT,
            num_inference_steps=STEPS,
            height=SIZE,
            width=SIZE,
            generator=torch.Generator("cpu").manual_seed(SEED),
            output_type="np",
        )
    (image,) = np.clip(np.round(np.asarray(result.images) * 255.0), 0, 255).astype(np.uint8)
    return image


def assert_same_image(served: np.ndarray, expected: np.ndarray) -> None:
    assert served.shape == expected.shape
    difference = np.abs(served.astype(np.int16) - expected.astype(np.int16))
    assert difference.max() <= 1, difference.max()
    assert (difference == 0).mean() > 0.99


def test_models_lists_the_adapters_with_their_parent(client: openai.OpenAI) -> None:
    models = {model.id: model for model in client.models.list().data}
    assert set(models) == {SERVED, "ink", "neon"}
    assert models["ink"].model_extra == {
        "root": models["ink"].model_extra["root"],
        "parent": SERVED,
        "stage": "dit",
    }
    assert models["ink"].model_extra["root"].endswith("z-image-ink.safetensors")


def test_an_image_with_an_adapter_equals_diffusers_load_lora_weights(
    client: openai.OpenAI, tiny_models: Path, loras: dict[str, Path]
) -> None:
    plain = generate(client, SERVED)
    inked = generate(client, f"{SERVED}:ink")
    assert_same_image(inked, reference(tiny_models, loras["z-image-ink"], INK_SCALE))
    assert np.abs(inked.astype(np.int16) - plain.astype(np.int16)).max() > 8, (
        "the adapter must change the image"
    )
    # The adapter's name alone, as vLLM's server takes it, and a scale of the request's.
    halved = generate(client, "neon", lora_scale=0.5)
    assert_same_image(halved, reference(tiny_models, loras["z-image-neon"], 0.5))
    # maxLoras 1: neon evicted ink, and the next ink request loads it again, the same.
    assert_same_image(generate(client, f"{SERVED}:ink"), inked)
    assert_same_image(generate(client, SERVED), plain)


def test_bad_adapter_requests_are_refused_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        generate(client, f"{SERVED}:pop")
    assert "'pop'" in str(unknown.value)
    with pytest.raises(openai.BadRequestError) as unscaled:
        generate(client, SERVED, lora_scale=0.5)
    assert "lora_scale" in str(unscaled.value)


def test_an_adapter_loaded_at_run_time_serves_and_a_bad_file_is_refused_at_load(
    client: openai.OpenAI, tiny_models: Path, loras: dict[str, Path], tmp_path: Path
) -> None:
    http = client._client  # the official client's httpx client: same base URL and auth
    base = str(client.base_url).rstrip("/")
    loaded = http.post(
        f"{base}/load_lora_adapter",
        json={"lora_name": "mono", "lora_path": str(loras["z-image-mono"])},
    )
    assert loaded.status_code == 200, loaded.text
    assert_same_image(generate(client, "mono"), reference(tiny_models, loras["z-image-mono"]))
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}" + bytes(64))
    # As vLLM's endpoint: what cannot load is refused at load time, naming the file, and is
    # not served; a missing file alike.
    for name, path in (("broken", corrupt), ("missing", tmp_path / "nowhere.safetensors")):
        refused = http.post(
            f"{base}/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "lora_path"
        assert str(path) in refused.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError):
            generate(client, name)
    # The replica serves on, with and without adapters.
    assert_same_image(generate(client, "mono"), reference(tiny_models, loras["z-image-mono"]))
    assert http.post(f"{base}/unload_lora_adapter", json={"lora_name": "mono"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        generate(client, "mono")


# -- an LLM stage's adapters: the tiny chat LLM ------------------------------------------

CHAT = "tiny-chat"
CHAT_PROMPTS = ["a red cat", "draw a blue river under the moon"]
CHAT_TOKENS = 12


@pytest.fixture(scope="module")
def chat_loras(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_llm_loras(tmp_path_factory.mktemp("chat-loras"), tiny_models / LLM_SUBDIR)


@pytest.fixture(scope="module")
def chat(
    llm_engine_environment: None,
    tiny_models: Path,
    chat_loras: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("serve-chat-adapters")
    data = yaml.safe_load((REPO / "examples" / "tiny-chat.yaml").read_text())
    data["model"] = str(tiny_models / LLM_SUBDIR)
    data["adapters"] = [
        {"name": name, "stage": "chat", "source": str(chat_loras[name])}
        for name in (ATTN_LORA, MLP_LORA)
    ]
    config = workdir / "pipeline.yaml"
    config.write_text(yaml.safe_dump(data))
    with serving(config, workdir) as base_url:
        yield base_url


def peft_text(tiny_models: Path, lora: Path | None, prompt_ids: list[int]) -> str:
    """PEFT's answer: greedy text of the base model merged with the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_models / LLM_SUBDIR
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora is not None:
        model = PeftModel.from_pretrained(model, lora).merge_and_unload()
    with torch.no_grad():
        out = model.eval().generate(
            torch.tensor([prompt_ids]), max_new_tokens=CHAT_TOKENS, do_sample=False
        )
    text: str = AutoTokenizer.from_pretrained(path).decode(
        out[0, len(prompt_ids) :], skip_special_tokens=True
    )
    return text


async def test_served_completions_with_adapters_equal_pefts_merged_model(
    chat: str, tiny_models: Path, chat_loras: dict[str, Path]
) -> None:
    client = openai.AsyncOpenAI(base_url=chat, api_key="unused", timeout=120)
    http = openai.OpenAI(base_url=chat, api_key="unused")._client
    root = chat.removesuffix("/v1")
    ids = [
        http.post(f"{root}/tokenize", json={"prompt": prompt}).json()["tokens"]
        for prompt in CHAT_PROMPTS
    ]

    async def complete(model: str, prompt: str) -> str:
        answer = await client.completions.create(
            model=model, prompt=prompt, max_tokens=CHAT_TOKENS, temperature=0
        )
        return answer.choices[0].text

    # Three at once on one replica: two adapters and none, batched together by vLLM.
    cases = [(f"{CHAT}:{ATTN_LORA}", 0), (MLP_LORA, 1), (CHAT, 0)]
    served = await asyncio.gather(*(complete(model, CHAT_PROMPTS[i]) for model, i in cases))
    expected = [
        peft_text(tiny_models, chat_loras[ATTN_LORA], ids[0]),
        peft_text(tiny_models, chat_loras[MLP_LORA], ids[1]),
        peft_text(tiny_models, None, ids[0]),
    ]
    assert served == expected
    assert expected[0] != expected[2], "the adapter must change the answer"
    # A run-time load of what vLLM cannot load (no adapter_config.json there) is refused
    # at load time, naming the path, as vLLM's own endpoint refuses it.
    refused = http.post(
        f"{root}/v1/load_lora_adapter",
        json={"lora_name": "nothing", "lora_path": str(tiny_models / LLM_SUBDIR)},
    )
    assert refused.status_code == 400, refused.text
    assert str(tiny_models / LLM_SUBDIR) in refused.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        await complete(f"{CHAT}:{WIDE_LORA}", CHAT_PROMPTS[0])
