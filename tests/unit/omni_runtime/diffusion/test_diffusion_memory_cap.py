"""A diffusion stage's gpuMemoryUtilization caps its process on its GPU, and only there.

No GPU is needed: torch.cuda's setter is replaced by a recorder, and the CPU path runs for
real.
"""

from __future__ import annotations

import pytest
import torch

from omni_runtime.config import load_pipeline
from omni_runtime.diffusion.engine_base import DiffusionEngineConfig, cap_gpu_memory, engine_device
from omni_runtime.entrypoints.stage_process import diffusion_engine_config

Calls = list[tuple[float, int]]


@pytest.fixture
def capped(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """The (fraction, device index) of each cap set; the current device is 3."""
    calls: Calls = []

    def record(fraction: float, device: int) -> None:
        calls.append((fraction, device))

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", record)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    return calls


def test_a_gpu_is_capped_at_the_stages_share(capped: Calls) -> None:
    cap_gpu_memory("cuda:1", 0.3)
    # "cuda" names no index: the process's current device.
    cap_gpu_memory("cuda", 0.55)
    assert capped == [(0.3, 1), (0.55, 3)]


def test_without_a_share_nothing_is_capped(capped: Calls) -> None:
    cap_gpu_memory("cuda:0", None)
    assert capped == []


def test_the_cpu_is_never_capped(capped: Calls) -> None:
    cap_gpu_memory("cpu", 0.3)
    assert capped == []


def test_the_cpu_path_runs_with_torch_itself() -> None:
    # Nothing replaced: on a machine without a GPU this must not touch CUDA at all.
    cap_gpu_memory("cpu", 0.3)
    config = DiffusionEngineConfig(model="m", device="cpu", gpu_memory_utilization=0.3)
    assert engine_device(config) == "cpu"


def test_the_engine_caps_the_gpu_it_chooses(capped: Calls, monkeypatch: pytest.MonkeyPatch) -> None:
    config = DiffusionEngineConfig(model="m", gpu_memory_utilization=0.4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_device(config) == "cpu"
    assert capped == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_device(config) == "cuda"
    assert capped == [(0.4, 3)]


def test_a_diffusion_stage_hands_its_share_to_its_engine() -> None:
    pipeline = load_pipeline(
        {
            "model": "m",
            "stages": [
                {"stageId": 0, "type": "llm", "devices": "0", "gpuMemoryUtilization": 0.45},
                {"stageId": 1, "type": "diffusion", "devices": "0", "gpuMemoryUtilization": 0.5},
                {"stageId": 2, "type": "diffusion", "devices": "1"},
            ],
        }
    )
    shares = [diffusion_engine_config(pipeline, pipeline.stage(i), "m") for i in (1, 2)]
    assert [config.gpu_memory_utilization for config in shares] == [0.5, None]
