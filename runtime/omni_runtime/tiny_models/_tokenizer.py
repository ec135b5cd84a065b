"""Byte-level BPE tokenizers trained here on generated text: nothing comes from a hub."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._common import VOCAB_SIZE, corpus

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CHATML_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen's added tokens, in Qwen's order, that the Qwen2.5-VL and Qwen3 configs and the
# diffusers pipelines' templates name. Special ones are never split or decoded away.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Qwen3 adds these as plain (not special) tokens: they stay in decoded text.
QWEN_THINK_TOKENS = ["<think>", "</think>"]
# Byte-level BPE entries (the 256 bytes and the merges) before the added tokens.
QWEN_BPE_SIZE = 480
# Qwen's pre-tokenizer: words, single digits, punctuation runs, newlines, spaces.
_QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3's template, cut to what the diffusers pipelines use: a message's content is a string
# or a list of text/image parts (an image part is the Qwen2.5-VL placeholder);
# ``add_generation_prompt`` opens the assistant's turn, and ``enable_thinking=False`` then
# adds the empty thinking block, as Qwen3's own template does.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\n\n</think>\n\n' -}}"
    "{%- endif -%}{%- endif -%}"
)


def build_chatml_tokenizer(path: Path, model_max_length: int) -> None:
    """The chat LLM's tokenizer: VOCAB_SIZE tokens, the ChatML tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=_CHATML_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(2000), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
        chat_template=CHATML_TEMPLATE,
    )
    wrapped.save_pretrained(path)


def build_qwen_tokenizer(model_max_length: int) -> Any:
    """A ``Qwen2Tokenizer`` built as Qwen's is (NFC, Qwen's split regex, byte-level BPE),
    with QWEN_BPE_SIZE trained entries followed by Qwen's added tokens."""
    added = [(token, True) for token in QWEN_SPECIAL_TOKENS]
    added += [(token, False) for token in QWEN_THINK_TOKENS]
    return train_qwen_tokenizer(
        corpus(2000), QWEN_BPE_SIZE, added, model_max_length, QWEN_CHAT_TEMPLATE
    )


def train_qwen_tokenizer(
    lines: list[str],
    bpe_size: int,
    added: list[tuple[str, bool]],
    model_max_length: int,
    chat_template: str,
    named: dict[str, str] | None = None,
) -> Any:
    """A ``Qwen2Tokenizer``: a byte-level BPE of at most ``bpe_size`` entries trained on
    ``lines`` as Qwen's is (NFC, Qwen's split regex), then the ``added`` tokens (each with
    whether it is special) in their order from id ``bpe_size`` on; ``named``: the
    tokenizer's model-specific token attributes (``tokenizer.audio_token`` and the like)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AddedToken, Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(lines, trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = dict(trained["vocab"])
    if len(vocab) > bpe_size:
        raise RuntimeError(f"the BPE has {len(vocab)} entries, more than {bpe_size}")
    for offset, (token, _) in enumerate(added):
        vocab[token] = bpe_size + offset
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[tuple(merge) for merge in trained["merges"]],
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
        chat_template=chat_template,
        **({"extra_special_tokens": named} if named else {}),
    )
    # One call per token: whether it is special differs from token to token.
    for token, special in added:
        tokenizer.add_tokens(
            [AddedToken(token, special=special, normalized=False)], special_tokens=special
        )
    for token, _ in added:
        if tokenizer.convert_tokens_to_ids(token) != vocab[token]:
            raise RuntimeError(f"{token} did not keep its id {vocab[token]}")
    return tokenizer
