"""A tiny Qwen3-Omni checkpoint, laid out as Qwen/Qwen3-Omni-30B-A3B-Instruct is.

One ``Qwen3OmniMoeForConditionalGeneration`` (thinker, talker, code2wav) in
``model.safetensors`` with its ``config.json`` and ``generation_config.json``, a Qwen2
tokenizer with Qwen3-Omni's added tokens in Qwen's order, a chat template, and the
processor's configuration (``processor_config.json``: a WhisperFeatureExtractor for audio
input, Qwen2-VL image and video processors).

Scaled down, the way transformers 5.19 runs it (``generate(..., return_audio=True)``) and
vLLM's CPU build serves its thinker:

- a vocabulary of 512 rows instead of 152064: the tokenizer's trained BPE and then the
  33 added tokens in the real order, so every token id in ``config.json`` (im_start,
  audio/image/video placeholders, tts pad/bos/eos, the role words) is this tokenizer's,
  not the real model's;
- every attention head 32 wide (vLLM's CPU attention takes no narrower), M-RoPE sections
  in the real proportions (24, 20, 20 of 64 become 6, 5, 5 of 16);
- MoE everywhere the real model has it: 4 experts, 2 per token; the talker's shared
  expert kept;
- the talker's codec vocabulary as the real one's (3072 rows: 2048 codes, then the codec
  specials at 2148-2157 and the voices chelsie/ethan/aiden at 2301-2303), 16 code groups,
  and a code2wav with the real upsampling (1920 samples per code at 24 kHz) on narrow
  channels.

Random weights, seeded, float32 (31 MB, most of it the code predictor's 15 codebook
embeddings and heads): transformers' init, with what it leaves undrawn drawn (the
talker's experts and routers), what it leaves constant randomised (zero biases,
LayerNorm and RMSNorm scales), and the audio encoder and code2wav redrawn so that a
sound changes the thinker's answer and the waveform is not near-silence.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._common import SEED, corpus, randomize_rms_norms
from ._tokenizer import train_qwen_tokenizer

# Qwen3-Omni's added tokens, in its tokenizer's order (ids 151643-151675 there), and
# whether each is special (never split, dropped by skip_special_tokens).
ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]
# The tokenizer's attributes that Qwen3OmniMoeProcessor reads.
NAMED_TOKENS = {
    "audio_token": "<|audio_pad|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}
# Trained BPE entries; with the added tokens, 497 tokens in 512 rows.
BPE_SIZE = 464
VOCAB_SIZE = 512
# The role words the talker finds after <|im_start|> (config's system/user/assistant ids):
# single tokens, as in Qwen's vocabulary.
ROLES = ("system", "user", "assistant")
MAX_POSITIONS = 4096
THINKER_HIDDEN = 128
THINKER_LAYERS = 2
HEAD_DIM = 32  # vLLM's CPU attention needs >= 32
# head_dim / 2 rotary frequencies over (time, height, width), interleaved, in the real
# model's proportions (24, 20, 20 of 64).
_MROPE = {
    "rope_type": "default",
    "rope_theta": 1000000.0,
    "mrope_section": [6, 5, 5],
    "interleaved": True,
    "mrope_interleaved": True,
}
TALKER_HIDDEN = 64
# The real talker reads the thinker's layer 24 of 48: here the output of layer 1 of 2
# (hidden_states[1]), not the final one, so a talker fed the last layer differs.
ACCEPT_HIDDEN_LAYER = 1
NUM_CODE_GROUPS = 16
CODEBOOK_SIZE = 2048
TALKER_VOCAB_SIZE = 3072
SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
# code2wav: samples per code, and its output rate.
UPSAMPLE_RATES = [8, 5, 4, 3]
UPSAMPLING_RATIOS = [2, 2]
SAMPLES_PER_CODE = 1920
OUTPUT_SAMPLE_RATE = 24000
AUDIO_SAMPLE_RATE = 16000

# Qwen3-Omni's template cut to what the runtime sends: a message's content is a string or
# a list of parts; an audio part (``audio``, ``input_audio`` as in OpenAI's chat API, or
# ``audio_url``) is the audio placeholder, an image or video part the vision one, as the
# real template writes them; ``add_generation_prompt`` opens the assistant's turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('audio', 'input_audio', 'audio_url') -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] in ('image', 'image_url') -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

# Images through the ViT: at most 128x128 pixels, 8x8 patches of 16, merged 2x2 into 16
# placeholder tokens.
_MIN_PIXELS = 32 * 32
_MAX_PIXELS = 128 * 128
_VISION_INPUT: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2,
    "patch_size": 16,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": _MAX_PIXELS, "shortest_edge": _MIN_PIXELS},
    "temporal_patch_size": 2,
}
# What Qwen3OmniMoeProcessor.save_pretrained writes, spelled out: making the processor
# needs torchvision (its video processor), and the build must not.
PROCESSOR_CONFIG: dict[str, Any] = {
    # The real checkpoint's: 128 mel bins of 16 kHz audio, 10 ms hops, up to 300 s.
    "feature_extractor": {
        "chunk_length": 300,
        "dither": 0.0,
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128,
        "hop_length": 160,
        "n_fft": 400,
        "n_samples": 300 * AUDIO_SAMPLE_RATE,
        "nb_max_frames": 30000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        "sampling_rate": AUDIO_SAMPLE_RATE,
    },
    "image_processor": {**_VISION_INPUT, "image_processor_type": "Qwen2VLImageProcessor"},
    "processor_class": "Qwen3OmniMoeProcessor",
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


def build_qwen3_omni_tokenizer() -> Any:
    """The checkpoint's tokenizer: a Qwen2Tokenizer whose BPE knows the role words."""
    # Each role word on its own line, often enough that the BPE learns it whole.
    lines = corpus(2000) + [f"{role}\n" for role in ROLES for _ in range(200)]
    tokenizer = train_qwen_tokenizer(
        lines, BPE_SIZE, ADDED_TOKENS, MAX_POSITIONS, CHAT_TEMPLATE, named=NAMED_TOKENS
    )
    for role in ROLES:
        if len(tokenizer(f"<|im_start|>{role}\n")["input_ids"]) != 3:
            raise RuntimeError(f"the role {role!r} is not one token")
    if len(tokenizer) > VOCAB_SIZE:
        raise RuntimeError(f"a tokenizer of {len(tokenizer)} tokens for {VOCAB_SIZE} rows")
    return tokenizer


