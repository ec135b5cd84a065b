"""The tiny models: built from configs, loadable by their libraries, made to fit together."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from PIL import Image
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from omni_runtime.tiny_models import (
    DIFFUSION_SUBDIR,
    HIDDEN_SIZE,
    LLM_SUBDIR,
    QWEN3_OMNI_SUBDIR,
    QWEN_IMAGE_EDIT_PLUS_SUBDIR,
    QWEN_IMAGE_EDIT_SUBDIR,
    QWEN_IMAGE_SUBDIR,
    Z_IMAGE_SUBDIR,
    ensure_tiny_models,
)

pytestmark = pytest.mark.integration


def test_llm_is_a_chat_model_vllm_can_run(tiny_models: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_models / LLM_SUBDIR)
    assert config.model_type == "qwen2"
    assert config.hidden_size == HIDDEN_SIZE
    # vLLM's CPU attention kernels need head_dim >= 32.
    assert config.hidden_size // config.num_attention_heads >= 32
    tokenizer = AutoTokenizer.from_pretrained(tiny_models / LLM_SUBDIR)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "draw a red cat"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\ndraw a red cat<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(prompt)["input_ids"]
    assert tokenizer.decode(ids) == prompt
    model = AutoModelForCausalLM.from_pretrained(tiny_models / LLM_SUBDIR)
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert len(ids) < out.shape[1] <= len(ids) + 4


def test_diffusion_conditioning_width_is_the_llms_hidden_size(tiny_models: Path) -> None:
    index = json.loads((tiny_models / DIFFUSION_SUBDIR / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    unet = json.loads((tiny_models / DIFFUSION_SUBDIR / "unet" / "config.json").read_text())
    llm = json.loads((tiny_models / LLM_SUBDIR / "config.json").read_text())
    assert unet["cross_attention_dim"] == llm["hidden_size"] == HIDDEN_SIZE


def test_built_once_per_directory(tiny_models: Path) -> None:
    weights = tiny_models / LLM_SUBDIR / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_tiny_models(tiny_models) == tiny_models
    assert weights.stat().st_mtime_ns == before


def test_same_seed_same_weights(tiny_models: Path, tmp_path: Path) -> None:
    again = ensure_tiny_models(tmp_path)
    # Qwen3-Omni's talker experts were left uninitialised by transformers: a build that
    # stopped drawing them would differ here.
    subs = [LLM_SUBDIR, f"{DIFFUSION_SUBDIR}/unet", QWEN3_OMNI_SUBDIR]
    for family in (
        QWEN_IMAGE_SUBDIR,
        QWEN_IMAGE_EDIT_SUBDIR,
        QWEN_IMAGE_EDIT_PLUS_SUBDIR,
        Z_IMAGE_SUBDIR,
    ):
        subs += [f"{family}/{component}" for component in ("text_encoder", "transformer", "vae")]
    for sub in subs:
        (a,) = (tiny_models / sub).glob("*.safetensors")
        (b,) = (again / sub).glob("*.safetensors")
        assert a.read_bytes() == b.read_bytes()


# --- The three diffusers families: Qwen-Image, Qwen-Image-Edit, Z-Image -------------------

FAMILIES = {
    QWEN_IMAGE_SUBDIR: "QwenImagePipeline",
    QWEN_IMAGE_EDIT_SUBDIR: "QwenImageEditPipeline",
    Z_IMAGE_SUBDIR: "ZImagePipeline",
}
PROMPT = "draw a red cat under the moon"
NEGATIVE = "a dark old photo"
# The smallest size all three accept (a multiple of vae_scale_factor * 2 = 16), two steps,
# and real classifier-free guidance, so the negative prompt's path runs too.
SIZE = 64
STEPS = 2
GUIDANCE = 3.0


def _edit_input() -> Image.Image:
    # Whatever its size, the edit pipeline resizes it to about 1024x1024 for the VAE.
    pixels = np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


EDIT_INPUT = _edit_input()


def _load(path: Path, **components: None) -> Any:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe: Any, family: str, seed: int, **inputs: Any) -> np.ndarray:
    args: dict[str, Any] = {
        "height": SIZE,
        "width": SIZE,
        "num_inference_steps": STEPS,
        "generator": torch.Generator().manual_seed(seed),
        "output_type": "np",
    }
    if family == Z_IMAGE_SUBDIR:
        args["guidance_scale"] = GUIDANCE
    else:
        args["true_cfg_scale"] = GUIDANCE
    if family == QWEN_IMAGE_EDIT_SUBDIR:
        args["image"] = EDIT_INPUT
    images: np.ndarray = pipe(**args, **inputs).images
    return images


def _prompt_embeddings(pipe: Any, family: str) -> dict[str, Any]:
    """What the DiT stage is handed instead of text: the full pipeline's own encodings."""
    if family == Z_IMAGE_SUBDIR:
        embeds, negative = pipe.encode_prompt(
            PROMPT, do_classifier_free_guidance=True, negative_prompt=NEGATIVE
        )
        return {"prompt_embeds": embeds, "negative_prompt_embeds": negative}
    extra: dict[str, Any] = {}
    if family == QWEN_IMAGE_EDIT_SUBDIR:
        # The image the pipeline itself hands the processor: resized to ~1024x1024.
        width, height, _ = calculate_dimensions(1024 * 1024, EDIT_INPUT.width / EDIT_INPUT.height)
        extra["image"] = pipe.image_processor.resize(EDIT_INPUT, height, width)
    embeds, mask = pipe.encode_prompt(PROMPT, **extra)
    negative, negative_mask = pipe.encode_prompt(NEGATIVE, **extra)
    return {
        "prompt_embeds": embeds,
        "prompt_embeds_mask": mask,
        "negative_prompt_embeds": negative,
        "negative_prompt_embeds_mask": negative_mask,
    }


