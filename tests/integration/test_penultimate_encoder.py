"""Z-Image's text encoder on vLLM: OmniQwen3PenultimateModel, registered by the project's
``vllm.general_plugins`` entry point, serves transformers' ``hidden_states[-2]`` from an LLM
stage whose core is a process of its own.

The tiny Qwen3 is built here (not by omni_runtime.tiny_models) with every RMSNorm weight
drawn from [0.5, 1.5], so that a final norm left in, or a layer's norm left out, shows.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.engine import FinishReason

from omni_runtime.config import StageConfig
from omni_runtime.engine.models import ARCHITECTURES, register_models
from omni_runtime.engine.stage.stage_llm_core_client import (
    DPLBStageLLMCoreClient,
    StageLLMCoreClient,
    start_stage_llm_client,
)
from omni_testkit.stage_outputs import add_prompt, collect_results, core_pids

pytestmark = pytest.mark.integration

ARCHITECTURE = "OmniQwen3PenultimateModel"
HIDDEN_SIZE = 128
NUM_LAYERS = 3
PROMPTS = ["a red cat", "draw a blue river under the moon with a small boat near a tree"]
DEADLINE_S = 60
_WORDS = "a the red blue gold cat dog river moon tree boat house draw paint under near with"


def build_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer of 384 tokens, trained on a few generated lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = _WORDS.split()
    lines = range(400)
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(4 + i % 9)) for i in lines]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=512,
    ).save_pretrained(path)


def build_qwen3(path: Path, checkpoint: str) -> None:
    """A 3-layer Qwen3 saved as ``checkpoint``: Qwen3ForCausalLM (weights under ``model.``)
    or Qwen3Model (the same weights without the prefix)."""
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    build_tokenizer(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=256,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        head_dim=32,  # vLLM's CPU attention needs >= 32
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    (model if checkpoint == "Qwen3ForCausalLM" else model.model).save_pretrained(path)


@pytest.fixture(scope="module", autouse=True)
def engine_environment(llm_engine_environment: None) -> None:
    """vLLM's CPU environment for this module's cores (tests/conftest.py)."""


@pytest.fixture(scope="module", params=["Qwen3ForCausalLM", "Qwen3Model"])
def qwen3_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    build_qwen3(path, request.param)
    return path


@pytest.fixture(scope="module")
def encoder(qwen3_path: Path) -> Iterator[StageLLMCoreClient | DPLBStageLLMCoreClient]:
    stage = StageConfig.model_validate(
        {
            "stageId": 0,
            "name": "text-encoder",
            "type": "llm",
            "output": "hidden_states",
            # float32 so that vLLM and transformers compute the same numbers.
            "dtype": "float32",
            "enforceEager": True,
            "maxModelLen": 512,
            "engineArgs": {"hf_overrides": {"architectures": [ARCHITECTURE]}},
        }
    )
    client = start_stage_llm_client(stage, str(qwen3_path))
    yield client
    client.shutdown()


def test_the_plugin_is_an_entry_point_and_registers_once() -> None:
    from vllm import ModelRegistry

    plugins = {plugin.name: plugin.value for plugin in entry_points(group="vllm.general_plugins")}
    assert plugins["omni_runtime_models"] == "omni_runtime.engine.models:register_models"
    register_models()
    registered = ModelRegistry.models[ARCHITECTURE]
    register_models()
    assert ModelRegistry.models[ARCHITECTURE] is registered
    assert set(ARCHITECTURES) <= set(ModelRegistry.get_supported_archs())


@pytest.mark.asyncio(loop_scope="module")
async def test_hidden_states_are_the_penultimate_layer(
    encoder: StageLLMCoreClient | DPLBStageLLMCoreClient, qwen3_path: Path
) -> None:
    from transformers import AutoModel

    # The model ran in the core's process, which vLLM spawned: only the entry point can
    # have registered the architecture there.
    assert os.getpid() not in core_pids(encoder)
    model = AutoModel.from_pretrained(qwen3_path, dtype=torch.float32).eval()
    for index, prompt in enumerate(PROMPTS):
        await add_prompt(encoder, f"prompt-{index}", prompt=prompt)
        result = (await collect_results(encoder, [f"prompt-{index}"], DEADLINE_S))[
            f"prompt-{index}"
        ]
        assert result.finish_reason == FinishReason.STOP
        prompt_ids = encoder.request_builder.build("ids", prompt=prompt).prompt_token_ids
        with torch.no_grad():
            expected: Any = model(torch.tensor([prompt_ids]), output_hidden_states=True)
        penultimate, last = expected.hidden_states[-2][0], expected.hidden_states[-1][0]
        hidden = result.hidden_states
        assert hidden is not None
        assert tuple(hidden.shape) == (len(prompt_ids), HIDDEN_SIZE)
        print(
            f"{qwen3_path.name} prompt {index}: max |vllm - [-2]| = "
            f"{(hidden - penultimate).abs().max():.2e}, max |vllm - [-1]| = "
            f"{(hidden - last).abs().max():.2e}"
        )
        torch.testing.assert_close(hidden, penultimate, atol=1e-4, rtol=1e-4)
        # The check can fail: the last layer's output (after the final norm) is far off.
        assert (hidden - last).abs().max() > 0.1
