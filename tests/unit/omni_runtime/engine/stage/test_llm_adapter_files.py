"""LLM stages' LoRA adapters without an engine: the engine arguments they turn on, the
checks of an adapter's files, the zero adapter, vLLM's ids."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_runtime.adapters import AdapterSourceError
from omni_runtime.config import StageConfig
from omni_runtime.config.stages import DEFAULT_MAX_LORA_RANK
from omni_runtime.engine.stage.stage_core_types import StageErrorCode
from omni_runtime.engine.stage.stage_llm_core_client import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    AdapterLoadError,
    adapter_dir,
    lora_int_id,
    write_zero_adapter,
)
from omni_runtime.engine.stage.stage_llm_engine_config import (
    StageLLMConfigError,
    lora_needs_zero_adapter,
    make_stage_llm_engine_args,
)


def _stage(**fields: object) -> StageConfig:
    return StageConfig.model_validate({"stageId": 0, "type": "llm", **fields})


def test_a_stage_without_adapters_keeps_its_engine_args() -> None:
    stage = _stage(maxModelLen=256, dtype="float32")
    unchanged = make_stage_llm_engine_args(stage, "/m")
    assert dataclasses.asdict(make_stage_llm_engine_args(stage, "/m", adapter_capacity=0)) == (
        dataclasses.asdict(unchanged)
    )
    assert unchanged.enable_lora is False


def test_a_stage_with_adapters_turns_vllms_lora_on_sized_by_its_capacity() -> None:
    # One slot more on vLLM's CPU platform, for the zero adapter.
    extra = 1 if lora_needs_zero_adapter() else 0
    args = make_stage_llm_engine_args(_stage(maxLoras=3), "/m", adapter_capacity=3)
    assert (args.enable_lora, args.max_loras, args.max_cpu_loras, args.max_lora_rank) == (
        True,
        3 + extra,
        3 + extra,
        DEFAULT_MAX_LORA_RANK,
    )
    ranked = make_stage_llm_engine_args(_stage(maxLoraRank=64), "/m", adapter_capacity=4)
    assert (ranked.max_loras, ranked.max_lora_rank) == (4 + extra, 64)
    with pytest.raises(StageLLMConfigError, match=r"engineArgs\.max_cpu_loras: set by"):
        make_stage_llm_engine_args(
            _stage(engineArgs={"max_cpu_loras": 9}), "/m", adapter_capacity=2
        )


def _adapter(path: Path) -> Path:
    path.mkdir()
    (path / ADAPTER_CONFIG_FILE).write_text(json.dumps({"r": 2, "target_modules": ["q_proj"]}))
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 8),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(8, 2),
    }
    save_file(tensors, path / ADAPTER_WEIGHTS_FILE)
    return path


def test_adapter_dir_takes_a_peft_directory(tmp_path: Path) -> None:
    good = _adapter(tmp_path / "good")
    assert adapter_dir(str(good)) == good


@pytest.mark.parametrize(
    ("breakage", "named", "why"),
    [
        ("gone", "", "no such file or directory"),
        ("file", "weights.safetensors", "is a directory holding"),
        ("no-config", ADAPTER_CONFIG_FILE, "missing"),
        ("no-weights", ADAPTER_WEIGHTS_FILE, "missing"),
        ("bad-json", ADAPTER_CONFIG_FILE, "not a readable JSON adapter config"),
        ("list-json", ADAPTER_CONFIG_FILE, "expected a JSON object"),
        ("corrupt", ADAPTER_WEIGHTS_FILE, "not a readable safetensors file"),
        ("truncated", ADAPTER_WEIGHTS_FILE, "not a readable safetensors file"),
    ],
)
def test_adapter_dir_names_the_file_at_fault(
    tmp_path: Path, breakage: str, named: str, why: str
) -> None:
    adapter = _adapter(tmp_path / "adapter")
    source = adapter
    weights = adapter / ADAPTER_WEIGHTS_FILE
    if breakage == "gone":
        source = tmp_path / "gone"
    elif breakage == "file":
        source = tmp_path / "weights.safetensors"
        source.write_bytes(weights.read_bytes())
    elif breakage == "no-config":
        (adapter / ADAPTER_CONFIG_FILE).unlink()
    elif breakage == "no-weights":
        weights.unlink()
    elif breakage == "bad-json":
        (adapter / ADAPTER_CONFIG_FILE).write_text("{r: 2")
    elif breakage == "list-json":
        (adapter / ADAPTER_CONFIG_FILE).write_text("[]")
    elif breakage == "corrupt":
        weights.write_bytes(b"\xff" * 32)
    else:
        weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(AdapterSourceError) as caught:
        adapter_dir(str(source))
    message = str(caught.value)
    where = source if breakage in ("gone", "file") else adapter / named
    assert message.startswith(str(where)), message
    assert why in message


def test_the_zero_adapter_has_the_shape_of_its_model_and_no_weight(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path / "adapter")
    write_zero_adapter(adapter, tmp_path / "zero")
    assert adapter_dir(str(tmp_path / "zero")) == tmp_path / "zero"
    like, zero = (
        load_file(adapter / ADAPTER_WEIGHTS_FILE),
        load_file(tmp_path / "zero" / ADAPTER_WEIGHTS_FILE),
    )
    assert {name: t.shape for name, t in zero.items()} == {
        name: t.shape for name, t in like.items()
    }
    assert all(not tensor.any() for tensor in zero.values())
    assert (tmp_path / "zero" / ADAPTER_CONFIG_FILE).read_text() == (
        adapter / ADAPTER_CONFIG_FILE
    ).read_text()


def test_lora_ids_are_stable_per_name() -> None:
    first, second = lora_int_id("ids-a"), lora_int_id("ids-b")
    assert first != second
    assert min(first, second) >= 1
    assert lora_int_id("ids-a") == first


def test_an_adapter_load_error_is_the_requests_refusal() -> None:
    refused = AdapterLoadError("adapter 'x' (/a): bad").error
    assert (refused.code, refused.param, refused.message) == (
        StageErrorCode.BAD_REQUEST,
        "model",
        "adapter 'x' (/a): bad",
    )
    failed = AdapterLoadError("engine gone", StageErrorCode.STAGE_FAILED).error
    assert failed.code == StageErrorCode.STAGE_FAILED
