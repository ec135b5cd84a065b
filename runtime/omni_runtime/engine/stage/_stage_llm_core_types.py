"""The LLM stage's wire types: vLLM's engine-core messages that are also stage markers.

Import them from ``stage_core_types``; they live here only so that importing that module
does not import vLLM.

The stage's own fields are appended after vLLM's: the structs are ``array_like``, so a
field's position is its identity on the wire. A message of vLLM's type therefore decodes
as the stage type (the stage's trailing fields take their defaults), which is what lets
vLLM's scheduler build the outputs a stage core sends; decoded as vLLM's type, a stage
message silently loses its trailing fields, so stage peers decode with the stage types.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason

from omni_runtime.engine.stage._stage_core_base import (
    HandOff,
    StageCoreOutput,
    StageCoreOutputs,
    StageCoreRequest,
    StageError,
)


class StageLLMCoreRequest(EngineCoreRequest, StageCoreRequest):  # type: ignore[misc]
    """A vLLM engine-core request addressed to an LLM stage."""

    # Per-request data for the stage's model beyond what vLLM carries, e.g. what an
    # upstream stage computed. StageLLMCoreProc puts it on the scheduled request
    # (StageLLMRequest.additional_information). Plain data only (str, numbers, lists,
    # maps): it is decoded untyped, so a tensor here would arrive as its raw parts.
    additional_information: dict[str, Any] | None = None
    # What upstream stages handed off for this request, by the name its model reads each
    # under (StageServerRequest.inputs): the core fetches them and makes the request's
    # prompt of them (StageLLMInputs), so the arrays never cross the stage server. A
    # request with inputs comes without its prompt.
    inputs: dict[str, HandOff] = {}


class StageLLMCoreOutput(EngineCoreOutput, StageCoreOutput):  # type: ignore[misc]
    """A vLLM engine-core output of an LLM stage."""

    # Why the stage refused the request before it reached the engine (finish_reason is
    # then FinishReason.ERROR).
    error: StageError | None = None


class StageLLMCoreOutputs(EngineCoreOutputs, StageCoreOutputs):  # type: ignore[misc]
    """A vLLM engine-core outputs message of an LLM stage."""

    # Redeclared (same position) so that decoding yields the stage type, not vLLM's.
    outputs: list[StageLLMCoreOutput] = []

    @classmethod
    def refusal(
        cls, request_id: str, error: StageError, *, still_in_flight: bool = False
    ) -> StageLLMCoreOutputs:
        """The answer to a request the stage refused: its one, final output, saying why.

        ``finished_requests`` lets a data parallel client forget which core had the id;
        ``still_in_flight`` (a refused duplicate: the first request under the id goes on)
        leaves the id out of it, so that the client keeps routing the id, and aborts of
        the first request, to that core.
        """
        output = StageLLMCoreOutput(
            request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=error
        )
        return cls(outputs=[output], finished_requests=None if still_in_flight else {request_id})
