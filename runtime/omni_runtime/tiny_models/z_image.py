"""A tiny Z-Image checkpoint, laid out as Z-Image-Turbo's is.

A Qwen3 text encoder (the pipeline conditions on its ``hidden_states[-2]``), a single-stream
DiT whose caption features are the text width, a FLUX-style 16-channel AutoencoderKL with
8x spatial compression, and Z-Image-Turbo's fixed-shift flow-matching schedule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._common import HIDDEN_SIZE, SEED, randomize_rms_norms
from .qwen_image import MAX_POSITIONS, QWEN_VOCAB_SIZE

TEXT_LAYERS = 3
LATENT_CHANNELS = 16

# Z-Image-Turbo's scheduler_config.json.
_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": False,
}


def build_z_image(path: Path, tokenizer: Any) -> None:
    """Write the checkpoint to ``path``, with ``build_qwen_tokenizer``'s tokenizer."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**_SCHEDULER_CONFIG),
        vae=_vae(),
        text_encoder=_text_encoder(tokenizer),
        tokenizer=tokenizer,
        transformer=_transformer(),
    ).save_pretrained(path)


def _text_encoder(tokenizer: Any) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=QWEN_VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=256,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention needs >= 32
        max_position_embeddings=MAX_POSITIONS,
        max_window_layers=TEXT_LAYERS,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(SEED + 20)
    model = Qwen3Model(config)
    randomize_rms_norms(model, SEED + 21)
    return model.eval()


def _transformer() -> Any:
    import torch
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(SEED + 22)
    # 2 heads of 32 (real: 30 of 128), RoPE axes in the real proportions (32, 48, 48 of 128).
    model = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=LATENT_CHANNELS,
        dim=64,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=HIDDEN_SIZE,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[8, 12, 12],
        axes_lens=[1024, 512, 512],
    )
    # The pad tokens start as torch.empty: whatever memory held. Seeded values instead.
    generator = torch.Generator().manual_seed(SEED + 23)
    with torch.no_grad():
        for pad in (model.x_pad_token, model.cap_pad_token):
            pad.copy_(torch.randn(pad.shape, generator=generator))
    return model.eval()


def _vae() -> Any:
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(SEED + 24)
    # FLUX's VAE (real: block_out_channels 128-512, 2 layers per block) shrunk: four blocks,
    # so 8x compression, 16 latent channels, FLUX's scaling and shift, no quant convs.
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 32, 32, 32),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=16,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()
