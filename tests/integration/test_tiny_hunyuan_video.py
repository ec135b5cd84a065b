"""The tiny HunyuanVideo-1.5 checkpoint (``tiny_models.hunyuan_video``) run by diffusers' own
pipelines: text-to-video, image-to-video, the Qwen embeddings recipe the encoder stage will
reproduce, and the DiT run on handed-over embeddings without the Qwen encoder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omni_runtime.tiny_models._tokenizer import build_qwen_tokenizer
from omni_runtime.tiny_models.hunyuan_video import (
    LATENT_CHANNELS,
    SPATIAL_COMPRESSION,
    TEMPORAL_COMPRESSION,
    TEXT_LAYERS,
    build_hunyuan_video,
    build_hunyuan_video_i2v,
)
from omni_runtime.tiny_models.qwen_image import MAX_POSITIONS

pytestmark = pytest.mark.integration

# Quoted text is what ByT5 (text_encoder_2) reads: with it both text encoders condition the
# DiT, and a handed-over run must get both right.
PROMPT = 'a red cat walks under a sign that says "OPEN"'
# The smallest sizes are multiples of the VAE's 16x spatial compression; a non-square one so
# that a height/width swap shows. Frames: 4k + 1 (4x temporal compression after the first).
HEIGHT, WIDTH = 16, 32
NUM_FRAMES = 5
STEPS = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("hunyuan-video") / "hunyuan-video-1.5"
    build_hunyuan_video(target, build_qwen_tokenizer(model_max_length=MAX_POSITIONS))
    return target


@pytest.fixture(scope="module")
def pipeline(checkpoint: Path) -> Any:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(checkpoint, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def dit_pipeline(checkpoint: Path) -> Any:
    """The DiT stage's view: the checkpoint without the Qwen encoder and its tokenizer."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(
        checkpoint, text_encoder=None, tokenizer=None, local_files_only=True
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _frames(pipe: Any, seed: int, **inputs: Any) -> np.ndarray:
    video: np.ndarray = pipe(
        num_frames=NUM_FRAMES,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
        **inputs,
    ).frames
    return video


def _config(checkpoint: Path, component: str, name: str = "config.json") -> dict[str, Any]:
    config: dict[str, Any] = json.loads((checkpoint / component / name).read_text())
    return config


