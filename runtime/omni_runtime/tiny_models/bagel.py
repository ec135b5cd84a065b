"""A tiny BAGEL checkpoint, in the files and names of ByteDance-Seed/BAGEL-7B-MoT.

``config.json`` (a ``bagel`` config with its nested LLM and ViT configs), ``llm_config.json``
and ``vit_config.json`` (the ViT's as SigLIP's, one layer more than BAGEL runs, as the
released file says 27 for 26), ``ema.safetensors`` (bf16, the model's names),
``ae.safetensors`` (a FLUX-shaped VAE in Black Forest Labs' names) and a Qwen2 tokenizer.
The real checkpoint loads through the same code (``omni_runtime.modeling.bagel``).

Scaled down: a 2-layer MoT LLM of width 128 (head_dim 32, which vLLM's CPU attention
takes), a 2-layer SigLIP of width 128 on 14-pixel patches, a VAE with 32 channels at every
level (still 8x down, 16 latent channels), and image transforms sized for 64-pixel images:
a 64x64 image is 4x4 latent tokens and 4x4 ViT patches. ``config.json`` carries the VAE's
dimensions and the transforms, which the official code hard-codes for the real model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._common import SEED, randomize_rms_norms

# Qwen's tokenizer here has 490 tokens; the embedding is padded as Qwen pads its own.
VOCAB_SIZE = 512
MAX_POSITIONS = 4096
LATENT_SIDE = 8  # latent tokens per side: images up to 128 pixels
VIT_SIDE = 8  # ViT patches per side: images up to 112 pixels
TINY_VAE = {"ch": 32, "ch_mult": [1, 1, 1, 1], "num_res_blocks": 1}

_LLM_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": MAX_POSITIONS,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "vocab_size": VOCAB_SIZE,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    # What BAGEL's loaders set on Qwen2's config: q/k norms and the MoT layer.
    "qk_norm": True,
    "layer_module": "Qwen2MoTDecoderLayer",
}
_VIT_LAYERS = 2
_VIT_CONFIG: dict[str, Any] = {
    "model_type": "siglip_vision_model",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_channels": 3,
    "patch_size": 14,
    "image_size": 14 * VIT_SIDE,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh",
    "attention_dropout": 0.0,
}


_PREPROCESSOR_CONFIG: dict[str, Any] = {
    "image_processor_type": "SiglipImageProcessor",
    "do_convert_rgb": True,
    "do_resize": True,
    "size": {"height": 14 * VIT_SIDE, "width": 14 * VIT_SIDE},
    "resample": 3,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def bagel_config() -> dict[str, Any]:
    """The tiny checkpoint's config.json."""
    return {
        "architectures": ["BagelForConditionalGeneration"],
        "model_type": "bagel",
        "visual_gen": True,
        "visual_und": True,
        "llm_config": _LLM_CONFIG,
        "vit_config": {**_VIT_CONFIG, "num_hidden_layers": _VIT_LAYERS},
        "vae_config": {"z_channels": 16, "downsample": 8, **TINY_VAE},
        "latent_patch_size": 2,
        "max_latent_size": LATENT_SIDE,
        "vit_max_num_patch_per_side": VIT_SIDE,
        "connector_act": "gelu_pytorch_tanh",
        "interpolate_pos": False,
        "timestep_shift": 1.0,
        # (longest side, shortest side, stride) of the VAE's and the ViT's input images.
        "vae_transform": [64, 32, 16],
        "vit_transform": [112, 28, 14],
    }


def build_bagel(path: Path, tokenizer: Any) -> None:
    """Write the tiny BAGEL checkpoint to ``path`` (``tokenizer``: build_qwen_tokenizer's)."""
    import torch
    from safetensors.torch import save_file

    from omni_runtime.modeling.bagel.config import (
        CONFIG,
        LLM_CONFIG,
        MODEL_WEIGHTS,
        VAE_WEIGHTS,
        VIT_CONFIG,
        read_bagel_shape,
        shape_from_config,
    )
    from omni_runtime.modeling.bagel.model import BagelModel
    from omni_runtime.modeling.bagel.vae import bfl_state_dict, build_autoencoder

    path.mkdir(parents=True)
    config = bagel_config()
    (path / CONFIG).write_text(json.dumps(config, indent=2))
    (path / LLM_CONFIG).write_text(json.dumps(_LLM_CONFIG, indent=2))
    (path / VIT_CONFIG).write_text(
        json.dumps({**_VIT_CONFIG, "num_hidden_layers": _VIT_LAYERS + 1}, indent=2)
    )
    tokenizer.save_pretrained(path)
    _write_slow_tokenizer_files(path)
    # What vLLM's BAGEL (the thinker) reads images with: SigLIP's processor.
    (path / "preprocessor_config.json").write_text(json.dumps(_PREPROCESSOR_CONFIG, indent=2))

    torch.manual_seed(SEED)
    # The depths that read_bagel_shape will find in the weights written here.
    shape = shape_from_config(config, _VIT_LAYERS, LATENT_SIDE**2)
    model = BagelModel(shape)
    randomize_rms_norms(model, SEED)
    with torch.no_grad():
        # The padding rows past the tokenizer's tokens score 0, below the real tokens' best
        # (random weights would make them likely): a greedy plan (think mode) then writes
        # only tokens the tokenizer can decode, as a trained model's does.
        model.language_model.lm_head.weight[len(tokenizer) :] = 0.0
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / MODEL_WEIGHTS))

    autoencoder = build_autoencoder(shape.vae)
    levels = len(shape.vae.ch_mult)
    vae_state = {
        k: v.contiguous() for k, v in bfl_state_dict(autoencoder.state_dict(), levels).items()
    }
    save_file(vae_state, str(path / VAE_WEIGHTS))
    if read_bagel_shape(path) != shape:
        raise RuntimeError("the tiny BAGEL checkpoint does not read back as it was built")


def _write_slow_tokenizer_files(path: Path) -> None:
    """vocab.json and merges.txt beside tokenizer.json, and the added tokens in
    tokenizer_config.json, as the released checkpoint has them: transformers 5 writes only
    tokenizer.json, and the Python Qwen2Tokenizer (BAGEL's own code uses one) reads these."""
    fast = json.loads((path / "tokenizer.json").read_text())
    added = {token["content"]: token for token in fast["added_tokens"]}
    vocab = {k: v for k, v in fast["model"]["vocab"].items() if k not in added}
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    merges = [" ".join(m) if isinstance(m, list) else m for m in fast["model"]["merges"]]
    (path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["added_tokens_decoder"] = {
        str(token["id"]): {k: v for k, v in token.items() if k != "id"} for token in added.values()
    }
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
