"""The router's HTTP API: OpenAI-compatible paths bound to ``OpenAIServing``.

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

With API keys (router.auth), every path but the probes (and /metrics, unless the pipeline's
``router.metricsNeedApiKey``) answers 401 to a request without ``Authorization: Bearer``
and one of them.

This module binds paths, reads bodies and maps errors; what a request does is in
``router.serving``, what a body may hold in ``router.protocol``. Errors are OpenAI-shaped:
``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status, Starlette's
own 404 and 405 and an unexpected exception's 500 included.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_runtime.config import VIDEO_STORE_PASSWORD_ENV, PipelineConfig, VideoJobsConfig
from omni_runtime.engine.stage.stage_replica_pool import StageReplicaPool
from omni_runtime.router.auth import ApiKeys, RequireApiKey, open_paths
from omni_runtime.router.job_store import JobStoreError, open_job_store
from omni_runtime.router.metrics import RouterMetrics, batch_slots
from omni_runtime.router.openapi import openapi_document
from omni_runtime.router.orchestrator import PipelineError
from omni_runtime.router.protocol import (
    INPUT_REFERENCE,
    CompletionRequest,
    DetokenizeRequest,
    FileParts,
    ImageEditForm,
    LoadLoraAdapterRequest,
    RequestError,
    RouterLimits,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    VideoCreateRequest,
    body_too_large,
    decode_json,
    parse_body,
    request_models,
)
from omni_runtime.router.serving import (
    JSONBody,
    OpenAIServing,
    error_body,
    error_response,
    served_model_name,
)
from omni_runtime.router.video_jobs import VideoJobs, video_object
from omni_runtime.tracing import TraceRequests

# Where an embedded video store keeps its jobs (a pipeline's own directory below it) when
# the router is given none: it outlives the router, so a restart loses no job.
DEFAULT_STATE_DIR = Path("~/.cache/omni-runtime/videos")


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
    store keeps its jobs under ``state_dir`` (None: DEFAULT_STATE_DIR/<model>)."""
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

    recipe = pipeline.video_recipe
    family = pipeline.family_recipe
    videos_config = pipeline.router.videos or VideoJobsConfig()
    videos: VideoJobs | None = None

    @asynccontextmanager
    async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal videos
        if recipe is not None:
            name = serving.served_model_name
            store = open_job_store(
                videos_config.store_url,
                (state_dir or DEFAULT_STATE_DIR / name).expanduser(),
                prefix=f"omni-videos:{name}",
                password=os.environ.get(VIDEO_STORE_PASSWORD_ENV),
            )
            videos = VideoJobs(
                store,
                serving.orchestrator,
                videos_config,
                recipe,
                model_name=name,
                limits=serving.limits,
                takes_image=family.dit.takes_image if family is not None else True,
                requires_image=family is not None and family.dit.requires_image,
                sized_by_image=family is not None and family.dit.sized_by_image,
                adapters=serving.adapters if serving.adapters.takes_adapters else None,
            )
            videos.start()
            app.state.videos = videos
        try:
            if lifespan is None:
                yield
            else:
                async with lifespan(app):
                    yield
        finally:
            if videos is not None:
                await videos.close()
            await serving.close()

    def _videos() -> VideoJobs:
        if videos is None:
            raise RequestError(
                400,
                f"this pipeline makes {serving.orchestrator.output_kind}, not videos; "
                + (
                    "use /v1/images/generations"
                    if serving.orchestrator.output_kind == "image"
                    else "use /v1/chat/completions"
                ),
            )
        return videos

    app = FastAPI(title="omni-runtime router", lifespan=_lifespan, docs_url=None, redoc_url=None)
    app.state.router = serving

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
        if error.status_code == 404:
            message = f"no such path: {request.url.path} (the API is under /v1; GET /openapi.json)"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(error.detail)
        return JSONBody(
            error_body(error.status_code, message),
            status_code=error.status_code,
            headers=error.headers,
        )

    # A bug must still answer in the API's error shape (Starlette logs the traceback).
    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> Response:
        return JSONBody(error_body(500, "internal error in the router"), status_code=500)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_body(bodies.chat, await read_json(request, serving.limits))
        return await serving.chat(body, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_body(CompletionRequest, await read_json(request, serving.limits))
        return await serving.completions(body, request)

    # vLLM's paths, outside /v1 as vLLM serves them (its benchmark client aligns its
    # prompts with them).
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = parse_body(TokenizeRequest, await read_json(request, serving.limits))
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = parse_body(DetokenizeRequest, await read_json(request, serving.limits))
        return await serving.detokenize(body)

    @app.post("/v1/images/generations")
    async def images_generations(request: Request) -> Response:
        body = parse_body(bodies.images, await read_json(request, serving.limits))
        return await serving.images(body, request)

    @app.post("/v1/images/edits")
    async def images_edits(request: Request) -> Response:
        body, images = (await read_form(request, serving.limits, bodies.edits)).finish()
        return await serving.image_edits(body, images, request)

    async def videos_create(request: Request) -> Response:
        jobs = _videos()
        content_type = request.headers.get("content-type", "")
        files: list[bytes] = []
        if content_type.split(";")[0].strip().lower() == "application/json":
            body = parse_body(VideoCreateRequest, await read_json(request, serving.limits))
        else:
            form = await read_form(request, serving.limits, VideoCreateRequest, INPUT_REFERENCE)
            body, files = form.finish()
        return JSONBody(video_object(await jobs.create(body, files)))

    async def videos_list(request: Request) -> Response:
        query = request.query_params
        limit = query.get("limit")
        if limit is not None and not limit.isdigit():
            raise RequestError(400, f"limit: an integer, 1 to 100 (got {limit!r})", "limit")
        page = await _videos().page(
            query.get("after"), None if limit is None else int(limit), query.get("order")
        )
        return JSONBody(page)

    # One route per path with all its methods, so that a 405 lists them all in Allow.
    @app.api_route("/v1/videos", methods=["GET", "POST"])
    async def videos_route(request: Request) -> Response:
        if request.method == "GET":
            return await videos_list(request)
        return await videos_create(request)

    @app.api_route("/v1/videos/{video_id}", methods=["GET", "DELETE"])
    async def video_route(video_id: str, request: Request) -> Response:
        if request.method == "DELETE":
            return JSONBody(await _videos().delete(video_id))
        return JSONBody(video_object(await _videos().get(video_id)))

    @app.get("/v1/videos/{video_id}/content")
    async def videos_content(video_id: str, variant: str = "video") -> Response:
        if variant != "video":
            raise RequestError(
                400, f"variant: only 'video' is made here (got {variant!r})", param="variant"
            )
        data = await _videos().content(video_id)
        return Response(data, media_type="video/mp4")

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONBody(serving.models())

    if serving.adapters.takes_adapters:
        # vLLM's paths for adapters added at run time (behind the API key, as all of /v1).
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            body = parse_body(LoadLoraAdapterRequest, await read_json(request, serving.limits))
            return await serving.load_adapter(body)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            body = parse_body(UnloadLoraAdapterRequest, await read_json(request, serving.limits))
            return serving.unload_adapter(body)

    @app.get("/health")
    async def health() -> Response:
        return serving.health()

    @app.get("/livez")
    async def livez() -> Response:
        return JSONBody({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    guarded = open_paths(bool(pipeline.router.metrics_need_api_key))

    def _openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(
                title=app.title,
                version=app.version,
                model_name=serving.served_model_name,
                output_kind=serving.orchestrator.output_kind,
                limits=serving.limits,
                open_paths=guarded if api_keys is not None else None,
                family=pipeline.family_recipe,
                step_cache_tiers=pipeline.step_cache_tiers,
                dit_adapters=dit_adapters,
                adapters=serving.adapters.takes_adapters,
            )
        return app.openapi_schema

    # The handlers read raw bodies (within the limits), so FastAPI's generator would
    # document none: the document is built from the request models instead.
    app.openapi = _openapi  # type: ignore[method-assign]

    # Each added around the ones before: requests refused for their key are counted, and
    # the request's span (outermost) covers everything the router does for it.
    if api_keys is not None:
        app.add_middleware(RequireApiKey, keys=api_keys, open_paths=guarded)
    app.add_middleware(_CountRequests, metrics=metrics)
    app.add_middleware(TraceRequests)
    return app


async def read_json(request: Request, limits: RouterLimits) -> Any:
    """The request's JSON body, read with the size limit; RequestError if it is not."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise RequestError(
            415, f"Content-Type must be application/json (got {content_type or 'none'!r})"
        )
    _check_declared_length(request, limits)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise body_too_large(limits)
        chunks.append(chunk)
    return decode_json(b"".join(chunks), limits)


async def read_form(
    request: Request, limits: RouterLimits, model: type[BaseModel], files: FileParts | None = None
) -> ImageEditForm:
    """The request's multipart/form-data body as ``model`` with ``files`` (None: an edit's
    images), parsed as it streams in, each limit enforced on the way (``ImageEditForm``):
    nothing past a limit is read, let alone held."""
    form = ImageEditForm(request.headers.get("content-type", ""), limits, model, files)
    _check_declared_length(request, limits)
    async for chunk in request.stream():
        form.feed(chunk)
    return form


def _check_declared_length(request: Request, limits: RouterLimits) -> None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise body_too_large(limits)


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
