"""Tiny models built from configs with fixed seeds, for the main job, the tests and bench/.

Nothing is downloaded: the tokenizer is trained here on generated text and the weights are
random. The two models are built to fit together the way a real omni pipeline does: the
diffusion pipeline's text conditioning width (its UNet's cross-attention dim and its text
encoder's hidden size) equals the LLM's hidden size, so an LLM stage's hidden states can
condition the diffusion stage as prompt embeddings.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

LLM_SUBDIR = "llm"
DIFFUSION_SUBDIR = "diffusion"
HIDDEN_SIZE = 128
VOCAB_SIZE = 384
_MARKER = "omni-tiny-models.json"
# Bump when what is built changes, so that old directories are rebuilt.
_RECIPE_VERSION = 3
_SEED = 1234

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_WORDS = """
a an the red green blue yellow gold silver small large tiny bright dark cat dog bird
hydrant street city tree river mountain sky sun moon house car boat flower garden
portrait painting photo sculpture of in on with under over near and draw paint make turn
into show me please image picture scene style polished shiny soft old new
""".split()  # noqa: SIM905 - a word list reads better as text


def ensure_tiny_models(root: str | Path) -> Path:
    """Build the tiny LLM and diffusion pipeline under ``root`` unless already there."""
    root = Path(root)
    marker = root / _MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("recipe") == _RECIPE_VERSION:
        return root
    root.mkdir(parents=True, exist_ok=True)
    # Build beside the target and move into place, so an interrupted build never leaves a
    # directory that looks complete.
    with tempfile.TemporaryDirectory(dir=root, prefix=".building-") as tmp:
        staging = Path(tmp)
        _build_llm(staging / LLM_SUBDIR)
        _build_diffusion(staging / DIFFUSION_SUBDIR, staging / LLM_SUBDIR)
        for sub in (LLM_SUBDIR, DIFFUSION_SUBDIR):
            shutil.rmtree(root / sub, ignore_errors=True)
            (staging / sub).rename(root / sub)
    marker.write_text(json.dumps({"recipe": _RECIPE_VERSION, "seed": _SEED}))
    return root


def _corpus(lines: int) -> list[str]:
    rng = random.Random(_SEED)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(4, 16))) for _ in range(lines)]


def _build_tokenizer(path: Path, model_max_length: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(2000), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
        chat_template=CHATML_TEMPLATE,
    )
    wrapped.save_pretrained(path)


def _build_llm(path: Path) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    _build_tokenizer(path, model_max_length=512)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32: vLLM's CPU attention needs >= 32
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    torch.manual_seed(_SEED)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(path)


def _build_diffusion(path: Path, llm_path: Path) -> None:
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast

    # The LLM's own vocabulary, truncated to CLIP's usual 77 positions.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(llm_path, model_max_length=77)
    torch.manual_seed(_SEED)
    unet = UNet2DConditionModel(
        sample_size=32,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=HIDDEN_SIZE,
        attention_head_dim=8,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(32, 64),
        latent_channels=4,
        sample_size=64,
    )
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=HIDDEN_SIZE,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            # CLIP's own defaults name ids of its 49408-token vocabulary.
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipeline = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(path)
