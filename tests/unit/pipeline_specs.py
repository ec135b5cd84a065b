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


def stage_of(stage_id: int, devices: str = "cpu", **fields: Any) -> dict[str, Any]:
    """An LLM stage named s<id> on ``devices``."""
    return {
        "stageId": stage_id,
        "name": f"s{stage_id}",
        "type": "llm",
        "devices": devices,
        **fields,
    }