def _parameter_bytes(module: Any) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _pipeline_parameter_bytes(pipe: Any) -> int:
    modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    return sum(_parameter_bytes(module) for module in modules)


FullRuns = dict[str, tuple[Any, np.ndarray]]


@pytest.fixture(scope="module")
def full_runs() -> FullRuns:
    """Per family, once: the full pipeline and its image for seed 0 (see _full_run)."""
    return {}


def _full_run(runs: FullRuns, tiny_models: Path, family: str) -> tuple[Any, np.ndarray]:
    if family not in runs:
        if family == QWEN_IMAGE_EDIT_SUBDIR:
            # Its processor's video half cannot load without it (the real checkpoint's
            # neither); scripts/setup.sh installs it.
            pytest.importorskip("torchvision", reason="Qwen2VLProcessor needs torchvision")
        pipe = _load(tiny_models / family)
        runs[family] = (pipe, _generate(pipe, family, 0, prompt=PROMPT, negative_prompt=NEGATIVE))
    return runs[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_checkpoint_is_laid_out_as_diffusers_saves_it(
    tiny_models: Path, family: str
) -> None:
    from safetensors.torch import load_file

    path = tiny_models / family
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == FAMILIES[family]
    assert index["tokenizer"] == ["transformers", "Qwen2Tokenizer"]
    for component in ("scheduler", "text_encoder", "tokenizer", "transformer", "vae"):
        assert (path / component).is_dir(), component
    assert ("processor" in index) == (family == QWEN_IMAGE_EDIT_SUBDIR)

    config = AutoConfig.from_pretrained(path / "text_encoder")
    text = config.get_text_config()
    transformer = json.loads((path / "transformer" / "config.json").read_text())
    weights = load_file(path / "text_encoder" / "model.safetensors")
    tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
    if family == Z_IMAGE_SUBDIR:
        assert index["text_encoder"] == ["transformers", "Qwen3Model"]
        assert transformer["cap_feat_dim"] == text.hidden_size
        assert text.num_hidden_layers == 3
        final_norm = weights["norm.weight"]
    else:
        assert index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
        assert transformer["joint_attention_dim"] == text.hidden_size
        # The ids the model gives its vision placeholders are the tokenizer's tokens.
        for field, token in [
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        ]:
            assert getattr(config, field) == tokenizer.convert_tokens_to_ids(token), field
        assert config.vision_config.out_hidden_size == text.hidden_size
        final_norm = weights["model.norm.weight"]  # saved in the original checkpoint layout
    assert text.hidden_size == HIDDEN_SIZE
    # vLLM's CPU attention kernels need head_dim >= 32.
    assert (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads) >= 32
    assert len(tokenizer) <= text.vocab_size
    # Norm weights of ones would hide a final norm left out or added by a reimplementation.
    assert final_norm.min() >= 0.5
    assert final_norm.max() <= 1.5
    assert final_norm.std() > 0.1
    for token in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]:
        assert tokenizer.convert_ids_to_tokens(tokenizer.convert_tokens_to_ids(token)) == token


