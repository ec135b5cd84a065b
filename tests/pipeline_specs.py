"""Small OmniPipeline specs for the operator's unit tests (placement, render)."""

from __future__ import annotations

from typing import Any

from omni_operator.api import OmniPipelineSpec


def spec_of(stages: list[dict[str, Any]], **extra: Any) -> OmniPipelineSpec:
    """A pipeline of ``stages``, with a shared-memory and a TCP connector declared."""
    return OmniPipelineSpec.model_validate(
        {
            "model": "some/model",
            "stages": stages,
            "connectors": {
                "shm": {"name": "SharedMemoryConnector"},
                "tcp": {"name": "TCPConnector"},
            },
            **extra,
        }
    )


# What a stage_of stage on GPUs declares of their memory: small enough for the five stages
# a spec here puts on one GPU at most, since an LLM stage without a share counts as vLLM's
# default (0.92) and two of those on one GPU are refused.
GPU_SHARE = 0.2


def stage_of(stage_id: int, devices: str = "cpu", **fields: Any) -> dict[str, Any]:
    """An LLM stage named s<id> on ``devices`` (with GPU_SHARE of its GPUs' memory)."""
    stage: dict[str, Any] = {
        "stageId": stage_id,
        "name": f"s{stage_id}",
        "type": "llm",
        "devices": devices,
    }
    if devices not in ("cpu", ""):
        stage["gpuMemoryUtilization"] = GPU_SHARE
    return {**stage, **fields}
