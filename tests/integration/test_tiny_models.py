"""The tiny models: built from configs, loadable by their libraries, made to fit together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from omni_runtime.tiny_models import DIFFUSION_SUBDIR, HIDDEN_SIZE, LLM_SUBDIR, ensure_tiny_models

pytestmark = pytest.mark.integration


def test_llm_is_a_chat_model_vllm_can_run(tiny_models: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_models / LLM_SUBDIR)
    assert config.model_type == "qwen2"
    assert config.hidden_size == HIDDEN_SIZE
    # vLLM's CPU attention kernels need head_dim >= 32.
    assert config.hidden_size // config.num_attention_heads >= 32
    tokenizer = AutoTokenizer.from_pretrained(tiny_models / LLM_SUBDIR)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "draw a red cat"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\ndraw a red cat<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(prompt)["input_ids"]
    assert tokenizer.decode(ids) == prompt
    model = AutoModelForCausalLM.from_pretrained(tiny_models / LLM_SUBDIR)
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert len(ids) < out.shape[1] <= len(ids) + 4


def test_diffusion_conditioning_width_is_the_llms_hidden_size(tiny_models: Path) -> None:
    index = json.loads((tiny_models / DIFFUSION_SUBDIR / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    unet = json.loads((tiny_models / DIFFUSION_SUBDIR / "unet" / "config.json").read_text())
    llm = json.loads((tiny_models / LLM_SUBDIR / "config.json").read_text())
    assert unet["cross_attention_dim"] == llm["hidden_size"] == HIDDEN_SIZE


def test_built_once_per_directory(tiny_models: Path) -> None:
    weights = tiny_models / LLM_SUBDIR / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_tiny_models(tiny_models) == tiny_models
    assert weights.stat().st_mtime_ns == before


def test_same_seed_same_weights(tiny_models: Path, tmp_path: Path) -> None:
    again = ensure_tiny_models(tmp_path)
    for sub in (LLM_SUBDIR, f"{DIFFUSION_SUBDIR}/unet"):
        (a,) = (tiny_models / sub).glob("*.safetensors")
        (b,) = (again / sub).glob("*.safetensors")
        assert a.read_bytes() == b.read_bytes()
