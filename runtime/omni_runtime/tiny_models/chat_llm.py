"""The tiny chat LLM: a 2-layer Qwen2 with a ChatML tokenizer."""

from __future__ import annotations

from pathlib import Path

from ._common import HIDDEN_SIZE, SEED, VOCAB_SIZE
from ._tokenizer import build_chatml_tokenizer


def build_chat_llm(path: Path) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    build_chatml_tokenizer(path, model_max_length=512)
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
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(path)