def test_checkpoint_is_laid_out_as_the_real_one(checkpoint: Path) -> None:
    index = json.loads((checkpoint / "model_index.json").read_text())
    assert index["_class_name"] == "HunyuanVideo15Pipeline"
    assert {name: value for name, value in index.items() if not name.startswith("_")} == {
        "text_encoder": ["transformers", "Qwen2_5_VLTextModel"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer_2": ["transformers", "ByT5Tokenizer"],
        "transformer": ["diffusers", "HunyuanVideo15Transformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLHunyuanVideo15"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "guider": ["diffusers", "ClassifierFreeGuidance"],
    }
    text = _config(checkpoint, "text_encoder")
    byt5 = _config(checkpoint, "text_encoder_2")
    siglip = _config(checkpoint, "image_encoder")
    transformer = _config(checkpoint, "transformer")
    vae = _config(checkpoint, "vae")
    # The real checkpoint's text encoder is Qwen2.5-VL's language model alone.
    assert text["model_type"] == "qwen2_5_vl_text"
    # hidden_states[-3] must be a decoder layer's output, not the embeddings.
    assert text["num_hidden_layers"] == TEXT_LAYERS > 2
    # Every width one component hands another.
    assert transformer["text_embed_dim"] == text["hidden_size"]
    assert transformer["text_embed_2_dim"] == byt5["d_model"]
    assert transformer["image_embed_dim"] == siglip["hidden_size"]
    assert transformer["in_channels"] == 2 * vae["latent_channels"] + 1
    assert transformer["out_channels"] == vae["latent_channels"] == LATENT_CHANNELS
    assert sum(transformer["rope_axes_dim"]) == transformer["attention_head_dim"]
    assert vae["spatial_compression_ratio"] == SPATIAL_COMPRESSION
    assert vae["temporal_compression_ratio"] == TEMPORAL_COMPRESSION
    assert _config(checkpoint, "scheduler", "scheduler_config.json")["shift"] == 5.0
    assert _config(checkpoint, "guider", "guider_config.json")["guidance_scale"] == 6.0
    processor = _config(checkpoint, "feature_extractor", "preprocessor_config.json")
    assert processor["size"] == {"height": siglip["image_size"], "width": siglip["image_size"]}


def test_same_seed_same_weights(checkpoint: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    build_hunyuan_video(again, build_qwen_tokenizer(model_max_length=MAX_POSITIONS))
    weights = sorted(path.relative_to(checkpoint) for path in checkpoint.rglob("*.safetensors"))
    assert len(weights) == 5  # text_encoder, text_encoder_2, transformer, vae, image_encoder
    for path in weights:
        assert (checkpoint / path).read_bytes() == (again / path).read_bytes(), path


def test_text_to_video(pipeline: Any) -> None:
    assert type(pipeline).__name__ == "HunyuanVideo15Pipeline"
    frames = _frames(pipeline, 0, prompt=PROMPT, height=HEIGHT, width=WIDTH)
    assert frames.shape == (1, NUM_FRAMES, HEIGHT, WIDTH, 3)
    assert frames.dtype == np.float32
    assert frames.min() >= 0.0
    assert frames.max() <= 1.0
    assert frames.std() > 0.01
    again = _frames(pipeline, 0, prompt=PROMPT, height=HEIGHT, width=WIDTH)
    assert frames.tobytes() == again.tobytes()
    other_seed = _frames(pipeline, 1, prompt=PROMPT, height=HEIGHT, width=WIDTH)
    assert np.abs(frames - other_seed).max() > 0.01
    # The text reaches the frames.
    other_prompt = _frames(pipeline, 0, prompt="a blue dog", height=HEIGHT, width=WIDTH)
    assert np.abs(frames - other_prompt).max() > 1e-3


def _template_states(pipe: Any, user: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder stage's recipe, written out: the system template around the prompt,
    padded to crop + max length, the residual stream two layers before the end
    (``hidden_states[-3]``), the template's first rows dropped with their mask."""
    crop = pipe.prompt_template_encode_start_idx
    text = pipe.tokenizer.apply_chat_template(
        [{"role": "system", "content": pipe.system_message}, {"role": "user", "content": user}],
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = pipe.tokenizer(
        text,
        padding="max_length",
        max_length=pipe.tokenizer_max_length + crop,
        truncation=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        states = pipe.text_encoder(**inputs, output_hidden_states=True).hidden_states
    assert len(states) == TEXT_LAYERS + 1
    return states[TEXT_LAYERS - 2][:, crop:], inputs.attention_mask[:, crop:]


def test_qwen_embeddings_are_the_template_states_two_layers_before_the_end(
    pipeline: Any,
) -> None:
    assert pipeline.prompt_template_encode_start_idx == 108
    assert pipeline.tokenizer_max_length == 1000
    with torch.no_grad():
        embeds, mask, byt5, byt5_mask = pipeline.encode_prompt(PROMPT, dtype=torch.float32)
        negative, negative_mask, _, negative_byt5_mask = pipeline.encode_prompt(
            None, dtype=torch.float32
        )
    states, attention = _template_states(pipeline, PROMPT)
    assert embeds.shape == (1, 1000, pipeline.text_encoder.config.hidden_size)
    assert torch.equal(embeds, states)
    assert torch.equal(mask, attention.float())
    # Right padding: the kept rows are a prefix.
    kept = int(mask.sum())
    assert 0 < kept < 1000
    assert bool(mask[0, :kept].all())
    # No negative prompt: the empty one, which the template writes as one space.
    negative_states, negative_attention = _template_states(pipeline, " ")
    assert torch.equal(negative, negative_states)
    assert torch.equal(negative_mask, negative_attention.float())
    # ByT5 reads the quoted text only, as 'Text "OPEN". ' (13 bytes and </s>), and an
    # unquoted prompt (the empty negative) gets zero rows, all masked.
    assert byt5.shape == (1, 256, byt5.shape[-1])
    assert int(byt5_mask.sum()) == 14
    assert int(negative_byt5_mask.sum()) == 0


def test_image_to_video(checkpoint: Path) -> None:
    # transformers' SiglipImageProcessor needs torchvision; scripts/setup.sh installs it.
    pytest.importorskip("torchvision", reason="SiglipImageProcessor needs torchvision")
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipImageProcessor, SiglipVisionModel

    # The t2v checkpoint's model_index.json names no image encoder (the real i2v ones do):
    # its components come from their folders.
    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(
        checkpoint,
        image_encoder=SiglipVisionModel.from_pretrained(checkpoint / "image_encoder"),
        feature_extractor=SiglipImageProcessor.from_pretrained(checkpoint / "feature_extractor"),
        local_files_only=True,
    )
    pipe.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (40, 80, 3), dtype=np.uint8)) for _ in range(2)]
    first = _frames(pipe, 0, image=images[0], prompt=PROMPT)
    # The size is the transformer's target_size bucket (32 px here) closest to the image's
    # aspect ratio: 1:2 gives 16x32.
    assert first.shape == (1, NUM_FRAMES, 16, 32, 3)
    assert first.min() >= 0.0
    assert first.max() <= 1.0
    assert first.tobytes() == _frames(pipe, 0, image=images[0], prompt=PROMPT).tobytes()
    second = _frames(pipe, 0, image=images[1], prompt=PROMPT)
    assert np.abs(first - second).max() > 1e-3


def test_the_image_to_video_layout_shares_the_weights(checkpoint: Path, tmp_path: Path) -> None:
    """The i2v checkpoint is the 480p_i2v one's layout over the same files: its index names
    the image-to-video pipeline and its SigLIP components, which load without being given,
    and the one file that differs (the transformer's config) is its own."""
    pytest.importorskip("torchvision", reason="SiglipImageProcessor needs torchvision")
    from diffusers import DiffusionPipeline

    target = tmp_path / "hunyuan-video-1.5-i2v"
    build_hunyuan_video_i2v(target, checkpoint)
    pipe = DiffusionPipeline.from_pretrained(target, local_files_only=True)
    assert type(pipe).__name__ == "HunyuanVideo15ImageToVideoPipeline"
    assert pipe.image_encoder is not None
    assert pipe.feature_extractor is not None
    assert pipe.transformer.config.task_type == "i2v"
    assert _config(checkpoint, "transformer")["task_type"] == "t2v"
    for weights in (
        "transformer/diffusion_pytorch_model.safetensors",
        "image_encoder/model.safetensors",
        "text_encoder/model.safetensors",
    ):
        assert (target / weights).samefile(checkpoint / weights), weights
    assert not (target / "transformer" / "config.json").samefile(
        checkpoint / "transformer" / "config.json"
    )
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 80, 3), np.uint8))
    frames = _frames(pipe, 0, image=image, prompt=PROMPT)
    assert frames.shape == (1, NUM_FRAMES, 16, 32, 3)