def qwen3_omni_config(tokenizer: Any) -> Any:
    """The tiny ``Qwen3OmniMoeConfig``, its token ids ``tokenizer``'s."""
    from transformers import Qwen3OmniMoeConfig

    def token(text: str) -> int:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise RuntimeError(f"{text!r} is not one token: {ids}")
        token_id: int = ids[0]
        return token_id

    placeholders = {
        "audio_token_id": token("<|audio_pad|>"),
        "image_token_id": token("<|image_pad|>"),
        "video_token_id": token("<|video_pad|>"),
        "audio_start_token_id": token("<|audio_start|>"),
        "vision_start_token_id": token("<|vision_start|>"),
    }
    moe = {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    return Qwen3OmniMoeConfig(
        thinker_config={
            "text_config": {
                "vocab_size": VOCAB_SIZE,
                "hidden_size": THINKER_HIDDEN,
                "intermediate_size": 256,
                "moe_intermediate_size": 64,
                "shared_expert_intermediate_size": 0,
                "num_hidden_layers": THINKER_LAYERS,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": HEAD_DIM,
                "max_position_embeddings": MAX_POSITIONS,
                "rms_norm_eps": 1e-6,
                "rope_parameters": dict(_MROPE),
                "use_qk_norm": True,
                "tie_word_embeddings": False,
                **moe,
            },
            "audio_config": {
                "num_mel_bins": PROCESSOR_CONFIG["feature_extractor"]["feature_size"],
                "encoder_layers": 1,
                "encoder_attention_heads": 2,
                "encoder_ffn_dim": 128,
                "d_model": 64,
                "downsample_hidden_size": 32,
                "output_dim": THINKER_HIDDEN,
                "n_window": 50,
                "n_window_infer": 800,
                "conv_chunksize": 500,
                "max_source_positions": 1500,
            },
            "vision_config": {
                "depth": 1,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_heads": 2,
                "patch_size": 16,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "out_hidden_size": THINKER_HIDDEN,
                "deepstack_visual_indexes": [0],
                # vLLM reads these (absent from transformers' config class), as the real
                # config has them: a 48x48 grid of position embeddings, as transformers'
                # num_position_embeddings says.
                "num_position_embeddings": 48 * 48,
                "image_size": 48 * 16,
                "spatial_patch_size": 16,
                "apply_vit_abs_pos_embed": True,
                "tokens_per_second": 2,
            },
            **placeholders,
            "audio_end_token_id": token("<|audio_end|>"),
            "vision_end_token_id": token("<|vision_end|>"),
            "user_token_id": token("user"),
            "position_id_per_seconds": 13,
            "seconds_per_chunk": 2,
            "tie_word_embeddings": False,
        },
        talker_config={
            "text_config": {
                "vocab_size": TALKER_VOCAB_SIZE,
                "hidden_size": TALKER_HIDDEN,
                "intermediate_size": 128,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": HEAD_DIM,
                "max_position_embeddings": MAX_POSITIONS,
                "rms_norm_eps": 1e-6,
                "rope_parameters": dict(_MROPE),
                **moe,
            },
            "code_predictor_config": {
                "vocab_size": CODEBOOK_SIZE,
                "hidden_size": TALKER_HIDDEN,
                "intermediate_size": 128,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": HEAD_DIM,
                "max_position_embeddings": MAX_POSITIONS,
                "rms_norm_eps": 1e-6,
                "num_code_groups": NUM_CODE_GROUPS,
            },
            **placeholders,
            "audio_end_token_id": token("<|audio_end|>"),
            "num_code_groups": NUM_CODE_GROUPS,
            "thinker_hidden_size": THINKER_HIDDEN,
            "accept_hidden_layer": ACCEPT_HIDDEN_LAYER,
            "codec_pad_id": 2148,
            "codec_bos_id": 2149,
            "codec_eos_token_id": 2150,
            "codec_nothink_id": 2155,
            "codec_think_bos_id": 2156,
            "codec_think_eos_id": 2157,
            "speaker_id": dict(SPEAKERS),
            "spatial_merge_size": 2,
            "position_id_per_seconds": 13,
            "seconds_per_chunk": 2,
        },
        code2wav_config={
            "codebook_size": CODEBOOK_SIZE,
            "num_quantizers": NUM_CODE_GROUPS,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "sliding_window": 72,
            "max_position_embeddings": 8000,
            "upsample_rates": UPSAMPLE_RATES,
            "upsampling_ratios": UPSAMPLING_RATIOS,
            "decoder_dim": 64,
        },
        im_start_token_id=token("<|im_start|>"),
        im_end_token_id=token("<|im_end|>"),
        tts_pad_token_id=token("<tts_pad>"),
        tts_bos_token_id=token("<tts_text_bos>"),
        tts_eos_token_id=token("<tts_text_eod>"),
        system_token_id=token("system"),
        user_token_id=token("user"),
        assistant_token_id=token("assistant"),
        enable_audio_output=True,
        dtype="float32",
    )


def build_qwen3_omni(target: Path) -> None:
    """Write the tiny Qwen3-Omni checkpoint to ``target``."""
    import torch
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    tokenizer = build_qwen3_omni_tokenizer()
    config = qwen3_omni_config(tokenizer)
    torch.manual_seed(SEED + 60)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    _draw_talker_experts(model.talker, SEED + 63)
    _randomize_constant_affines(model, SEED + 64)
    randomize_rms_norms(model, SEED + 61)
    _make_code2wav_audible(model.code2wav, SEED + 62)
    _make_audio_tower_listen(model.thinker.audio_tower, SEED + 65)
    with torch.no_grad():
        # The padding rows past the tokenizer's tokens score 0, below the real tokens' best
        # (random weights would make them likely): greedy text holds only the tokenizer's
        # tokens.
        model.thinker.lm_head.weight[len(tokenizer) :] = 0.0
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    processor = json.dumps(PROCESSOR_CONFIG, indent=2, sort_keys=True)
    (target / "processor_config.json").write_text(processor + "\n")


def _draw_talker_experts(talker: Any, seed: int) -> None:
    """Draw the talker's routed experts and routers, which transformers leaves as they were
    allocated: 5.19's ``_init_weights`` covers the thinker's expert and router classes, not
    the talker's, so its experts would be whatever memory held (a different checkpoint
    every build) and its routers zero."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    std = talker.config.text_config.initializer_range
    with torch.no_grad():
        for module in talker.modules():
            if type(module).__name__ in (
                "Qwen3OmniMoeTalkerTextExperts",
                "Qwen3OmniMoeTalkerTextTopKRouter",
            ):
                for parameter in module.parameters(recurse=False):
                    parameter.normal_(0.0, std, generator=generator)


def _randomize_constant_affines(model: Any, seed: int) -> int:
    """Draw every bias that is all zeros (as initialised) from N(0, 0.02), and every
    LayerNorm weight (all ones) from [0.5, 1.5]: a reimplementation that leaves out a zero
    bias, or a LayerNorm's scale of ones, would compute the same as transformers, and a
    test comparing the two could not tell. Returns how many tensors were drawn."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    drawn = 0
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias") and not parameter.any():
                parameter.normal_(0.0, 0.02, generator=generator)
                drawn += 1
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm) and module.weight is not None:
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=generator))
                drawn += 1
    return drawn


