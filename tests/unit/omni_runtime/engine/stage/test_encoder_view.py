"""The directory an encoder stage loads a diffusers checkpoint's text encoder from."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from omni_runtime.engine.stage.stage_llm_engine_config import (
    StageLLMConfigError,
    encoder_model_view,
)
from omni_runtime.families import FAMILIES

EDIT = FAMILIES["qwen-image-edit"].encoder


def checkpoint(root: Path) -> Path:
    for folder, names in {
        "text_encoder": ["config.json", "model.safetensors"],
        "processor": ["config.json", "preprocessor_config.json", "tokenizer.json"],
    }.items():
        (root / folder).mkdir(parents=True)
        for name in names:
            (root / folder / name).write_text(f"{folder}/{name}")
    return root


def test_view_links_weights_and_processor_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = checkpoint(tmp_path / "ckpt")
    view = Path(encoder_model_view(str(ckpt), EDIT))
    assert sorted(os.listdir(view)) == [
        "config.json",
        "model.safetensors",
        "preprocessor_config.json",
        "tokenizer.json",
    ]
    # The weights' own config wins over the processor's.
    assert (view / "config.json").read_text() == "text_encoder/config.json"
    assert (view / "tokenizer.json").read_text() == "processor/tokenizer.json"


def test_replicas_starting_together_share_one_whole_view(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = checkpoint(tmp_path / "ckpt")
    with ThreadPoolExecutor(8) as pool:
        views = set(pool.map(lambda _: encoder_model_view(str(ckpt), EDIT), range(8)))
    (view,) = views
    assert len(os.listdir(view)) == 4
    # Nothing half built is left beside it.
    assert os.listdir(Path(view).parent) == [Path(view).name]


def test_a_checkpoint_without_the_folders_names_them(tmp_path: Path) -> None:
    (tmp_path / "text_encoder").mkdir()
    with pytest.raises(StageLLMConfigError, match="has no processor/"):
        encoder_model_view(str(tmp_path), EDIT)
