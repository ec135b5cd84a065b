"""Tiny Qwen-Image and Qwen-Image-Edit checkpoints, laid out as the real ones are.

Shapes follow the real models scaled down: a Qwen2.5-VL text encoder (with a vision tower,
which the class always has and the edit pipeline uses) whose hidden states condition an
MMDiT (``joint_attention_dim`` = the text width), a 16-channel causal-3D VAE with 8x
spatial compression, and Qwen-Image's flow-matching schedule.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ._common import HIDDEN_SIZE, SEED, randomize_rms_norms
from ._tokenizer import QWEN_BPE_SIZE

# The text model's vocabulary rows: the tokenizer's 490 tokens, padded as Qwen pads its own.
QWEN_VOCAB_SIZE = 512
TEXT_LAYERS = 2
MAX_POSITIONS = 4096
# What the edit pipeline's processor lets through to the ViT: the image is resized to at
# most 112x112 pixels, 8x8 patches of 14, merged 2x2 into 16 placeholder tokens.
PROCESSOR_MIN_PIXELS = 56 * 56
PROCESSOR_MAX_PIXELS = 112 * 112
LATENT_CHANNELS = 16

# What Qwen2VLProcessor.save_pretrained writes for these sizes, every key spelled out:
# vLLM's processing of images came out different with image_mean/image_std left to defaults.
_CLIP_NORMALIZATION: dict[str, Any] = {
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
_VISION_INPUT: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    **_CLIP_NORMALIZATION,
    "merge_size": 2,
    "patch_size": 14,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": PROCESSOR_MAX_PIXELS, "shortest_edge": PROCESSOR_MIN_PIXELS},
    "temporal_patch_size": 2,
}
_PROCESSOR_CONFIG: dict[str, Any] = {
    "image_processor": {**_VISION_INPUT, "image_processor_type": "Qwen2VLImageProcessor"},
    "processor_class": "Qwen2VLProcessor",
    "video_processor": {
        **_VISION_INPUT,
        "do_sample_frames": False,
        "max_frames": 768,
        "max_video_tokens": 128000,
        "min_frames": 4,
        "return_metadata": False,
        "video_processor_type": "Qwen2VLVideoProcessor",
    },
}

# Qwen-Image's scheduler_config.json.
_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}


def build_qwen_image(path: Path, edit_path: Path, edit_plus_path: Path, tokenizer: Any) -> None:
    """Write the text-to-image checkpoint to ``path``, the edit one to ``edit_path`` and the
    several-image edit one (Qwen-Image-Edit-2509/2511's pipeline) to ``edit_plus_path``.

    All share the text encoder, the tokenizer (``build_qwen_tokenizer``'s) and the VAE (the
    real Qwen-Image-Edit reuses Qwen-Image's Qwen2.5-VL and VAE); their transformers differ.
    """
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline

    text_encoder = _text_encoder(tokenizer)
    vae = _vae()
    QwenImagePipeline(
        scheduler=_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=_transformer(SEED + 10),
    ).save_pretrained(path)
    for pipeline_class, where, seed in (
        (QwenImageEditPipeline, edit_path, SEED + 11),
        (QwenImageEditPlusPipeline, edit_plus_path, SEED + 12),
    ):
        edit = pipeline_class(
            scheduler=_scheduler(),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            processor=None,
            transformer=_transformer(seed),
        )
        # It warns that the processor (None) "cannot be saved": _save_processor writes it.
        saving = logging.getLogger("diffusers.pipelines.pipeline_utils")
        level = saving.level
        saving.setLevel(logging.ERROR)
        try:
            edit.save_pretrained(where)
        finally:
            saving.setLevel(level)
        _save_processor(where, tokenizer)


def _text_encoder(tokenizer: Any) -> Any:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    head_dim = 32  # vLLM's CPU attention needs >= 32
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": QWEN_VOCAB_SIZE,
            "hidden_size": HIDDEN_SIZE,
            "intermediate_size": 256,
            "num_hidden_layers": TEXT_LAYERS,
            "num_attention_heads": HIDDEN_SIZE // head_dim,
            "num_key_value_heads": 2,
            "max_position_embeddings": MAX_POSITIONS,
            "max_window_layers": TEXT_LAYERS,
            "rms_norm_eps": 1e-6,
            # M-RoPE: head_dim / 2 frequencies split over (time, height, width), in the
            # real model's proportions (16, 24, 24 of 64).
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [4, 6, 6],
            },
            "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
            "out_hidden_size": HIDDEN_SIZE,
        },
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=False,
        dtype="float32",
    )
    if len(tokenizer) > QWEN_VOCAB_SIZE or len(tokenizer) <= QWEN_BPE_SIZE:
        raise RuntimeError(f"a tokenizer of {len(tokenizer)} tokens for {QWEN_VOCAB_SIZE} rows")
    torch.manual_seed(SEED + 1)
    model = Qwen2_5_VLForConditionalGeneration(config)
    randomize_rms_norms(model, SEED + 2)
    return model.eval()


def _vae() -> Any:
    import torch
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(SEED + 3)
    # Real: base_dim 96, num_res_blocks 2. Kept: z_dim 16, dim_mult [1, 2, 4, 4] and the
    # temporal downsampling, so 8x spatial compression, and the real latents_mean/std.
    return AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ).eval()


def _transformer(seed: int) -> Any:
    import torch
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    # 2x2 patches of 16-channel latents in and out; 2 heads of 32, RoPE axes in the real
    # model's proportions (16, 56, 56 of 128).
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=LATENT_CHANNELS * 4,
        out_channels=LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=32,
        num_attention_heads=2,
        joint_attention_dim=HIDDEN_SIZE,
        guidance_embeds=False,
        axes_dims_rope=(8, 12, 12),
    ).eval()


def _scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**_SCHEDULER_CONFIG)


def _save_processor(checkpoint: Path, tokenizer: Any) -> None:
    """Write ``processor/`` (a Qwen2VLProcessor) by hand and name it in model_index.json.

    Qwen2VLProcessor cannot be made without torchvision (its video processor needs it), and
    the build must not: these are the files its ``save_pretrained`` writes. Loading it
    still needs torchvision, as the real checkpoint's does.
    """
    folder = checkpoint / "processor"
    tokenizer.save_pretrained(folder)
    config = json.dumps(_PROCESSOR_CONFIG, indent=2, sort_keys=True)
    (folder / "processor_config.json").write_text(config + "\n")
    index_path = checkpoint / "model_index.json"
    index = json.loads(index_path.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
