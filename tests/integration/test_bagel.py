"""BAGEL on the tiny checkpoint: equal to BAGEL's own inference code, and served as the seed
asks for it.

The reference is ByteDance-Seed/Bagel's inference code, unmodified, run in an environment
of its own (bagel_reference/: transformers 4.49, a flash-attn stand-in on SDPA) on the same
weights, prompt, seed and so the same noise. What may differ, and why:

- the VAE: the reference runs under bf16 autocast, so its VAE convolves in bf16; ours is
  float32. The image tokens of an input image (its VAE latent) and every decoded pixel carry
  that difference; measured on the reference's own latent, our decode differs by at most 4
  levels of 255 (mean 0.5);
- guidance's renormalisation: CUDA autocast, the reference's platform, takes a norm in
  float32, as we do; the CPU autocast the reference runs under here keeps it in bf16.
Everything else is bit for bit: the text and ViT contexts' keys and values, and with
guidance off, the whole flow's final latent.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import yaml
from PIL import Image
from serving import serving, wait_until

from omni_runtime.families.bagel import THINK_SYSTEM_PROMPT
from omni_runtime.modeling.bagel.generation import (
    BagelGenerator,
    GuidanceParams,
    default_guidance,
    plan,
)
from omni_runtime.modeling.bagel.model import ContextKV
from omni_runtime.tiny_models import BAGEL_SUBDIR
from omni_testkit.bagel_reference.harness import guidance_spec, reference_dir, run_reference

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SIZE = 64
STEPS = 6
SEED = 42
# The seed's request text, special tokens and all.
EDIT_PROMPT = "<|im_start|>Turn the main subject into a polished gold sculpture.<|im_end|>"
T2I_PROMPT = "a red cat on a city street"
# The image tokens' keys and values differ by the VAE's precision (see the docstring):
# measured at most 0.031 (one bf16 step at their magnitude, up to 4.5).
VAE_TOKENS_ATOL = 0.1
# Final latents (magnitude up to ~4): measured 0.028 (text-to-image) and 0.051 (edit).
LATENT_ATOL = 0.15
# Pixels: measured at most 8 levels (mean 0.84) through the whole pipeline.
PIXELS_MAX, PIXELS_MEAN = 12, 1.5


def input_image(seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)


def png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def decoded(b64: str | None) -> np.ndarray:
    assert b64 is not None
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def assert_close_image(ours: np.ndarray, reference: np.ndarray) -> None:
    assert ours.shape == reference.shape
    difference = np.abs(ours.astype(np.int16) - reference.astype(np.int16))
    assert difference.max() <= PIXELS_MAX, difference.max()
    assert difference.mean() <= PIXELS_MEAN, difference.mean()


# --- the reference ---------------------------------------------------------------------


CASES: dict[str, tuple[str, bool, GuidanceParams]] = {
    # name: (prompt, edit, guidance)
    "t2i": (T2I_PROMPT, False, replace(default_guidance(False), num_timesteps=STEPS)),
    "t2i-unguided": (
        T2I_PROMPT,
        False,
        replace(default_guidance(False), num_timesteps=STEPS, cfg_text_scale=1.0),
    ),
    "edit": (EDIT_PROMPT, True, replace(default_guidance(True), num_timesteps=STEPS)),
    # Think mode: BAGEL's planning system prompt, a greedy plan of THINK_TOKENS at most.
    "t2i-think": (T2I_PROMPT, False, replace(default_guidance(False), num_timesteps=STEPS)),
}
THINK_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tiny_models: Path) -> Path:
    return tiny_models / BAGEL_SUBDIR


@pytest.fixture(scope="module")
def reference(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, np.ndarray]]:
    """What BAGEL's own code computes for each case, on the tiny checkpoint."""
    if reference_dir() is None:
        if os.environ.get("OMNI_REQUIRE_BAGEL_REFERENCE") == "1":
            pytest.fail("OMNI_REQUIRE_BAGEL_REFERENCE=1 but no BAGEL reference code was found")
        pytest.skip("BAGEL's reference code is not here (set OMNI_BAGEL_REFERENCE)")
    workdir = tmp_path_factory.mktemp("bagel-reference")
    image_path = workdir / "input.png"
    image_path.write_bytes(png(input_image()))
    results = {}
    for name, (prompt, edit, guidance) in CASES.items():
        spec = {
            "checkpoint": str(checkpoint),
            "prompt": prompt,
            "image": str(image_path) if edit else None,
            "seed": SEED,
            **guidance_spec(guidance),
            "height": SIZE,
            "width": SIZE,
            "out": str(workdir / f"{name}.npz"),
        }
        if name.endswith("-think"):
            spec.update(think=True, think_tokens=THINK_TOKENS)
        results[name] = run_reference(spec, workdir)
    return results