def test_dit_without_qwen_encoder_matches_the_whole_pipeline(
    pipeline: Any, dit_pipeline: Any
) -> None:
    assert dit_pipeline.text_encoder is None
    assert dit_pipeline.tokenizer is None
    whole = _frames(pipeline, 0, prompt=PROMPT, height=HEIGHT, width=WIDTH)
    # Under no_grad, as the pipeline's __call__ runs it: the ByT5 encoder's output differs
    # by ~1e-6 with autograd on.
    with torch.no_grad():
        embeds, mask, _, _ = pipeline.encode_prompt(PROMPT, dtype=torch.float32)
        negative, negative_mask, _, _ = pipeline.encode_prompt(None, dtype=torch.float32)

    def run(embeds: torch.Tensor, negative: torch.Tensor) -> np.ndarray:
        # The DiT stage still encodes the prompt's glyph text with ByT5 itself: the
        # pipeline takes no prompt with prompt_embeds, so ByT5's embeddings are passed too.
        with torch.no_grad():
            _, _, byt5, byt5_mask = dit_pipeline.encode_prompt(
                PROMPT, dtype=torch.float32, prompt_embeds=embeds, prompt_embeds_mask=mask
            )
            _, _, negative_byt5, negative_byt5_mask = dit_pipeline.encode_prompt(
                None,
                dtype=torch.float32,
                prompt_embeds=negative,
                prompt_embeds_mask=negative_mask,
            )
        return _frames(
            dit_pipeline,
            0,
            height=HEIGHT,
            width=WIDTH,
            prompt_embeds=embeds,
            prompt_embeds_mask=mask,
            prompt_embeds_2=byt5,
            prompt_embeds_mask_2=byt5_mask,
            negative_prompt_embeds=negative,
            negative_prompt_embeds_mask=negative_mask,
            negative_prompt_embeds_2=negative_byt5,
            negative_prompt_embeds_mask_2=negative_byt5_mask,
        )

    assert run(embeds, negative).tobytes() == whole.tobytes()
    # The masked rows never reach the frames: an encoder stage may hand over the kept rows
    # only, and the DiT pad them with zeros to the 1000 rows.
    zeroed = run(embeds * mask[..., None], negative * negative_mask[..., None])
    assert zeroed.tobytes() == whole.tobytes()
