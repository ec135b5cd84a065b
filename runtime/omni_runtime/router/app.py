"""The router's HTTP API: OpenAI-compatible endpoints over a pipeline's stage pools.

    POST /v1/chat/completions    text (``stream`` as SSE) for pipelines ending in an LLM;
                                 ``modalities: ["image"]`` for pipelines ending in diffusion
    POST /v1/images/generations  b64_json images
    GET  /v1/models              the one served model
    GET  /health                 200 when every stage has a live replica, else 503 naming them
    GET  /livez                  200 while the process serves (liveness: not about replicas)
    GET  /metrics                Prometheus

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx
status. Bodies are read with a size limit and validated before any stage sees them; when
the router holds ``max_concurrent_requests`` requests, or a stage's replicas are all full,
the answer is 429 with Retry-After, never an unbounded queue.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_runtime.config import PipelineConfig
from omni_runtime.engine.stage.stage_core_types import StageServerOutput
from omni_runtime.engine.stage.stage_replica_pool import StageReplicaPool
from omni_runtime.images import encode_png
from omni_runtime.router.metrics import RouterMetrics
from omni_runtime.router.orchestrator import PipelineError, PipelineOrchestrator, PipelineRequest
from omni_runtime.router.protocol import (
    ChatCompletionRequest,
    ImageGenerationRequest,
    RequestError,
    RouterLimits,
    check_common,
    check_size,
    flatten_messages,
    parse_body,
    parse_size,
)

logger = logging.getLogger(__name__)

_LLM_PARAMS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
)


@dataclass
class RouterState:
    """What the endpoints work with."""

    pipeline: PipelineConfig
    orchestrator: PipelineOrchestrator
    pools: dict[int, StageReplicaPool]
    metrics: RouterMetrics
    limits: RouterLimits
    served_model_name: str
    in_flight: int = 0


def served_model_name(pipeline: PipelineConfig) -> str:
    """The model name clients send: the router's setting, else the model's last path part."""
    if pipeline.router.served_model_name:
        return pipeline.router.served_model_name
    return pipeline.model.rstrip("/").rsplit("/", 1)[-1] or pipeline.model


def create_app(
    pipeline: PipelineConfig,
    pools: Mapping[int, StageReplicaPool],
    *,
    limits: RouterLimits | None = None,
    model_name: str | None = None,
    lifespan: Callable[[FastAPI], Any] | None = None,
) -> FastAPI:
    """The router app over ``pools`` (one per stage id; the caller fills them)."""
    names = {stage.stage_id: stage.name for stage in pipeline.stages}
    metrics = RouterMetrics(lambda: {names[i]: pool for i, pool in pools.items()})
    for pool in pools.values():
        pool.on_request_done = metrics.stage_request_done
    state = RouterState(
        pipeline=pipeline,
        orchestrator=PipelineOrchestrator(pipeline, pools),
        pools=dict(pools),
        metrics=metrics,
        limits=limits or RouterLimits(),
        served_model_name=model_name or served_model_name(pipeline),
    )

    @asynccontextmanager
    async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
        if lifespan is None:
            yield
        else:
            async with lifespan(app):
                yield
        for pool in state.pools.values():
            await pool.close()

    app = FastAPI(title="omni-runtime router", lifespan=_lifespan, docs_url=None, redoc_url=None)
    app.state.router = state
    app.add_middleware(_CountRequests, metrics=metrics)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, error: RequestError) -> JSONResponse:
        return error_response(error.status, error.message, param=error.param)

    @app.exception_handler(PipelineError)
    async def _pipeline_error(request: Request, error: PipelineError) -> JSONResponse:
        return pipeline_error_response(error)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await read_json(request, state.limits))
        return await _chat(state, request, body)

    @app.post("/v1/images/generations")
    async def images_generations(request: Request) -> Response:
        body = parse_body(ImageGenerationRequest, await read_json(request, state.limits))
        return await _images(state, request, body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "omni-operator",
                    "root": state.pipeline.model,
                }
            ],
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        live = {
            stage.name: state.pools[stage.stage_id].live_replica_count
            for stage in state.orchestrator.stages
        }
        missing = [name for name, count in live.items() if count == 0]
        if missing:
            return JSONResponse(
                {
                    "status": "unavailable",
                    "error": "no live replica for stage(s): " + ", ".join(missing),
                    "live_replicas": live,
                },
                status_code=503,
            )
        return JSONResponse({"status": "ok", "live_replicas": live})

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


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
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.request_latency.labels(path).observe(time.perf_counter() - start)


def error_response(
    status: int,
    message: str,
    *,
    kind: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}},
        status_code=status,
        headers=headers,
    )


def pipeline_error_response(error: PipelineError) -> JSONResponse:
    headers = None
    if error.retry_after is not None:
        headers = {"Retry-After": str(max(1, round(error.retry_after)))}
    return error_response(
        error.status, error.message, kind=error.kind, param=error.param, headers=headers
    )


async def read_json(request: Request, limits: RouterLimits) -> Any:
    """The request's JSON body, read with the size limit; RequestError if it is not."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise RequestError(
            415, f"Content-Type must be application/json (got {content_type or 'none'!r})"
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise RequestError(413, _too_large(limits))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise RequestError(413, _too_large(limits))
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, f"the body is not valid JSON: {e}") from None