@pytest.mark.parametrize("family", FAMILIES)
def test_family_generates_deterministically(
    tiny_models: Path, full_runs: FullRuns, family: str
) -> None:
    pipe, image = _full_run(full_runs, tiny_models, family)
    assert image.shape == (1, SIZE, SIZE, 3)
    assert np.isfinite(image).all()
    assert image.std() > 0
    again = _generate(pipe, family, 0, prompt=PROMPT, negative_prompt=NEGATIVE)
    np.testing.assert_array_equal(again, image)
    other_seed = _generate(pipe, family, 1, prompt=PROMPT, negative_prompt=NEGATIVE)
    assert np.abs(other_seed - image).max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_family_runs_without_its_text_encoder_from_prompt_embeddings(
    tiny_models: Path, full_runs: FullRuns, family: str
) -> None:
    full, image = _full_run(full_runs, tiny_models, family)
    # How the DiT stage loads it: the text encoder (and what feeds it) left out.
    left_out = {"text_encoder": None, "tokenizer": None}
    if family == QWEN_IMAGE_EDIT_SUBDIR:
        left_out["processor"] = None
    bare = _load(tiny_models / family, **left_out)
    assert bare.text_encoder is None
    assert bare.tokenizer is None
    embeddings = _prompt_embeddings(full, family)
    np.testing.assert_allclose(_generate(bare, family, 0, **embeddings), image, atol=1e-6)
    assert _pipeline_parameter_bytes(bare) == (
        _pipeline_parameter_bytes(full) - _parameter_bytes(full.text_encoder)
    )


@pytest.mark.parametrize("family", [QWEN_IMAGE_SUBDIR, QWEN_IMAGE_EDIT_SUBDIR])
def test_qwen_templates_are_longer_than_the_rows_the_pipeline_drops(
    tiny_models: Path, family: str
) -> None:
    # The pipelines drop the template's first rows by a count fitted to the real tokenizer
    # (34, 64). Here the system text before the user's turn (and, for the edit, before the
    # image) must be longer, so that what is dropped is all system text.
    left_out = {"text_encoder": None}
    if family == QWEN_IMAGE_EDIT_SUBDIR:
        left_out["processor"] = None
    pipe = _load(tiny_models / family, **left_out)
    template: str = pipe.prompt_template_encode
    before = template.split("<|vision_start|>")[0].split("{}")[0]
    assert len(pipe.tokenizer(before)["input_ids"]) > pipe.prompt_template_encode_start_idx


def test_z_image_chat_template_honours_thinking_and_the_generation_prompt(
    tiny_models: Path,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_models / Z_IMAGE_SUBDIR / "tokenizer")
    messages = [{"role": "user", "content": PROMPT}]
    turn = f"<|im_start|>user\n{PROMPT}<|im_end|>\n"

    def render(**kwargs: Any) -> str:
        text: str = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        return text

    assert render(add_generation_prompt=False) == turn
    # What ZImagePipeline asks for: thinking on adds nothing, as in Qwen3's template.
    assert render(add_generation_prompt=True, enable_thinking=True) == (
        turn + "<|im_start|>assistant\n"
    )
    assert render(add_generation_prompt=True) == turn + "<|im_start|>assistant\n"
    assert render(add_generation_prompt=True, enable_thinking=False) == (
        turn + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    ids = tokenizer(render(add_generation_prompt=True, enable_thinking=False))["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<think>") in ids


def test_every_file_is_readable_by_every_user(tiny_models: Path) -> None:
    """An image bakes the models as root for a runtime that runs as another user
    (safetensors itself writes 0600). The root directory is the caller's to choose."""
    unreadable = [
        str(path.relative_to(tiny_models))
        for path in tiny_models.rglob("*")
        if path.stat().st_mode & (0o005 if path.is_dir() else 0o004)
        != (0o005 if path.is_dir() else 0o004)
    ]
    assert unreadable == []
