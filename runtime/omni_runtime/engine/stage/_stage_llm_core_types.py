"""The LLM stage's wire types: vLLM's engine-core messages that are also stage markers.

Import them from ``stage_core_types``; they live here only so that importing that module
does not import vLLM.
"""

from __future__ import annotations

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest

from omni_runtime.engine.stage.stage_core_types import (
    StageCoreOutput,
    StageCoreOutputs,
    StageCoreRequest,
)


class StageLLMCoreRequest(EngineCoreRequest, StageCoreRequest):  # type: ignore[misc]
    """A vLLM engine-core request addressed to an LLM stage."""


class StageLLMCoreOutput(EngineCoreOutput, StageCoreOutput):  # type: ignore[misc]
    """A vLLM engine-core output of an LLM stage."""


class StageLLMCoreOutputs(EngineCoreOutputs, StageCoreOutputs):  # type: ignore[misc]
    """A vLLM engine-core outputs message of an LLM stage."""

    # Redeclared (same position) so that decoding yields the stage type, not vLLM's.
    outputs: list[StageLLMCoreOutput] = []
