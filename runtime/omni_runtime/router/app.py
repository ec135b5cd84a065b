"""The router's HTTP app: the endpoints' rooms (``router.endpoints``) wired to one
pipeline's serving, with the error handlers, the middleware and the OpenAPI document.

    POST /v1/chat/completions    text (``stream`` as SSE) for pipelines ending in an LLM;
                                 ``modalities: ["image"]`` for pipelines ending in diffusion
    POST /v1/completions         a text prompt continued (no chat template), ``stream`` as
                                 SSE; pipelines whose first stage is an LLM, answering text
    POST /tokenize, /detokenize  vLLM's: token ids of a prompt (or a conversation through
                                 the chat template) and back, by the first stage's tokenizer
    POST /v1/images/generations  b64_json images
    POST /v1/images/edits        b64_json images from an input image (multipart/form-data:
                                 image, prompt, n, size, ...; image-to-image diffusion)
    POST /v1/videos              a video job (multipart/form-data or JSON: prompt, seconds,
                                 size, input_reference, ...), for pipelines whose DiT makes
                                 videos; GET /v1/videos[/{id}[/content]] and DELETE
                                 /v1/videos/{id} as OpenAI's Videos API (router.video_jobs)
    GET  /v1/models              the one served model
    GET  /health                 200 when some pipeline revision has a live replica of every
                                 stage (the one requests run on now), else 503 saying why
    GET  /livez                  200 while the process serves (liveness: not about replicas)
    GET  /metrics                Prometheus
    GET  /openapi.json           the API's OpenAPI document (``router.openapi``)

Every path is routed whatever the pipeline; one that does not serve it answers 400 saying
what it serves and where (``router.served``), and the document lists only those that do.
With API keys (router.auth), every path but the probes (and /metrics, unless the pipeline's
``router.metricsNeedApiKey``) answers 401 to a request without ``Authorization: Bearer``
and one of them. Errors are OpenAI-shaped: ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx/5xx status, Starlette's own 404 and 405 and an unexpected exception's
500 included.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_runtime.config import PipelineConfig
from omni_runtime.router.auth import ApiKeys, RequireApiKey, open_paths
from omni_runtime.router.endpoints import (
    adapters,
    chat,
    completions,
    images,
    models,
    probes,
    tokenize,
)
from omni_runtime.router.endpoints.adapters import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from omni_runtime.router.endpoints.bodies import request_models
from omni_runtime.router.endpoints.chat import ChatCompletionChunk
from omni_runtime.router.endpoints.completions import CompletionRequest
from omni_runtime.router.endpoints.images import ImageStreamEvent
from omni_runtime.router.endpoints.tokenize import DetokenizeRequest, TokenizeRequest
from omni_runtime.router.endpoints.videos import VideoCreateRequest, VideosRoom
from omni_runtime.router.errors import RequestError, error_body, error_response
from omni_runtime.router.job_store import JobStoreError
from omni_runtime.router.limits import RouterLimits
from omni_runtime.router.metrics import RouterMetrics, batch_slots
from omni_runtime.router.openapi import openapi_document
from omni_runtime.router.orchestrator import PipelineError
from omni_runtime.router.responses import JSONBody
from omni_runtime.router.serving import OpenAIServing, served_model_name
from omni_runtime.router.stage_replica_pool import StageReplicaPool
from omni_runtime.tracing import TraceRequests


def create_app(
    pipeline: PipelineConfig,
    pools: Mapping[int, StageReplicaPool],
    *,
    limits: RouterLimits | None = None,
    model_name: str | None = None,
    lifespan: Callable[[FastAPI], Any] | None = None,
    api_keys: ApiKeys | None = None,
    state_dir: Path | None = None,
) -> FastAPI:
    """The router app over ``pools`` (one per stage id; the caller fills them), asking
    for one of ``api_keys`` (router.auth) when given. A video pipeline without a Redis
    store keeps its jobs under ``state_dir`` (None: videos.DEFAULT_STATE_DIR/<model>)."""
    names = {stage.stage_id: stage.name for stage in pipeline.stages}
    metrics = RouterMetrics(
        lambda: {names[i]: pool for i, pool in pools.items()},
        model_name=model_name or served_model_name(pipeline),
        batch_slots={stage.name: batch_slots(stage) for stage in pipeline.stages},
    )
    for pool in pools.values():
        pool.on_request_done = metrics.stage_request_done
        pool.on_adapter_placed = metrics.adapter_placed
    serving = OpenAIServing(pipeline, pools, metrics, limits=limits, model_name=model_name)
    metrics.in_flight = lambda: serving.in_flight
    # The image-making bodies take the pipeline's family's own fields, and no other's.
    dit_adapters = serving.adapters.dit_takes_adapters
    bodies = request_models(pipeline.family_recipe, pipeline.step_cache_tiers, dit_adapters)
    videos = VideosRoom(serving, state_dir)

    @asynccontextmanager
    async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
        videos.start()
        app.state.videos = videos.jobs
        try:
            if lifespan is None:
                yield
            else:
                async with lifespan(app):
                    yield
        finally:
            await videos.close()
            await serving.close()

    app = FastAPI(title="omni-runtime router", lifespan=_lifespan, docs_url=None, redoc_url=None)
    app.state.router = serving
    app.include_router(chat.routes(serving, bodies.chat))
    app.include_router(completions.routes(serving))
    app.include_router(tokenize.routes(serving))
    app.include_router(images.routes(serving, bodies.images, bodies.edits))
    app.include_router(videos.routes())
    app.include_router(models.routes(serving))
    app.include_router(adapters.routes(serving))
    app.include_router(probes.routes(serving))

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, error: RequestError) -> Response:
        return error_response(error)

    @app.exception_handler(PipelineError)
    async def _pipeline_error(request: Request, error: PipelineError) -> Response:
        return error_response(error)

    @app.exception_handler(JobStoreError)
    async def _store_error(request: Request, error: JobStoreError) -> Response:
        # The store is down or refuses us: the job is neither lost nor made; retry later.
        return JSONBody(
            error_body(503, f"the video job store failed: {error}", kind="service_unavailable"),
            status_code=503,
            headers={"Retry-After": "5"},
        )

    # Starlette's own answers (an unknown path, a method a path does not take) in the
    # shape of every other error, so that a client parses one error format.
    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException) -> Response:
        headers = error.headers
        if error.status_code == 404:
            message = f"no such path: {request.url.path} (the API is under /v1; GET /openapi.json)"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
            # A path's methods may be routes of their own (each its own operation): Allow
            # lists them all, not only the first route's.
            headers = {**(headers or {}), "Allow": ", ".join(_methods(app, request.scope))}
        else:
            message = str(error.detail)
        return JSONBody(
            error_body(error.status_code, message), status_code=error.status_code, headers=headers
        )

    # A bug must still answer in the API's error shape (Starlette logs the traceback).
    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> Response:
        return JSONBody(error_body(500, "internal error in the router"), status_code=500)

    guarded = open_paths(bool(pipeline.router.metrics_need_api_key))

    def _openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(
                title=app.title,
                version=app.version,
                routes=app.routes,
                bodies=bodies,
                unseen=(
                    CompletionRequest,
                    TokenizeRequest,
                    DetokenizeRequest,
                    LoadLoraAdapterRequest,
                    UnloadLoraAdapterRequest,
                    VideoCreateRequest,
                    ChatCompletionChunk,
                    ImageStreamEvent,
                ),
                model_name=serving.served_model_name,
                served=serving.served,
                limits=serving.limits,
                family=pipeline.family_recipe,
                open_paths=guarded if api_keys is not None else None,
            )
        return app.openapi_schema

    app.openapi = _openapi  # type: ignore[method-assign]

    # Each added around the ones before: requests refused for their key are counted, and
    # the request's span (outermost) covers everything the router does for it.
    if api_keys is not None:
        app.add_middleware(RequireApiKey, keys=api_keys, open_paths=guarded)
    app.add_middleware(_CountRequests, metrics=metrics)
    app.add_middleware(TraceRequests)
    return app


def _methods(app: FastAPI, scope: Scope) -> list[str]:
    """The methods some route of ``scope``'s path takes."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches({**scope, "method": ""})
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


_V1_PATHS = frozenset(
    (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/images/generations",
        "/v1/images/edits",
        "/v1/videos",
        "/v1/models",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    )
)


class _CountRequests:
    """Counts /v1 requests by status and times them to their last byte.

    Plain ASGI rather than Starlette's BaseHTTPMiddleware, which wraps ``receive`` and
    would hide a client's disconnect from the endpoints that watch for it.
    """

    def __init__(self, app: ASGIApp, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        # A label per path a client makes up would grow the registry without bound.
        endpoint = path if path in _V1_PATHS else "other"
        start = time.perf_counter()
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.request_latency.labels(endpoint).observe(time.perf_counter() - start)
