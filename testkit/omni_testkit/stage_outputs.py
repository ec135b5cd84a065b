"""What the stage tests (and bench/) share: reading a stage client's outputs to its end.

An LLM stage streams: one StageLLMCoreOutput per engine step per request, each with the
new token ids of that step (a generate stage) or, once, the hidden states of the prompt
(an encode stage); the last one has a finish reason. StageLLMResult joins them in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.engine import FinishReason

from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase, StageCoreDeadError
from omni_runtime.engine.stage.stage_core_types import (
    StageAdapter,
    StageError,
    StageLLMCoreOutput,
    StageLLMCoreOutputs,
)
from omni_runtime.engine.stage.stage_llm_core_client import AdapterLoadError
from omni_runtime.engine.stage.stage_llm_request_builder import InvalidLLMRequestError


async def outputs_until_dead(
    client: StageCoreClientBase, timeout: float = 10
) -> tuple[list[Any], StageCoreDeadError]:
    """Every output the client still delivers, and the error that ends them; TimeoutError
    if the stage has not died within ``timeout`` seconds."""
    outputs: list[Any] = []
    async with asyncio.timeout(timeout):
        while True:
            try:
                outputs.extend((await client.get_outputs_async()).outputs)  # type: ignore[attr-defined]
            except StageCoreDeadError as death:
                return outputs, death


@dataclass
class StageLLMResult:
    """One request's outputs so far, joined."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    # [prompt tokens, hidden size], float32 (an encode stage).
    hidden_states: torch.Tensor | None = None
    finish_reason: FinishReason | None = None
    error: StageError | None = None
    # How many outputs arrived, and which data parallel engine sent them.
    num_outputs: int = 0
    engine_index: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def aborted(self) -> bool:
        return bool(self.finish_reason == FinishReason.ABORT)

    def add(self, output: StageLLMCoreOutput, engine_index: int = 0) -> None:
        if self.finished:
            raise ValueError(f"request {self.request_id}: an output after its last one")
        self.num_outputs += 1
        self.engine_index = engine_index
        self.token_ids.extend(output.new_token_ids)
        if output.pooling_output is not None:
            self.hidden_states = output.pooling_output
        if output.error is not None:
            self.error = output.error
        if output.finish_reason is not None:
            self.finish_reason = FinishReason(output.finish_reason)


async def collect_results(
    client: StageCoreClientBase, request_ids: Collection[str], timeout: float | None = None
) -> dict[str, StageLLMResult]:
    """Wait until every request in ``request_ids`` (already added) has finished.

    The client must be this caller's alone: outputs of other requests are not expected.
    Raises StageCoreDeadError if the stage dies, TimeoutError after ``timeout`` seconds.
    """
    results = {request_id: StageLLMResult(request_id) for request_id in request_ids}
    pending = set(results)
    async with asyncio.timeout(timeout):
        while pending:
            outputs = await client.get_outputs_async()
            assert isinstance(outputs, StageLLMCoreOutputs)
            for output in outputs.outputs:
                results[output.request_id].add(output, outputs.engine_index)
                if output.finish_reason is not None:
                    pending.discard(output.request_id)
    return results


async def add_prompt(
    client: Any, request_id: str, *, adapter: StageAdapter | None = None, **build: Any
) -> None:
    """Build a request with an LLM client's request builder (``build``: its prompt, params,
    ...) and add it. A request the builder refuses, or whose ``adapter`` does not load, is
    answered as a core answers one it refuses: an output with ``error`` set."""
    try:
        lora = client.base_lora if adapter is None else await client.load_adapter_async(adapter)
        request = client.request_builder.build(request_id, lora_request=lora, **build)
    except (AdapterLoadError, InvalidLLMRequestError) as e:
        client.outputs_queue.put_nowait(StageLLMCoreOutputs.refusal(request_id, e.error))
        return
    await client.add_request_async(request)


def core_pids(client: Any) -> list[int]:
    """The pids of an LLM client's cores, one per data parallel rank."""
    return [process.pid for process in client.proc_manager.processes]