def _too_large(limits: RouterLimits) -> str:
    return f"the body is over the limit of {limits.max_body_bytes // (1024 * 1024)} MiB"


class _Admission:
    """Counts a request in the router while it runs; refuses it when the router is full."""

    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.entered = False

    def enter(self) -> None:
        if self.state.in_flight >= self.state.limits.max_concurrent_requests:
            raise PipelineError(
                429,
                f"the router is at its limit of {self.state.limits.max_concurrent_requests} "
                "concurrent requests; retry shortly",
                kind="rate_limit_exceeded",
                retry_after=1.0,
            )
        self.state.in_flight += 1
        self.entered = True

    def exit(self) -> None:
        if self.entered:
            self.state.in_flight -= 1
            self.entered = False


def _check_model(state: RouterState, model: str | None) -> None:
    if model is not None and model != state.served_model_name:
        raise RequestError(
            404,
            f"model: {model!r} is not served here; this router serves "
            f"{state.served_model_name!r} (GET /v1/models)",
            param="model",
        )


async def _chat(state: RouterState, http: Request, body: ChatCompletionRequest) -> Response:
    _check_model(state, body.model)
    limits = state.limits
    wants_image = bool(body.modalities) and "image" in (body.modalities or [])
    kind = state.orchestrator.output_kind
    if wants_image and kind != "image":
        raise RequestError(
            400,
            "modalities: this pipeline ends in an LLM stage and answers with text; "
            'leave out "image"',
            param="modalities",
        )
    if not wants_image and kind == "image":
        raise RequestError(
            400,
            'modalities: this pipeline makes images; ask for them with "modalities": ["image"]',
            param="modalities",
        )
    messages, images = flatten_messages(body.messages, limits)
    prompt_chars = sum(len(m["content"]) for m in messages)
    check_common(limits, prompt_chars, body.n, body.num_inference_steps)
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise RequestError(
            400, f"max_tokens: at most {limits.max_tokens} (got {max_tokens})", "max_tokens"
        )
    if len(images) > 1:
        raise RequestError(400, "messages: at most one input image per request", "messages")
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    llm_params = {
        name: getattr(body, name) for name in _LLM_PARAMS if getattr(body, name) is not None
    }
    if max_tokens is not None:
        llm_params["max_tokens"] = max_tokens
    if wants_image:
        check_size(limits, body.height, body.width)
        diffusion_params = _diffusion_params(
            height=body.height,
            width=body.width,
            num_inference_steps=body.num_inference_steps,
            guidance_scale=body.guidance_scale,
            seed=body.seed,
            negative_prompt=body.negative_prompt,
            num_images=body.n,
            strength=body.strength,
        )
        llm_params.pop("seed", None)  # the seed is the image's
        pipeline_request = PipelineRequest(
            request_id=request_id,
            messages=messages,
            llm_params=llm_params,
            diffusion_params=diffusion_params,
            image=images[0] if images else None,
            sticky_key=body.user,
        )
        outputs = await _run_to_end(state, http, pipeline_request)
        final = outputs[-1]
        content = [
            {"type": "image_url", "image_url": {"url": _png_data_url(image)}}
            for image in (final.images if final.images is not None else [])
        ]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        return JSONResponse(_chat_response(state, request_id, message, final, outputs))
    if images:
        raise RequestError(400, "messages: this pipeline takes no input image", "messages")
    if body.n != 1:
        raise RequestError(400, f"n: only 1 completion per request (got {body.n})", "n")
    pipeline_request = PipelineRequest(
        request_id=request_id, messages=messages, llm_params=llm_params, sticky_key=body.user
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _stream_chat(state, http, pipeline_request, include_usage)
    outputs = await _run_to_end(state, http, pipeline_request)
    final = outputs[-1]
    text = "".join(output.text for output in outputs)
    return JSONResponse(
        _chat_response(state, request_id, {"role": "assistant", "content": text}, final, outputs)
    )


def _chat_response(
    state: RouterState,
    request_id: str,
    message: dict[str, Any],
    final: StageServerOutput,
    outputs: list[StageServerOutput],
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.served_model_name,
        "choices": [{"index": 0, "message": message, "finish_reason": final.finish_reason}],
        "usage": _usage(final),
    }


def _usage(final: StageServerOutput) -> dict[str, int]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }


