"""A tiny HunyuanVideo-1.5 checkpoint, laid out as HunyuanVideo-1.5-Diffusers-480p_t2v is.

The real checkpoint (diffusers' ``scripts/convert_hunyuan_video1_5_to_diffusers.py``) holds
Qwen2.5-VL-7B-Instruct's language model alone as ``text_encoder`` (a ``Qwen2_5_VLTextModel``;
the pipeline conditions on its ``hidden_states[-3]``), Glyph-SDXL-v2's ByT5 encoder as
``text_encoder_2`` (glyph text quoted in the prompt), an MMDiT taking 65 channels (noisy
latents, condition latents, condition mask), a 32-channel causal-3D VAE with 16x spatial
and 4x temporal compression, a shift-5 flow-matching schedule and classifier-free guidance
of 6. This one keeps the text encoders' layout and scales the rest down, the VAE's latent
channels too (8 for 32: the VAE holds most of its weights in widths that are multiples
of them); the transformer's ByT5 projection keeps its fixed 2048-wide hidden layer, most
of the checkpoint's ~24 MB.

The image-to-video checkpoints (``..._i2v``) add a SigLIP vision model (``image_encoder``,
FLUX.1-Redux's so400m-patch14-384: 729 tokens of 1152) and its ``feature_extractor``; this
checkpoint carries tiny ones in those folders too, outside ``model_index.json`` as the t2v
checkpoint has them, for ``HunyuanVideo15ImageToVideoPipeline`` to be given.

``build_hunyuan_video_i2v`` lays the same weights out as HunyuanVideo-1.5-Diffusers-480p_i2v
is: a ``model_index.json`` of HunyuanVideo15ImageToVideoPipeline that names the SigLIP
encoder, and the transformer's ``task_type`` i2v (a label: the model reads it nowhere). The
real i2v weights differ from the t2v ones; random tiny ones are as good for either
pipeline, so the files are hard links to the t2v checkpoint's: no second build, no second
copy on disk.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._common import HIDDEN_SIZE, SEED, randomize_rms_norms

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The pipeline reads hidden_states[-3] (two layers skipped): with four layers that is the
# residual stream after two, so the encoder stage has layers to run and layers to skip.
TEXT_LAYERS = 4
# The real VAE's 32 latent channels scaled down to 8: the transformer takes 2 * 8 + 1
# channels (noisy latents, condition latents, condition mask) and returns 8.
LATENT_CHANNELS = 8
SPATIAL_COMPRESSION = 16
TEMPORAL_COMPRESSION = 4
# ByT5's width (real: byt5-small's 1472) and SigLIP's (real: 1152), which the transformer's
# text_embed_2_dim and image_embed_dim must equal.
BYT5_WIDTH = 64
SIGLIP_WIDTH = 32
# SigLIP's input (real: 384 px in 14 px patches, 27 x 27 = 729 tokens): 4 x 4 = 16 tokens.
SIGLIP_IMAGE_SIZE = 56
SIGLIP_PATCH = 14
# The pixel size the pipelines' size buckets are built around (real: 640 for 480p, 960 for
# 720p): image-to-video always takes its size from these buckets, so keep it small.
TARGET_SIZE = 32

# 480p's flow shift and guidance scale, as the conversion script sets them.
_FLOW_SHIFT = 5.0
_GUIDANCE_SCALE = 6.0

# SigLIP so400m-patch14-384's preprocessor_config.json (FLUX.1-Redux ships the same), at the
# tiny input size.
_FEATURE_EXTRACTOR_CONFIG: dict[str, Any] = {
    "do_convert_rgb": None,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"height": SIGLIP_IMAGE_SIZE, "width": SIGLIP_IMAGE_SIZE},
}


def build_hunyuan_video(target: Path, qwen_tokenizer: PreTrainedTokenizerBase) -> None:
    """Write the checkpoint to ``target``, with ``build_qwen_tokenizer``'s tokenizer."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
    from diffusers.guiders import ClassifierFreeGuidance
    from diffusers.utils import logging as diffusers_logging
    from transformers import ByT5Tokenizer

    # A guider's constructor warns that guiders are experimental: news to nobody building
    # test models, and alarming in the main job's first run, which builds them.
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        guider = ClassifierFreeGuidance(guidance_scale=_GUIDANCE_SCALE)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    HunyuanVideo15Pipeline(
        text_encoder=_text_encoder(qwen_tokenizer),
        tokenizer=qwen_tokenizer,
        transformer=_transformer(),
        vae=_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=_FLOW_SHIFT),
        text_encoder_2=_byt5_encoder(),
        # ByT5 reads UTF-8 bytes: 3 specials, 256 bytes, 125 sentinels; no vocabulary file.
        tokenizer_2=ByT5Tokenizer(),
        guider=guider,
    ).save_pretrained(target)
    _image_encoder().save_pretrained(target / "image_encoder")
    folder = target / "feature_extractor"
    folder.mkdir()
    # Written by hand: transformers' SiglipImageProcessor cannot be made without
    # torchvision, and the build must not need it (loading it does, as the real one's does).
    config = {**_FEATURE_EXTRACTOR_CONFIG, "image_processor_type": "SiglipImageProcessor"}
    (folder / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_hunyuan_video_i2v(target: Path, t2v: Path) -> None:
    """Write the image-to-video checkpoint to ``target``, of ``build_hunyuan_video``'s files
    at ``t2v`` (hard links; the two JSON files that differ are written anew)."""
    # diffusers' own spelling of an image-to-video index: the SigLIP components listed.
    index = json.loads((t2v / "model_index.json").read_text())
    index.update(
        _class_name="HunyuanVideo15ImageToVideoPipeline",
        image_encoder=["transformers", "SiglipVisionModel"],
        feature_extractor=["transformers", "SiglipImageProcessor"],
    )
    config = json.loads((t2v / "transformer" / "config.json").read_text())
    config["task_type"] = "i2v"
    target.mkdir(parents=True)
    for component in sorted(path for path in t2v.iterdir() if path.is_dir()):
        # A hard link shares the file: the transformer's config, which differs, is left out
        # and written below, never through a link into the t2v checkpoint.
        shutil.copytree(
            component,
            target / component.name,
            copy_function=os.link,
            ignore=shutil.ignore_patterns("config.json")
            if component.name == "transformer"
            else None,
        )
    (target / "transformer" / "config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n"
    )
    (target / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _text_encoder(tokenizer: Any) -> Any:
    import torch
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    from .qwen_image import _text_encoder as qwen_image_text_encoder

    # Both families' real text encoder is Qwen2.5-VL-7B-Instruct: take Qwen-Image's tiny
    # one's text config (widths, vocabulary, M-RoPE, token ids) and only deepen it. The
    # layer list is derived from the depth, so the config is rebuilt, not edited.
    text_config = qwen_image_text_encoder(tokenizer).config.text_config.to_dict()
    text_config.update(
        num_hidden_layers=TEXT_LAYERS,
        max_window_layers=TEXT_LAYERS,
        layer_types=None,
        dtype="float32",
    )
    config = Qwen2_5_VLTextConfig.from_dict(text_config)
    torch.manual_seed(SEED + 50)
    model = Qwen2_5_VLTextModel(config)
    randomize_rms_norms(model, SEED + 51)
    return model.eval()


def _byt5_encoder() -> Any:
    import torch
    from transformers import T5Config, T5EncoderModel

    # byt5-small's encoder (12 layers of 1472, 6 heads of 64, gated GELU, 384 byte tokens)
    # shrunk: the real one also has the Glyph-SDXL color and font tokens added to its
    # vocabulary, which the pipeline never writes into a prompt.
    config = T5Config(
        vocab_size=384,
        d_model=BYT5_WIDTH,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        tie_word_embeddings=False,
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
        dtype="float32",
    )
    torch.manual_seed(SEED + 52)
    return T5EncoderModel(config).eval()


def _transformer() -> Any:
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(SEED + 53)
    # Real: 54 dual-stream layers, 16 heads of 128, RoPE axes (16, 56, 56). Here 2 layers, 2
    # heads of 32 and axes in the same proportions; the input widths are the tiny encoders'.
    # (Its ByT5 projection has a fixed 2048-wide hidden layer: most of its weight.)
    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT_CHANNELS + 1,
        out_channels=LATENT_CHANNELS,
        num_attention_heads=2,
        attention_head_dim=32,
        num_layers=2,
        num_refiner_layers=2,
        mlp_ratio=4.0,
        patch_size=1,
        patch_size_t=1,
        qk_norm="rms_norm",
        text_embed_dim=HIDDEN_SIZE,
        text_embed_2_dim=BYT5_WIDTH,
        image_embed_dim=SIGLIP_WIDTH,
        rope_theta=256.0,
        rope_axes_dim=(4, 14, 14),
        target_size=TARGET_SIZE,
        task_type="t2v",
        use_meanflow=False,
    ).eval()


def _vae() -> Any:
    import torch
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(SEED + 54)
    # Real: block_out_channels (128, 256, 512, 1024, 1024), 2 layers per block. Five
    # blocks keep 16x spatial (four downsamplings) and 4x temporal (the last two)
    # compression, and the real scaling factor; the last block's width must be a multiple
    # of twice the latent channels (the encoder's shortcut averages groups of it into the
    # latent's mean and log-variance), as 1024 is of 64.
    return AutoencoderKLHunyuanVideo15(
        in_channels=3,
        out_channels=3,
        latent_channels=LATENT_CHANNELS,
        block_out_channels=(8, 8, 16, 16, 16),
        layers_per_block=1,
        spatial_compression_ratio=SPATIAL_COMPRESSION,
        temporal_compression_ratio=TEMPORAL_COMPRESSION,
        downsample_match_channel=True,
        upsample_match_channel=True,
        scaling_factor=1.03682,
    ).eval()


def _image_encoder() -> Any:
    import torch
    from transformers import SiglipVisionConfig, SiglipVisionModel

    # SigLIP so400m-patch14-384 (27 layers of 1152, 16 heads) shrunk; the pipeline reads
    # its last_hidden_state, one row per patch.
    config = SiglipVisionConfig(
        hidden_size=SIGLIP_WIDTH,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=SIGLIP_IMAGE_SIZE,
        patch_size=SIGLIP_PATCH,
        layer_norm_eps=1e-6,
        dtype="float32",
    )
    torch.manual_seed(SEED + 55)
    return SiglipVisionModel(config).eval()
