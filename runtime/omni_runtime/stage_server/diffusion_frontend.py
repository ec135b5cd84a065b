"""StageDiffusionFrontend: a diffusion stage behind the stage server protocol.

An upstream stage's hidden states (and its negative prompt's, for guidance) arrive as
connector handles; they are fetched here, in the stage's process, straight from the
producer (the router never carries them), and go to the core as the request's
``prompt_embeds`` and ``negative_prompt_embeds``.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from omni_runtime import tracing
from omni_runtime.config import PipelineConfig, StageConfig
from omni_runtime.connectors import ConnectorError, ConnectorHandle, StageConnectors
from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase
from omni_runtime.engine.stage.stage_core_types import (
    StageDiffusionCoreOutput,
    StageDiffusionCoreOutputs,
    StageDiffusionCoreRequest,
    StageError,
    StageErrorCode,
    StageServerOutput,
    StageServerRequest,
)
from omni_runtime.stage_server.frontend import RequestSpans, StageFrontend, refusal


class StageDiffusionFrontend(StageFrontend):
    """Fetch upstream hidden states, run the request, return its images."""

    def __init__(
        self,
        pipeline: PipelineConfig,
        stage: StageConfig,
        client: StageCoreClientBase,
        connectors: StageConnectors,
    ) -> None:
        super().__init__(pipeline, stage, client, connectors)
        # Unique: the stage server refuses an id in flight before it gets here. In the
        # order sent: the core runs one request at a time, first come first served. Each
        # with its spans, while tracing.
        self._in_flight: dict[str, RequestSpans | None] = {}

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def unstarted(self) -> list[str]:
        # The oldest may be running; the ones behind it wait in the core's queue.
        return list(self._in_flight)[1:]

    async def add(self, request: StageServerRequest) -> list[StageServerOutput]:
        request_id = request.request_id
        if request.messages is not None:
            error = StageError.bad_request("messages: a diffusion stage takes a prompt", "messages")
            return [refusal(request_id, error)]
        spans = RequestSpans.of(self.stage, request)
        fetched: dict[str, np.ndarray | None] = {}
        for name in ("prompt_embeds", "negative_prompt_embeds"):
            handle = getattr(request, name)
            try:
                fetched[name] = None if handle is None else await self._fetch(handle, spans)
            except (ConnectorError, KeyError) as e:
                # The upstream stage's hand-off is gone or unreachable (its replica went
                # away before this one fetched it): not this request's fault, and not one
                # a resend here fixes. ``param`` names the lost input, so that the router
                # can run the request again from the first stage (orchestrator.py).
                failed = StageError(StageErrorCode.STAGE_FAILED, f"{name}: {e}", name)
                return [refusal(request_id, failed)]
        if spans is not None:
            spans.queued()
        self._in_flight[request_id] = spans
        try:
            await self.client.add_request_async(
                StageDiffusionCoreRequest(
                    request_id=request_id,
                    prompt=request.prompt,
                    params=request.params,
                    image=request.image,
                    prompt_embeds=fetched["prompt_embeds"],
                    negative_prompt_embeds=fetched["negative_prompt_embeds"],
                    # Fetched by the core itself: from shared memory it reads in place.
                    context_kv=request.context_kv,
                    no_image_context_kv=request.no_image_context_kv,
                )
            )
        except BaseException:
            self._in_flight.pop(request_id, None)
            raise
        return []

    async def next_outputs(self) -> list[StageServerOutput]:
        outputs = await self.client.get_outputs_async()
        assert isinstance(outputs, StageDiffusionCoreOutputs)
        return [self._convert(output) for output in outputs.outputs]

    async def abort(self, request_ids: list[str]) -> None:
        running = [i for i in request_ids if i in self._in_flight]
        if running:
            await self.client.abort_requests_async(running)

    async def _fetch(self, handle: ConnectorHandle, spans: RequestSpans | None) -> np.ndarray:
        connector = self.connectors.get(handle.connector)
        traced = spans.connector("get", handle.connector, handle.nbytes) if spans else None
        with traced or tracing.NO_SPAN:
            tensor = await asyncio.to_thread(connector.get, handle, "cpu")
        # The engine casts to its own dtype; float32 is what numpy can carry for bf16 too.
        array: np.ndarray = tensor.float().numpy()
        return array

    def _convert(self, output: StageDiffusionCoreOutput) -> StageServerOutput:
        spans = self._in_flight.pop(output.request_id, None)
        result = StageServerOutput(
            request_id=output.request_id,
            finished=True,
            images=output.images,
            execute_time=output.execute_time,
        )
        if output.aborted:
            result.finish_reason = "abort"
        elif output.error is not None:
            result.finish_reason = "error"
            result.error = output.error
        else:
            result.finish_reason = "stop"
        if spans is not None:
            if output.execute_time > 0:
                # The engine ran it for execute_time seconds, up to this output.
                spans.started(time.time_ns() - round(output.execute_time * 1e9))
            spans.finished(result)
        return result