async def _images(state: RouterState, http: Request, body: ImageGenerationRequest) -> Response:
    _check_model(state, body.model)
    if state.orchestrator.output_kind != "image":
        raise RequestError(
            400, "this pipeline ends in an LLM stage and makes no images; use /v1/chat/completions"
        )
    limits = state.limits
    check_common(limits, len(body.prompt), body.n, body.num_inference_steps)
    height, width = parse_size(body.size, limits)
    request_id = f"img-{uuid.uuid4().hex}"
    pipeline_request = PipelineRequest(
        request_id=request_id,
        # As a chat message: an LLM first stage reads it through its chat template, like
        # the same prompt sent to /v1/chat/completions.
        messages=[{"role": "user", "content": body.prompt}],
        diffusion_params=_diffusion_params(
            height=height,
            width=width,
            num_inference_steps=body.num_inference_steps,
            guidance_scale=body.guidance_scale,
            seed=body.seed,
            negative_prompt=body.negative_prompt,
            num_images=body.n,
        ),
        sticky_key=body.user,
    )
    outputs = await _run_to_end(state, http, pipeline_request)
    images = outputs[-1].images
    data = [
        {"b64_json": base64.b64encode(encode_png(image)).decode("ascii")}
        for image in (images if images is not None else [])
    ]
    return JSONResponse({"created": int(time.time()), "data": data})


def _diffusion_params(**params: Any) -> dict[str, Any]:
    return {name: value for name, value in params.items() if value is not None}


def _png_data_url(image: Any) -> str:
    return "data:image/png;base64," + base64.b64encode(encode_png(image)).decode("ascii")


async def _run_to_end(
    state: RouterState, http: Request, request: PipelineRequest
) -> list[StageServerOutput]:
    """Run ``request`` to its last output, aborting it if the client goes away."""
    admission = _Admission(state)
    admission.enter()
    try:
        return await _until_disconnected(http, state.orchestrator.complete(request))
    finally:
        admission.exit()


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


async def _stream_chat(
    state: RouterState, http: Request, request: PipelineRequest, include_usage: bool
) -> Response:
    admission = _Admission(state)
    admission.enter()
    created = int(time.time())
    outputs = state.orchestrator.run(request)
    # The first output is awaited before the response starts, so that a request the
    # stage refuses still gets its 4xx status rather than an error inside a 200 stream.
    try:
        first = await anext(outputs)
    except BaseException:
        admission.exit()
        await outputs.aclose()
        raise

    def chunk(delta: dict[str, Any], finish_reason: str | None) -> str:
        payload = {
            "id": request.request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.served_model_name,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }
        return f"data: {json.dumps(payload)}\n\n"

    async def events() -> AsyncIterator[str]:
        try:
            output: StageServerOutput | None = first
            yield chunk({"role": "assistant", "content": ""}, None)
            last = first
            while output is not None:
                last = output
                if output.text or output.finished:
                    yield chunk(
                        {"content": output.text} if output.text else {},
                        output.finish_reason if output.finished else None,
                    )
                output = None if last.finished else await anext(outputs, None)
            if include_usage:
                usage = {
                    "id": request.request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": state.served_model_name,
                    "choices": [],
                    "usage": _usage(last),
                }
                yield f"data: {json.dumps(usage)}\n\n"
        except PipelineError as e:
            error = {
                "error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}
            }
            yield f"data: {json.dumps(error)}\n\n"
        finally:
            await release()
        yield "data: [DONE]\n\n"

    async def release() -> None:
        # Idempotent: runs when the stream ends, and again when the response does (a
        # client gone before the first chunk never starts ``events``).
        await outputs.aclose()
        admission.exit()

    return _StreamWithCleanup(events(), release)


class _StreamWithCleanup(StreamingResponse):
    """An SSE response that releases its request however the response ends."""

    def __init__(self, content: AsyncIterator[str], cleanup: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()
