"""StageLLMInputs: the engine core's half of a request made of what an upstream stage
handed off.

A request to a stage whose architecture reads inputs (Qwen3-Omni's talker: the thinker's
rows and prompt ids; ``engine.models.INPUT_PROMPTS``) reaches its engine core with the
hand-offs' connector handles, not their arrays, and without a prompt. The core fetches the
arrays itself, through connectors of its own made from the pipeline's config, and finishes
the request as vLLM's front end would have: the architecture's checks of the arrays, its
prompt of them (placeholder ids; the arrays ride in the sampling params' extra args to the
model), then vLLM's renderer and InputProcessor. So an array goes from the producer to the
process that computes on it, as a DiT's core fetches its own (diffusion/engine_base.py),
and the stage server forwards handles only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.renderers import renderer_from_config
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.input_processor import InputProcessor

from omni_runtime.config import ConnectorConfig
from omni_runtime.connectors import ConnectorError, StageConnectors
from omni_runtime.engine.models import input_prompt
from omni_runtime.engine.stage.stage_core_types import (
    StageError,
    StageErrorCode,
    StageLLMCoreRequest,
)
from omni_runtime.engine.stage.stage_llm_request_builder import invalid_from_vllm

# What the core keeps of the request as its client sent it: vLLM's client fills these in
# on the way (which client, which wave, where a data parallel request was pinned).
_KEPT_FIELDS = ("client_index", "current_wave", "data_parallel_rank", "priority")


class InputsRefusedError(Exception):
    """A request whose inputs cannot be fetched or used; ``error`` is its answer."""

    def __init__(self, error: StageError) -> None:
        super().__init__(error.message)
        self.error = error


class StageLLMInputs:
    """Fetches a core's request inputs and makes the request of them (see the module)."""

    def __init__(self, vllm_config: VllmConfig, connectors: Mapping[str, Any]) -> None:
        """``connectors``: the pipeline's (name -> ConnectorConfig, or its JSON form)."""
        model_config = vllm_config.model_config
        self._vllm_config = vllm_config
        # None: the stage's model reads no inputs, and a request with some is refused.
        self.prompt: Any = input_prompt(model_config.architectures[0], model_config.hf_config)
        self._connectors = StageConnectors(
            {name: ConnectorConfig.model_validate(c) for name, c in connectors.items()}
        )
        self._input_processor: InputProcessor | None = None

    def fetch(self, request: StageLLMCoreRequest) -> dict[str, torch.Tensor]:
        """The request's inputs, on the CPU. InputsRefusedError (STAGE_FAILED) naming the
        first one lost in ``param``: its producer went away, and the router runs the
        request again from the first stage."""
        if self.prompt is None:
            self.discard(request)
            name = next(iter(request.inputs))
            raise InputsRefusedError(
                StageError.bad_request(
                    f"inputs.{name}: this stage's model reads no inputs (an LLM stage takes "
                    "text: prompt or messages)",
                    name,
                )
            )
        arrays: dict[str, torch.Tensor] = {}
        for name, hand_off in request.inputs.items():
            try:
                connector = self._connectors.get(hand_off.handle.connector)
                arrays[name] = connector.get(hand_off.handle, "cpu")
            except (ConnectorError, KeyError) as e:
                self.discard(request)
                message = f"{name}: {e}"
                raise InputsRefusedError(
                    StageError(StageErrorCode.STAGE_FAILED, message, param=name)
                ) from None
        return arrays

    def discard(self, request: StageLLMCoreRequest) -> None:
        """Free what ``request`` holds upstream, for one that ends before it runs: a get
        releases the producer's copy."""
        for hand_off in request.inputs.values():
            # Gone already, or never reachable: nothing left to free.
            with contextlib.suppress(ConnectorError, KeyError, ValueError):
                self._connectors.get(hand_off.handle.connector).get(hand_off.handle, "cpu")

    def finish(
        self, request: StageLLMCoreRequest, arrays: Mapping[str, torch.Tensor]
    ) -> StageLLMCoreRequest:
        """``request`` (from StageLLMRequestBuilder.build_with_inputs) with its prompt made
        of ``arrays``, through vLLM's input processing, as the engine runs it.
        InputsRefusedError: the arrays are not what the model reads (STAGE_FAILED: an
        upstream stage of another model, not the caller), or vLLM refuses the request."""
        assert self.prompt is not None
        issue = self.prompt.issue(arrays)
        if issue is not None:
            raise InputsRefusedError(StageError(StageErrorCode.STAGE_FAILED, issue))
        sampling = request.sampling_params
        if not isinstance(sampling, SamplingParams):
            raise InputsRefusedError(
                StageError.bad_request("sampling_params: required", "sampling_params")
            )
        placeholders = self.prompt.prepare(arrays, request.additional_information or {}, sampling)
        processor = self._processor()
        try:
            (engine_input,) = processor.renderer.render_cmpl([{"prompt_token_ids": placeholders}])
            built = processor.process_inputs(
                request.request_id,
                engine_input,
                sampling,
                ("generate",),
                arrival_time=request.arrival_time,
            )
        except (VLLMValidationError, ValueError) as e:
            raise InputsRefusedError(invalid_from_vllm(e, "params").error) from None
        fields = {name: getattr(built, name) for name in EngineCoreRequest.__struct_fields__}
        fields.update({name: getattr(request, name) for name in _KEPT_FIELDS})
        return StageLLMCoreRequest(**fields, additional_information=request.additional_information)

    def _processor(self) -> InputProcessor:
        # Made on the first request: an engine whose requests never have inputs needs none.
        if self._input_processor is None:
            renderer = renderer_from_config(self._vllm_config)
            self._input_processor = InputProcessor(self._vllm_config, renderer)
        return self._input_processor

    def close(self) -> None:
        self._connectors.close()
