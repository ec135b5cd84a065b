"""A tiny Wan2.2 checkpoint, laid out as Wan2.2-TI2V-5B's is.

One ``WanPipeline`` checkpoint serves text-to-video and (through
``WanImageToVideoPipeline.from_pipe``) image-to-video, as the real one does: a UMT5 text
encoder whose last hidden state conditions a single DiT (no ``transformer_2``, no
``boundary_ratio``), Wan2.2's VAE (48 latent channels, 2x2 pixel patches in, 16x spatial and
4x temporal compression), ``expand_timesteps=True`` (a timestep per latent patch, which is
how the image-to-video mode keeps its first frame clean) and a UniPC flow schedule.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._common import HIDDEN_SIZE, SEED, corpus, randomize_rms_norms

# The UMT5 width, and so the DiT's ``text_dim`` and the width of the prompt embeddings a
# split hands the DiT: as wide as the chat LLM's and the Qwen encoders' hidden states.
TEXT_DIM = HIDDEN_SIZE
TEXT_LAYERS = 2
# The text model's vocabulary rows: the tokenizer's pieces and sentinels, padded to a
# multiple of 128 as UMT5 pads its own (256300 tokens in 256384 rows).
WAN_VOCAB_SIZE = 128
# At most this many Unigram pieces (<pad>, </s>, <unk> first; on the generated prompts'
# few words the trainer keeps fewer), then T5's sentinels after them (UMT5 has 300).
_UNIGRAM_SIZE = 100
_EXTRA_IDS = 16
# UMT5's special tokens, in its order: ids 0, 1 and 2.
_T5_SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]
LATENT_CHANNELS = 48
# Wan2.2's VAE: 2x2 pixel patches (12 channels) in, three 2x downsamplings inside.
VAE_SCALE_FACTOR_SPATIAL = 16
VAE_SCALE_FACTOR_TEMPORAL = 4
# Wan2.2-TI2V-5B renders at 24 fps (the original repo's ``sample_fps`` for ti2v-5B; the
# diffusers checkpoint does not record it).
FPS = 24

# Wan2.2-TI2V-5B's scheduler: what diffusers' convert_wan_to_diffusers.py builds for TI2V.
_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 5.0,
}

# Wan2.2's VAE statistics (vae/config.json of the real checkpoint): the pipeline normalizes
# latents with them, so a wrong pair shows up as a different decode.
_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]  # fmt: skip
_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]  # fmt: skip


def build_wan(target: Path) -> None:
    """Write the checkpoint (model_index.json and one folder per component) to ``target``."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    tokenizer = _tokenizer()
    WanPipeline(
        tokenizer=tokenizer,
        text_encoder=_text_encoder(tokenizer),
        vae=_vae(),
        scheduler=UniPCMultistepScheduler(**_SCHEDULER_CONFIG),
        transformer=_transformer(),
        transformer_2=None,
        boundary_ratio=None,
        expand_timesteps=True,
    ).save_pretrained(target)


def _tokenizer() -> Any:
    """A ``T5Tokenizer`` built as UMT5's is (a Unigram over metaspace-split words, </s>
    appended, T5's sentinels last), its pieces trained here on the generated prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import T5Tokenizer

    unigram = Tokenizer(models.Unigram())
    # T5Tokenizer's own pre-tokenizer, so that the pieces are the words it will see.
    unigram.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    unigram.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.UnigramTrainer(
        vocab_size=_UNIGRAM_SIZE,
        special_tokens=_T5_SPECIAL_TOKENS,
        unk_token="<unk>",
        show_progress=False,
    )
    unigram.train_from_iterator(corpus(2000), trainer=trainer)
    trained: list[list[Any]] = json.loads(unigram.to_str())["model"]["vocab"]  # [piece, score]
    # The trainer's EM sums in parallel, so the scores differ run to run in their last bits:
    # rounded, and the pieces ordered by score then text, the file is the same every build.
    specials = [piece for piece, _ in trained[: len(_T5_SPECIAL_TOKENS)]]
    if specials != _T5_SPECIAL_TOKENS:
        raise RuntimeError(f"the Unigram starts with {specials}, not {_T5_SPECIAL_TOKENS}")
    pieces = sorted(
        ((piece, round(score, 6)) for piece, score in trained[len(specials) :]),
        key=lambda entry: (-entry[1], entry[0]),
    )
    vocab = [(piece, 0.0) for piece in _T5_SPECIAL_TOKENS] + pieces
    tokenizer = T5Tokenizer(
        vocab=vocab,
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_ids=_EXTRA_IDS,
        # The Wan pipelines' max_sequence_length: they pad and truncate prompts to it.
        model_max_length=512,
    )
    ids = [tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id]
    if ids != [0, 1, 2]:
        raise RuntimeError(f"<pad>, </s>, <unk> have ids {ids}, not UMT5's 0, 1, 2")
    if len(tokenizer) > WAN_VOCAB_SIZE:
        raise RuntimeError(f"a tokenizer of {len(tokenizer)} tokens for {WAN_VOCAB_SIZE} rows")
    return tokenizer


def _text_encoder(tokenizer: Any) -> Any:
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    # umt5-xxl shrunk (real: d_model 4096, 64 heads of 64, d_ff 10240, 24 layers), kept:
    # gated GELU, relative position buckets per layer, untied embeddings.
    config = UMT5Config(
        vocab_size=WAN_VOCAB_SIZE,
        d_model=TEXT_DIM,
        d_kv=32,
        d_ff=256,
        num_layers=TEXT_LAYERS,
        num_heads=TEXT_DIM // 32,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        dropout_rate=0.0,
        layer_norm_epsilon=1e-6,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(SEED + 40)
    model = UMT5EncoderModel(config)
    # T5's RMS norms (UMT5LayerNorm) start as ones too: drawn from [0.5, 1.5] instead, as
    # randomize_rms_norms does for the ones named *RMSNorm.
    generator = torch.Generator().manual_seed(SEED + 41)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "UMT5LayerNorm":
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=generator))
    return model.eval()


def _transformer() -> Any:
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(SEED + 42)
    # Wan2.2-TI2V-5B's DiT (real: 24 heads of 128, ffn 14336, 30 layers) shrunk: 2 heads of
    # 32 (RoPE over frames, height, width gets 12, 10, 10 of them), 48 latent channels in
    # and out, 1x2x2 patches, text_dim the UMT5 width, no image embedding (image_dim None:
    # TI2V conditions on the image through its latents, not CLIP).
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=32,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=128,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        image_dim=None,
        added_kv_proj_dim=None,
        rope_max_seq_len=1024,
        pos_embed_seq_len=None,
    )
    randomize_rms_norms(model, SEED + 43)
    return model.eval()


def _vae() -> Any:
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(SEED + 44)
    # Wan2.2's VAE as diffusers' Wan2.2 TI2V-5B tests configure it (12 channels of 2x2
    # pixel patches in and out, residual blocks, 48 latent channels, 16x spatial), with the
    # real dim_mult and latent statistics; real widths 160 and 256 (the decoder's is wider),
    # here 4 and 8, one res block instead of 2.
    return AutoencoderKLWan(
        base_dim=4,
        decoder_base_dim=8,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        in_channels=12,
        out_channels=12,
        is_residual=True,
        patch_size=2,
        latents_mean=_LATENTS_MEAN,
        latents_std=_LATENTS_STD,
        scale_factor_spatial=VAE_SCALE_FACTOR_SPATIAL,
        scale_factor_temporal=VAE_SCALE_FACTOR_TEMPORAL,
    ).eval()