def _make_audio_tower_listen(audio_tower: Any, seed: int) -> None:
    """Redraw the audio encoder's weights so that what it hears reaches the thinker.

    With transformers' init (std 0.02) its convolutions shrink the mel features far below
    the sinusoidal position embeddings added after them: every sound then encodes to the
    same embeddings (0.5 s of a 440 Hz and of an 880 Hz tone differ by 3e-5 of 0.09).
    Drawn with std 1/sqrt(fan_in), each layer keeps the scale; the output projection is
    scaled by 0.05, so that the audio embeddings (std about 0.04) are of the text
    embeddings' order, not 30 times theirs.
    """
    import math

    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in audio_tower.named_modules():
            if isinstance(module, torch.nn.Linear | torch.nn.Conv2d):
                scale = 0.05 if name == "proj2" else 1.0
                fan_in = module.weight[0].numel()
                module.weight.normal_(0.0, scale / math.sqrt(fan_in), generator=generator)


def _make_code2wav_audible(code2wav: Any, seed: int) -> None:
    """Redraw code2wav's convolutions so that its waveform is audible (std about 0.15).

    transformers' init (std 0.02) shrinks the signal about 5x at each of the narrow
    decoder's convolutions: its waveform would be about 1e-7, which a test cannot tell
    from silence. Drawn with std 1/sqrt(fan_in) instead, each convolution keeps the scale;
    the residual units' last convolution and the output one are scaled by 0.1, so that the
    residual sums do not grow and the output is seldom clipped to [-1, 1].
    """
    import math

    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        convolutions = [
            (name, module)
            for name, module in code2wav.named_modules()
            if isinstance(module, torch.nn.Conv1d | torch.nn.ConvTranspose1d)
        ]
        last = convolutions[-1][0]
        for name, module in convolutions:
            fan_in = module.in_channels // module.groups * module.kernel_size[0]
            if isinstance(module, torch.nn.ConvTranspose1d):
                fan_in //= module.stride[0]
            scale = 0.1 if name == last or name.endswith("conv2.conv") else 1.0
            module.weight.normal_(0.0, scale / math.sqrt(fan_in), generator=generator)
