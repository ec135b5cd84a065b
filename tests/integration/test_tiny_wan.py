"""The tiny Wan2.2 checkpoint: built from configs, run by diffusers' own Wan pipelines."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, WanImageToVideoPipeline, WanPipeline
from PIL import Image
from transformers import AutoTokenizer

from omni_runtime.tiny_models.wan import LATENT_CHANNELS, TEXT_DIM, build_wan

pytestmark = pytest.mark.integration

# The smallest frames the checkpoint makes: height and width are multiples of 32 (the VAE's
# 16x times the DiT's 2x2 patches), frame counts 4k + 1. Not square, so that a height and
# width swapped anywhere shows in the shape.
HEIGHT, WIDTH, FRAMES = 32, 64, 5
CALL: dict[str, Any] = {
    "height": HEIGHT,
    "width": WIDTH,
    "num_frames": FRAMES,
    "num_inference_steps": 2,
    "output_type": "np",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("tiny-wan") / "wan2.2"
    build_wan(target)
    return target


@pytest.fixture(scope="module")
def pipe(checkpoint: Path) -> Any:
    pipeline = DiffusionPipeline.from_pretrained(checkpoint)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _seed(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _image(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def test_checkpoint_is_laid_out_as_wan22_ti2v_5b(checkpoint: Path) -> None:
    index = json.loads((checkpoint / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["expand_timesteps"] is True
    assert index["boundary_ratio"] is None
    assert index["transformer_2"] == [None, None]
    assert index["scheduler"] == ["diffusers", "UniPCMultistepScheduler"]
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    vae = json.loads((checkpoint / "vae" / "config.json").read_text())
    assert (vae["z_dim"], vae["in_channels"], vae["patch_size"]) == (LATENT_CHANNELS, 12, 2)
    assert (vae["scale_factor_spatial"], vae["scale_factor_temporal"]) == (16, 4)
    assert vae["is_residual"] is True
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == LATENT_CHANNELS
    scheduler = json.loads((checkpoint / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["prediction_type"] == "flow_prediction"
    assert scheduler["use_flow_sigmas"] is True
    assert scheduler["flow_shift"] == 5.0
    size = sum(path.stat().st_size for path in checkpoint.rglob("*") if path.is_file())
    assert size < 8 * 2**20


def test_build_is_deterministic(checkpoint: Path, tmp_path: Path) -> None:
    build_wan(tmp_path / "again")
    assert _tree_digest(tmp_path / "again") == _tree_digest(checkpoint)


def test_tokenizer_is_umt5_shaped(checkpoint: Path, pipe: Any) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint / "tokenizer")
    assert type(tokenizer).__name__ == "T5Tokenizer"
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<pad>", 0)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("</s>", 1)
    assert (tokenizer.unk_token, tokenizer.unk_token_id) == ("<unk>", 2)
    ids = tokenizer("a red cat paints a golden tree").input_ids
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a red cat paints a golden tree"
    assert len(tokenizer) <= pipe.text_encoder.config.vocab_size
    assert pipe.text_encoder.config.d_model == pipe.transformer.config.text_dim == TEXT_DIM


def test_text_to_video(pipe: Any) -> None:
    assert isinstance(pipe, WanPipeline)
    assert pipe.transformer_2 is None
    frames = pipe("a red cat paints a tree", generator=_seed(0), **CALL).frames
    assert frames.shape == (1, FRAMES, HEIGHT, WIDTH, 3)
    assert frames.dtype == np.float32
    assert frames.min() >= 0.0
    assert frames.max() <= 1.0
    assert frames.std() > 0.01  # not a constant picture
    again = pipe("a red cat paints a tree", generator=_seed(0), **CALL).frames
    np.testing.assert_array_equal(frames, again)
    reseeded = pipe("a red cat paints a tree", generator=_seed(1), **CALL).frames
    assert np.abs(frames - reseeded).max() > 0.05
    other_prompt = pipe("a blue boat on a river", generator=_seed(0), **CALL).frames
    assert not np.array_equal(frames, other_prompt)


def test_image_to_video(pipe: Any) -> None:
    # TI2V-5B's image-to-video: the same checkpoint under WanImageToVideoPipeline, with no
    # image encoder (the image conditions through its VAE latents: expand_timesteps pins
    # the first latent frame to them and gives it timestep 0).
    i2v = WanImageToVideoPipeline.from_pipe(pipe)
    assert i2v.image_encoder is None
    assert i2v.config.expand_timesteps is True
    # The prompt is encoded by WanPipeline: WanImageToVideoPipeline cleans a text prompt
    # with ftfy unconditionally, and ftfy is not installed.
    embeds, negative = pipe.encode_prompt("a red cat walks", device="cpu", max_sequence_length=512)

    def run(image: Image.Image, seed: int) -> Any:
        return i2v(
            image=image,
            prompt_embeds=embeds,
            negative_prompt_embeds=negative,
            generator=_seed(seed),
            **CALL,
        ).frames

    frames = run(_image(0), seed=0)
    assert frames.shape == (1, FRAMES, HEIGHT, WIDTH, 3)
    assert frames.min() >= 0.0
    assert frames.max() <= 1.0
    # The first frame is the image's (the VAE is causal in time), whatever the noise...
    reseeded = run(_image(0), seed=1)
    np.testing.assert_array_equal(frames[:, 0], reseeded[:, 0])
    assert np.abs(frames[:, 1:] - reseeded[:, 1:]).max() > 0.05
    # ... and another image's first frame is another.
    other = run(_image(1), seed=0)
    assert np.abs(frames[:, 0] - other[:, 0]).max() > 0.01
    # An image of another size is resized to the frames'.
    resized = run(_image(0).resize((2 * WIDTH, 2 * HEIGHT)), seed=0)
    assert resized.shape == frames.shape


def test_prompt_embeds_without_text_components(checkpoint: Path, pipe: Any) -> None:
    dit_only = DiffusionPipeline.from_pretrained(checkpoint, text_encoder=None, tokenizer=None)
    dit_only.set_progress_bar_config(disable=True)
    assert isinstance(dit_only, WanPipeline)
    assert dit_only.text_encoder is None
    assert dit_only.tokenizer is None
    # 512: what the pipeline's call pads to (encode_prompt's own default is 226).
    embeds, negative = pipe.encode_prompt(
        "a red cat paints a tree", device="cpu", max_sequence_length=512
    )
    assert embeds.shape[-1] == negative.shape[-1] == TEXT_DIM
    frames = dit_only(
        prompt_embeds=embeds, negative_prompt_embeds=negative, generator=_seed(0), **CALL
    ).frames
    assert frames.shape == (1, FRAMES, HEIGHT, WIDTH, 3)
    # The same embeddings as the full pipeline makes from the prompt: the same frames.
    full = pipe("a red cat paints a tree", generator=_seed(0), **CALL).frames
    np.testing.assert_allclose(frames, full, atol=1e-5)
    # Any sequence length of the UMT5 width conditions the DiT.
    short = torch.randn(1, 7, TEXT_DIM, generator=_seed(2))
    frames = dit_only(
        prompt_embeds=short, negative_prompt_embeds=torch.zeros_like(short), **CALL
    ).frames
    assert frames.shape == (1, FRAMES, HEIGHT, WIDTH, 3)
