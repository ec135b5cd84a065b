"""OpenAIServing: what every endpoint shares, over one pipeline's stage pools.

It admits a request (within the router's concurrency limit), runs it through the
orchestrator to its end or as a stream, aborts it when the client leaves, and picks the
LoRA adapters its model names. Each endpoint (``router.endpoints``) turns its bodies into
pipeline requests and builds its answers on these, as vLLM's serving classes build on its
``OpenAIServing``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping

from fastapi import Request
from fastapi.responses import Response

from omni_runtime.config import PipelineConfig
from omni_runtime.engine.stage.stage_core_types import StageAdapter, StageServerOutput
from omni_runtime.router.adapters import AdapterCatalog
from omni_runtime.router.errors import error_body
from omni_runtime.router.limits import RouterLimits
from omni_runtime.router.metrics import RouterMetrics
from omni_runtime.router.orchestrator import PipelineError, PipelineOrchestrator
from omni_runtime.router.request_fields import LORA_SCALE_FIELD
from omni_runtime.router.responses import ChunkWriter, JSONBody, StreamWithCleanup, sse, usage
from omni_runtime.router.served import Served
from omni_runtime.router.stage_replica_pool import StageReplicaPool
from omni_runtime.router.stage_requests import PipelineRequest


def served_model_name(pipeline: PipelineConfig) -> str:
    """The model name clients send: the router's setting, else the model's last path part."""
    return pipeline.served_model_name


class OpenAIServing:
    """What the router's endpoints share, over one pipeline's stage pools."""

    def __init__(
        self,
        pipeline: PipelineConfig,
        pools: Mapping[int, StageReplicaPool],
        metrics: RouterMetrics,
        *,
        limits: RouterLimits | None = None,
        model_name: str | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.pools = dict(pools)
        self.metrics = metrics
        self.orchestrator = PipelineOrchestrator(
            pipeline,
            pools,
            on_retry=metrics.retried,
            on_served=metrics.stage_served,
            on_revision=metrics.request_revision,
        )
        self.limits = limits or RouterLimits()
        self.served_model_name = model_name or served_model_name(pipeline)
        self.adapters = AdapterCatalog(pipeline, self.served_model_name)
        # What the pipeline serves and where, which each endpoint asks once.
        self.served = Served.of(pipeline, self.orchestrator.output_kind)
        self.in_flight = 0

    def health(self) -> JSONBody:
        live = {
            stage.name: self.pools[stage.stage_id].live_replica_count
            for stage in self.orchestrator.stages
        }
        missing = [name for name, count in live.items() if count == 0]
        try:
            revision = self.orchestrator.choose_revision()
        except PipelineError as e:
            # Every stage may have replicas while no revision has all: nothing can be served.
            error = "no live replica for stage(s): " + ", ".join(missing) if missing else e.message
            return JSONBody(
                {"status": "unavailable", "error": error, "live_replicas": live},
                status_code=503,
            )
        return JSONBody({"status": "ok", "live_replicas": live, "revision": revision})

    async def close(self) -> None:
        for pool in self.pools.values():
            await pool.close()

    # -- running requests --------------------------------------------------------------

    def pick_adapters(
        self, model: str | None, body: object, request: PipelineRequest | None = None
    ) -> dict[int, StageAdapter]:
        """The adapter of each stage that ``model`` picks, scaled by the body's lora_scale
        (which ``request``'s DiT params carry and lose here: it is the adapter's, not the
        pipeline's); RequestError (404 for a name not served) names the field."""
        scale = getattr(body, LORA_SCALE_FIELD, None)
        if request is not None:
            request.diffusion_params.pop(LORA_SCALE_FIELD, None)
        return self.adapters.pick(model, None if scale is None else float(scale))

    def admit(self) -> None:
        """Count a request in; refuse it when the router holds its limit already."""
        if self.in_flight >= self.limits.max_concurrent_requests:
            raise PipelineError(
                429,
                f"the router is at its limit of {self.limits.max_concurrent_requests} "
                "concurrent requests; retry shortly",
                kind="rate_limit_exceeded",
                retry_after=1.0,
            )
        self.in_flight += 1

    async def run_to_end(self, request: PipelineRequest, http: Request) -> list[StageServerOutput]:
        """Every output of ``request``, aborting it if the client goes away first."""
        self.admit()
        try:
            return await _until_disconnected(http, self.orchestrator.complete(request))
        finally:
            self.in_flight -= 1

    async def open_stream(
        self, request: PipelineRequest
    ) -> tuple[
        StageServerOutput,
        AsyncGenerator[StageServerOutput, None],
        Callable[[], Awaitable[None]],
    ]:
        """The first output of a streamed request, the rest of them, and what releases the
        request (idempotent: it runs when the stream ends, and again when the response does,
        as a client gone before the first event never starts the stream)."""
        self.admit()
        admitted = True
        outputs = self.orchestrator.run(request)

        async def release() -> None:
            nonlocal admitted
            await outputs.aclose()
            if admitted:
                admitted = False
                self.in_flight -= 1

        # The first output is awaited before the response starts, so that a request the
        # stage refuses still gets its 4xx status rather than an error inside a 200 stream.
        try:
            first = await anext(outputs)
        except BaseException:
            await release()
            raise
        return first, outputs, release

    async def stream_text(
        self, request: PipelineRequest, http: Request, include_usage: bool, chunks: ChunkWriter
    ) -> Response:
        first, outputs, release = await self.open_stream(request)

        async def events() -> AsyncIterator[bytes]:
            try:
                opening = chunks.opening()
                if opening:
                    yield opening
                output, last = first, first
                while True:
                    last = output
                    if output.text or output.finished:
                        yield chunks.text(
                            output.text, output.finish_reason if output.finished else None
                        )
                    if output.finished:
                        break
                    following = await anext(outputs, None)
                    if following is None:
                        break
                    output = following
                if include_usage:
                    yield chunks.usage(usage(last))
            except PipelineError as e:
                yield sse(error_body(e.status, e.message, kind=e.kind, param=e.param))
            finally:
                await release()
            yield b"data: [DONE]\n\n"

        return StreamWithCleanup(events(), release)


async def _until_disconnected(
    http: Request, work: Awaitable[list[StageServerOutput]]
) -> list[StageServerOutput]:
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(http))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            # The client is gone: cancelling the work aborts the request in its stage.
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise PipelineError(499, "the client closed the connection", kind="client_closed")
        return task.result()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(http: Request) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return
