"""StageDiffusionFrontend: a diffusion stage behind the stage server protocol.

What upstream stages handed off for a request arrives as named hand-offs (connector handles)
and goes on to the core as they are: the core fetches each, straight from the producer onto
its own device (the router and this process never carry the arrays).

A request's LoRA adapter goes on to the core too, which loads it on first use and keeps its
stage's capacity of them (least recently used evicted); ``adapters`` mirrors that cache as
requests are sent, and forgets an adapter whose load the core says failed.
"""

from __future__ import annotations

import time

from omni_runtime.config import PipelineConfig, StageConfig
from omni_runtime.connectors import StageConnectors
from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase
from omni_runtime.engine.stage.stage_core_types import (
    HandOff,
    StageAdapter,
    StageDiffusionCoreOutput,
    StageDiffusionCoreOutputs,
    StageDiffusionCoreRequest,
    StageError,
    StageServerOutput,
    StageServerRequest,
)
from omni_runtime.stage_server.frontend import RequestSpans, StageFrontend, refusal


class StageDiffusionFrontend(StageFrontend):
    """Pass a request and its hand-offs to the core, return its images."""

    def __init__(
        self,
        pipeline: PipelineConfig,
        stage: StageConfig,
        client: StageCoreClientBase,
        connectors: StageConnectors,
    ) -> None:
        super().__init__(pipeline, stage, client, connectors)
        # Unique: the stage server refuses an id in flight before it gets here. In the
        # order sent: the core runs one request at a time, first come first served (but
        # for one whose adapter is being read, which lets those behind it go first). Each
        # with its spans, while tracing, its hand-offs and its adapter.
        self._in_flight: dict[
            str, tuple[RequestSpans | None, dict[str, HandOff], StageAdapter | None]
        ] = {}
        # The core's describe() as its start carried it (the client's ``info``; fixed for
        # the pipeline it loaded), so that the stage server reports it without asking the
        # core, which answers nothing while it runs a request.
        info = getattr(client, "info", None)
        multiple = info.get("size_multiple") if isinstance(info, dict) else None
        self._size_multiple = multiple if isinstance(multiple, int) and multiple > 0 else 0

    @property
    def size_multiple(self) -> int:
        return self._size_multiple

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
        adapter_error = self.adapter_refusal(request)
        if adapter_error is not None:
            return [refusal(request_id, adapter_error)]
        spans = RequestSpans.of(self.stage, request)
        if spans is not None:
            spans.queued()
        self._in_flight[request_id] = (spans, request.inputs, request.adapter)
        try:
            await self.client.add_request_async(
                StageDiffusionCoreRequest(
                    request_id=request_id,
                    prompt=request.prompt,
                    params=request.params,
                    images=request.images,
                    inputs=request.inputs,
                    adapter=request.adapter,
                )
            )
        except BaseException:
            self._in_flight.pop(request_id, None)
            raise
        if request.adapter is not None and self.adapters is not None:
            # The core loads it when the request runs, evicting as this does.
            self.adapters.use(request.adapter.name)
        return []

    async def load_adapter(self, adapter: StageAdapter) -> str | None:
        # The core reads and checks it against its DiT; its first request injects it.
        why: str | None = await self.client.collective_rpc_async(
            "check_adapter",
            kwargs={"name": adapter.name, "source": adapter.source, "scale": adapter.scale},
        )
        return why

    async def next_outputs(self) -> list[StageServerOutput]:
        outputs = await self.client.get_outputs_async()
        assert isinstance(outputs, StageDiffusionCoreOutputs)
        return [self._convert(output) for output in outputs.outputs]

    async def abort(self, request_ids: list[str]) -> None:
        running = [i for i in request_ids if i in self._in_flight]
        if running:
            await self.client.abort_requests_async(running)

    def _convert(self, output: StageDiffusionCoreOutput) -> StageServerOutput:
        if not output.final:
            # A partial image, or progress: the request goes on.
            return StageServerOutput(
                request_id=output.request_id,
                images=output.images,
                partial_index=output.partial_index,
                progress=output.progress,
            )
        spans, inputs, adapter = self._in_flight.pop(output.request_id, (None, {}, None))
        result = StageServerOutput(
            request_id=output.request_id,
            finished=True,
            images=output.images,
            audio=output.audio,
            execute_time=output.execute_time,
        )
        if output.aborted:
            result.finish_reason = "abort"
        elif output.error is not None:
            result.finish_reason = "error"
            result.error = output.error
            if adapter is not None and self.adapters is not None and output.error.param == "model":
                # The core could not load it (the error names its file): not held there.
                self.adapters.discard(adapter.name)
        else:
            result.finish_reason = "stop"
        if spans is not None:
            if output.execute_time > 0:
                # The engine ran it for execute_time seconds, up to this output, fetching
                # its inputs first.
                started = time.time_ns() - round(output.execute_time * 1e9)
                spans.started(started)
                if inputs and output.fetch_time > 0:
                    handles = [hand_off.handle for hand_off in inputs.values()]
                    connector = ",".join(sorted({handle.connector for handle in handles}))
                    nbytes = sum(handle.nbytes for handle in handles)
                    spans.connector_get(connector, nbytes, round(output.fetch_time * 1e9))
            spans.finished(result)
        return result