@pytest.fixture(scope="module")
def generator(checkpoint: Path) -> BagelGenerator:
    return BagelGenerator.load(checkpoint)


def ours(generator: BagelGenerator, case: str) -> tuple[Any, np.ndarray, np.ndarray]:
    """(contexts, final latent, image) of our generator for ``case``."""
    prompt, edit, guidance = CASES[case]
    rng = torch.Generator().manual_seed(SEED)
    picture = generator.prepare_image(Image.fromarray(input_image())) if edit else None
    contexts = generator.contexts(prompt, picture, SIZE, SIZE, rng)
    with torch.inference_mode():
        latent = generator.denoise(contexts, guidance, rng)
        image = generator.decode(latent, contexts.image_size)
    return contexts, latent.numpy(), image


# --- equality with the reference, in this process -------------------------------------


@pytest.mark.parametrize("case", ["t2i", "edit"])
def test_contexts_are_the_references(
    generator: BagelGenerator, reference: dict[str, dict[str, np.ndarray]], case: str
) -> None:
    """The three contexts' keys and values, per layer. Without an input image, bit for bit.
    With one, its VAE tokens carry the VAE's precision, and so does every later token from
    the second layer on (it attends to them); the first layer of the ViT and text tokens,
    and the image-dropped context, are still bit for bit."""
    ref = reference[case]
    contexts, _, _ = ours(generator, case)
    _, edit, _ = CASES[case]
    # (ours, the reference's name, whether it holds the input image's VAE tokens)
    pairs = [
        (contexts.full, "gen", edit),
        (contexts.no_text, "cfg_text", edit),
        (contexts.no_image, "cfg_img", False),
    ]
    vae = (SIZE // 16) ** 2 + 2  # the VAE tokens and their two frame tokens
    for context, name, with_vae in pairs:
        assert context.rope == int(ref[f"{name}_rope"])
        for kind, tensor in (("keys", context.keys), ("values", context.values)):
            mine, theirs = tensor.float().numpy(), ref[f"{name}_{kind}"]
            assert mine.shape == theirs.shape, (name, kind)
            what = f"{case} {name} {kind}"
            if not with_vae:
                np.testing.assert_array_equal(mine, theirs, err_msg=what)
                continue
            np.testing.assert_array_equal(mine[0, vae:], theirs[0, vae:], err_msg=what)
            np.testing.assert_allclose(mine, theirs, rtol=0, atol=VAE_TOKENS_ATOL, err_msg=what)
    if edit:
        # The text-dropped context is a prefix of the full one.
        prefix = contexts.no_text.length
        assert torch.equal(contexts.full.keys[:, :prefix], contexts.no_text.keys)


def test_think_modes_plan_and_contexts_are_the_references(
    generator: BagelGenerator, reference: dict[str, dict[str, np.ndarray]]
) -> None:
    """BAGEL's think mode, text to image: the plan written greedily after the system prompt
    and the prompt is the reference's, and so are the three contexts, bit for bit: the full
    one (with the plan re-tokenized in it), the text-dropped one (the system prompt) and the
    image-dropped one (system prompt and prompt, no plan)."""
    ref = reference["t2i-think"]
    model, tokenizer, tokens = generator.model, generator.tokenizer, generator.tokens
    with torch.inference_mode():
        empty = ContextKV.empty(generator.shape.llm, model.dtype, model.device)
        system = model.extend_with_text(
            empty, tokenizer.encode(THINK_SYSTEM_PROMPT, add_special_tokens=False), tokens
        )
        prompted = model.extend_with_text(
            system, tokenizer.encode(T2I_PROMPT, add_special_tokens=False), tokens
        )
        text, full = plan(model, tokenizer, tokens, prompted, THINK_TOKENS)
    assert text == str(ref["think_text"])
    for context, name in ((full, "gen"), (system, "cfg_text"), (prompted, "cfg_img")):
        assert context.rope == int(ref[f"{name}_rope"])
        np.testing.assert_array_equal(context.keys.float().numpy(), ref[f"{name}_keys"])
        np.testing.assert_array_equal(context.values.float().numpy(), ref[f"{name}_values"])


def test_the_flow_without_guidance_is_the_references_bit_for_bit(
    generator: BagelGenerator, reference: dict[str, dict[str, np.ndarray]]
) -> None:
    _, latent, image = ours(generator, "t2i-unguided")
    np.testing.assert_array_equal(latent, reference["t2i-unguided"]["latent"])
    assert_close_image(image, reference["t2i-unguided"]["image"])


@pytest.mark.parametrize("case", ["t2i", "edit"])
def test_guided_latents_and_images_are_the_references(
    generator: BagelGenerator, reference: dict[str, dict[str, np.ndarray]], case: str
) -> None:
    _, latent, image = ours(generator, case)
    np.testing.assert_allclose(latent, reference[case]["latent"], rtol=0, atol=LATENT_ATOL)
    assert_close_image(image, reference[case]["image"])


# --- served: the thinker and the DiT as processes, behind the router -------------------


@pytest.fixture(scope="module")
def served(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``omni-runtime serve -f examples/tiny-bagel.yaml`` on the tiny checkpoint, with two
    DiT replicas; its base URL."""
    workdir = tmp_path_factory.mktemp("serve-bagel")
    data = yaml.safe_load((ROOT / "examples" / "tiny-bagel.yaml").read_text())
    data["model"] = str(checkpoint)
    data["stages"][1]["replicas"] = 2
    config = workdir / "pipeline.yaml"
    config.write_text(yaml.safe_dump(data))
    with serving(config, workdir) as url:
        yield url


@pytest.fixture(scope="module")
def served_thinking(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny BAGEL served with its thinker in think mode (plans of THINK_TOKENS at most)."""
    workdir = tmp_path_factory.mktemp("serve-bagel-think")
    data = yaml.safe_load((ROOT / "examples" / "tiny-bagel.yaml").read_text())
    data["model"] = str(checkpoint)
    thinker = data["stages"][0]
    thinker["think"] = True
    thinker["defaultSamplingParams"]["max_tokens"] = THINK_TOKENS
    config = workdir / "pipeline.yaml"
    config.write_text(yaml.safe_dump(data))
    with serving(config, workdir) as url:
        yield url


def test_think_mode_served_makes_the_references_image(
    served_thinking: str, reference: dict[str, dict[str, np.ndarray]]
) -> None:
    """Think mode through the stages: the thinker writes the plan and hands the DiT the
    context holding it, and its companion the context without it (system prompt and
    prompt); the image is the reference's think-mode image. An edit in think mode works."""
    client = openai.OpenAI(base_url=served_thinking, api_key="unused", timeout=120)
    extra = {"num_inference_steps": STEPS, "seed": SEED}
    generated = client.images.generate(
        model="tiny-bagel",
        prompt=T2I_PROMPT,
        size=f"{SIZE}x{SIZE}",  # type: ignore[arg-type]
        extra_body=extra,
    )
    assert generated.data is not None
    assert_close_image(decoded(generated.data[0].b64_json), reference["t2i-think"]["image"])
    # The plan comes back beside the image, as BAGEL's interleave_inference returns
    # [text, image]: the reference's plan.
    assert generated.data[0].revised_prompt == str(reference["t2i-think"]["think_text"])
    body = seed_request(input_image(), steps=2)
    response = client.chat.completions.create(
        model=body.pop("model"), messages=body.pop("messages"), extra_body=body
    )
    assert chat_image(response).shape == (SIZE, SIZE, 3)
    # In a chat answer: the plan's text part, then the image.
    parts = response.choices[0].message.content
    assert isinstance(parts, list)
    assert [part["type"] for part in parts] == ["text", "image_url"]
    assert isinstance(parts[0]["text"], str)
    # Each request one message to the thinker: the context with its plan, and its
    # companion's without, run side by side.
    assert _thinker_served(served_thinking) == 2


def seed_request(image: np.ndarray, seed: int = SEED, steps: int = STEPS) -> dict[str, Any]:
    """The seed's TI2I request body, at the tiny model's size."""
    url = "data:image/png;base64," + base64.b64encode(png(image)).decode()
    return {
        "model": "tiny-bagel",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": EDIT_PROMPT},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        "modalities": ["image"],
        "height": SIZE,
        "width": SIZE,
        "num_inference_steps": steps,
        "seed": seed,
    }


def chat_image(response: Any) -> np.ndarray:
    parts = response.choices[0].message.content
    assert isinstance(parts, list)
    (image,) = (part for part in parts if part["type"] == "image_url")
    return decoded(image["image_url"]["url"].split(",", 1)[1])


def test_the_seeds_request_through_the_openai_client_is_the_references_edit(
    served: str, reference: dict[str, dict[str, np.ndarray]]
) -> None:
    client = openai.OpenAI(base_url=served, api_key="unused", timeout=120)
    body = seed_request(input_image())
    response = client.chat.completions.create(
        model=body.pop("model"), messages=body.pop("messages"), extra_body=body
    )
    assert_close_image(chat_image(response), reference["edit"]["image"])


def _served_by(served: str, stage: str) -> dict[str, float]:
    """Requests each replica of ``stage`` finished, by the router's /metrics."""
    with httpx.Client(base_url=served.removesuffix("/v1"), timeout=10) as http:
        metrics = http.get("/metrics").text
    counts: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("omni_stage_requests_total{") and f'stage="{stage}"' in line:
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            counts[replica] = counts.get(replica, 0.0) + float(line.split()[-1])
    return counts


def _thinker_served(served: str) -> float:
    return sum(_served_by(served, "thinker").values())


def test_text_to_image_and_edits_on_the_images_endpoints(
    served: str, reference: dict[str, dict[str, np.ndarray]]
) -> None:
    client = openai.OpenAI(base_url=served, api_key="unused", timeout=120)
    extra = {"num_inference_steps": STEPS, "seed": SEED}
    thinker_before = _thinker_served(served)
    generated = client.images.generate(
        model="tiny-bagel",
        prompt=T2I_PROMPT,
        size=f"{SIZE}x{SIZE}",  # type: ignore[arg-type]
        extra_body=extra,
    )
    assert generated.data is not None
    assert_close_image(decoded(generated.data[0].b64_json), reference["t2i"]["image"])
    assert generated.data[0].revised_prompt is None  # no think mode, no plan
    # Text to image: the thinker prefilled the context and the DiT read its KV cache.
    assert _thinker_served(served) == thinker_before + 1
    edited = client.images.edit(
        model="tiny-bagel",
        image=("in.png", png(input_image()), "image/png"),
        prompt=EDIT_PROMPT,
        extra_body=extra,
    )
    assert edited.data is not None
    # The input's size: an edit keeps it.
    assert_close_image(decoded(edited.data[0].b64_json), reference["edit"]["image"])
    # An edit: the thinker prefilled its context and, a companion in the same message,
    # its image-dropped one.
    assert _thinker_served(served) == thinker_before + 2


def test_ten_jobs_in_a_row_as_the_seeds_curl_sends_them(served: str) -> None:
    """The seed's test plan: its curl request (raw JSON), 10 jobs in a row, all succeed,
    over both DiT replicas: each job's contexts (its own and its companion's) feed one DiT
    request."""
    dits_before = _served_by(served, "dit")
    times = []
    images = []
    with httpx.Client(base_url=served, timeout=120) as http:
        for job in range(10):
            start = time.perf_counter()
            response = http.post("/chat/completions", json=seed_request(input_image(job), job))
            times.append(time.perf_counter() - start)
            assert response.status_code == 200, response.text
            parts = response.json()["choices"][0]["message"]["content"]
            image = decoded(parts[0]["image_url"]["url"].split(",", 1)[1])
            assert image.shape == (SIZE, SIZE, 3)
            images.append(image)
    # Each job its own image (inputs and seeds differ).
    assert len({image.tobytes() for image in images}) == 10
    dits = _served_by(served, "dit")
    jobs = {replica: count - dits_before.get(replica, 0.0) for replica, count in dits.items()}
    assert sum(jobs.values()) == 10
    assert len([count for count in jobs.values() if count > 0]) == 2, jobs
    print(f"10 jobs: {', '.join(f'{t:.2f}' for t in times)} s")


def _dit_in_flight(http: httpx.Client) -> float:
    metrics = http.get("/metrics").text
    for line in metrics.splitlines():
        if line.startswith('omni_stage_in_flight{stage="dit"}'):
            return float(line.split()[-1])
    return 0.0


async def test_a_client_that_goes_away_mid_generation_frees_the_dit(served: str) -> None:
    root = served.removesuffix("/v1")
    # A tenth of the long request's steps, timed here: the long one would take about ten
    # times as long to finish; aborted, the DiT is free within a step.
    with httpx.Client(base_url=served, timeout=120) as http:
        start = time.perf_counter()
        response = http.post("/chat/completions", json=seed_request(input_image(), steps=20))
        tenth = time.perf_counter() - start
        assert response.status_code == 200, response.text
    long_body = seed_request(input_image(), steps=200)
    async with httpx.AsyncClient(base_url=served, timeout=120) as http:
        request = asyncio.create_task(http.post("/chat/completions", json=long_body))
        with httpx.Client(base_url=root, timeout=10) as metrics:
            await asyncio.to_thread(
                wait_until, lambda: _dit_in_flight(metrics) == 1, 60, "the DiT generating"
            )
            request.cancel()  # the connection closes with it
            await asyncio.gather(request, return_exceptions=True)
            await asyncio.to_thread(
                wait_until, lambda: _dit_in_flight(metrics) == 0, 3 * tenth, "the DiT aborting"
            )
    with httpx.Client(base_url=served, timeout=60) as http:
        response = http.post("/chat/completions", json=seed_request(input_image(), steps=2))
        assert response.status_code == 200, response.text


def test_an_edit_is_made_at_the_requested_size_whatever_the_photos(
    served: str, generator: BagelGenerator
) -> None:
    """The seed's 64x64 asked of a 96x48 photo: BAGEL's transform resizes the photo for
    the context, and the DiT makes the requested canvas (as vllm-omni's BAGEL does); asked
    nothing, the edit is the photo's size after that transform."""
    photo = np.random.default_rng(9).integers(0, 256, (48, 96, 3), dtype=np.uint8)
    body = seed_request(photo, steps=2)
    with httpx.Client(base_url=served, timeout=120) as http:
        response = http.post("/chat/completions", json=body)
        assert response.status_code == 200, response.text
        parts = response.json()["choices"][0]["message"]["content"]
        assert decoded(parts[0]["image_url"]["url"].split(",", 1)[1]).shape == (SIZE, SIZE, 3)
        unsized = {k: v for k, v in body.items() if k not in ("height", "width")}
        response = http.post("/chat/completions", json=unsized)
        assert response.status_code == 200, response.text
        parts = response.json()["choices"][0]["message"]["content"]
        width, height = generator.shape.vae_transform.size_for(96, 48)
        assert (width, height) != (SIZE, SIZE)
        image = decoded(parts[0]["image_url"]["url"].split(",", 1)[1])
        assert image.shape == (height, width, 3)


def test_a_prompt_that_fakes_an_images_frame_is_refused_by_the_thinker(served: str) -> None:
    body = {"model": "tiny-bagel", "prompt": "a cat <|vision_start|>", "size": "64x64"}
    with httpx.Client(base_url=served, timeout=60) as http:
        response = http.post("/images/generations", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert "<|vision_start|>" in error["message"]


@pytest.mark.parametrize(
    ("change", "param", "says"),
    [
        ({"height": 60, "width": 60}, "height", "multiple of 16"),
        ({"height": 256, "width": 256}, "height", "at most 128"),
        ({"cfg_interval": [0.9, 0.1]}, "cfg_interval", "low < high"),
        ({"true_cfg_scale": 3.0}, "true_cfg_scale", "unknown parameter"),
        ({"guidance_scale": 3.0, "cfg_text_scale": 2.0}, "guidance_scale", "not both"),
    ],
)
def test_bad_parameters_are_refused_by_name(
    served: str, change: dict[str, Any], param: str, says: str
) -> None:
    body = {**seed_request(input_image(), steps=2), **change}
    with httpx.Client(base_url=served, timeout=60) as http:
        response = http.post("/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert says in error["message"]
