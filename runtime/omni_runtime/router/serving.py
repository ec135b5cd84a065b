"""OpenAIServing: the router's endpoints as plain methods, from a validated body to a response.

The HTTP app (``router.app``) binds paths to these methods and nothing more; the request
models (``router.protocol``) turn themselves into pipeline requests; this module admits a
request, runs it through the orchestrator, watches for the client leaving, and builds every
response body: chat completions, their SSE chunks, image results and OpenAI-shaped errors.

Responses are encoded with orjson (a chat completion's body and every streamed chunk), and
images are PNG- and base64-encoded in a worker thread: a 1024x1024 PNG takes tens of
milliseconds, which on the event loop would hold up every other request's tokens. So is
audio: an answer spoken (a pipeline that speaks, ``modalities: ["text", "audio"]``) comes as
OpenAI's ``message.audio`` (the text its transcript), or streamed as ``delta.audio`` chunks:
the transcript as the thinker writes it, then the samples as pcm16.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import numpy as np
import orjson
from fastapi import Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from omni_runtime import audio as audio_codec
from omni_runtime.config import PipelineConfig
from omni_runtime.engine.stage.stage_core_types import StageAdapter, StageServerOutput
from omni_runtime.engine.stage.stage_replica_pool import NoLiveReplicaError, StageReplicaPool
from omni_runtime.images import encode_png
from omni_runtime.router.adapters import AdapterCatalog
from omni_runtime.router.metrics import RouterMetrics
from omni_runtime.router.orchestrator import PipelineError, PipelineOrchestrator, PipelineRequest
from omni_runtime.router.protocol import (
    LORA_SCALE_FIELD,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ImageEditRequest,
    ImageGenerationRequest,
    LoadLoraAdapterRequest,
    RequestError,
    RouterLimits,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)

# How much audio one streamed chunk carries, in seconds: a client plays as it reads.
_AUDIO_CHUNK_S = 0.5
# A spoken answer's audio id is not kept for a later turn to refer to (the router keeps no
# state between requests): it expires as it is made.
_AUDIO_TTL_S = 0

# A tokenize call is milliseconds of a stage server's time; one far past that has lost its
# replica (which the pool notices on its own).
_TOKENIZER_TIMEOUT_S = 30.0
# A load at run time reads the adapter's files, and may fetch them from the hub first.
_ADAPTER_LOAD_TIMEOUT_S = 300.0

logger = logging.getLogger(__name__)


class JSONBody(Response):
    """A JSON response encoded with orjson (numpy-free bodies only)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def served_model_name(pipeline: PipelineConfig) -> str:
    """The model name clients send: the router's setting, else the model's last path part."""
    return pipeline.served_model_name


def error_body(
    status: int, message: str, *, kind: str | None = None, param: str | None = None
) -> dict[str, Any]:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(error: RequestError | PipelineError) -> JSONBody:
    """The OpenAI-shaped answer to a refused or failed request."""
    headers = None
    kind = None
    if isinstance(error, PipelineError):
        kind = error.kind
        if error.retry_after is not None:
            headers = {"Retry-After": str(max(1, round(error.retry_after)))}
    return JSONBody(
        error_body(error.status, error.message, kind=kind, param=error.param),
        status_code=error.status,
        headers=headers,
    )


class OpenAIServing:
    """What the router's endpoints do, over one pipeline's stage pools."""

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
        self.in_flight = 0

    # -- endpoints ---------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, http: Request) -> Response:
        self._pick_adapters(body.model, body)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        kind = self.orchestrator.output_kind
        if body.has_input_image():
            # Decoding an image (PIL) takes milliseconds: not on the event loop.
            request = await asyncio.to_thread(
                body.to_pipeline_request, request_id, kind, self.limits
            )
        else:
            request = body.to_pipeline_request(request_id, kind, self.limits)
        request.adapters = self._pick_adapters(body.model, body, request)
        speaks = kind == "speech" and request.voice is not None
        if kind in ("text", "speech") and body.stream:
            frames = _ChunkWriter(request_id, self.served_model_name, "chat.completion.chunk")
            if speaks:
                return await self._stream_speech(request, body.include_usage, frames)
            return await self._stream_text(request, http, body.include_usage, frames)
        outputs = await self._run_to_end(request, http)
        final = outputs[-1]
        message: dict[str, Any]
        if speaks:
            assert body.audio is not None
            text = "".join(output.text for output in outputs)
            pieces = [output.audio for output in outputs if output.audio is not None]
            samples = np.concatenate(pieces) if pieces else None
            data = await asyncio.to_thread(
                _audio_base64, samples, self._sample_rate, body.audio.format
            )
            message = {
                "role": "assistant",
                "content": None,
                "audio": {
                    "id": f"audio_{uuid.uuid4().hex}",
                    "data": data,
                    "expires_at": int(time.time()) + _AUDIO_TTL_S,
                    "transcript": text,
                },
            }
        elif kind == "image":
            urls = await asyncio.to_thread(_png_data_urls, final.images)
            # The text the pipeline wrote before its images (BAGEL's plan), then the images.
            content: str | list[dict[str, Any]] = [
                *([{"type": "text", "text": final.text}] if final.text else []),
                *({"type": "image_url", "image_url": {"url": url}} for url in urls),
            ]
        else:
            content = "".join(output.text for output in outputs)
        if not speaks:
            message = {"role": "assistant", "content": content}
        return JSONBody(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.served_model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": final.finish_reason,
                    }
                ],
                "usage": _usage(final),
            }
        )

    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        adapters = self._pick_adapters(body.model, body)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        request = body.to_pipeline_request(request_id, self.orchestrator.output_kind, self.limits)
        request.adapters = adapters
        if body.stream:
            frames = _ChunkWriter(request_id, self.served_model_name, "text_completion")
            return await self._stream_text(request, http, body.include_usage, frames)
        outputs = await self._run_to_end(request, http)
        final = outputs[-1]
        return JSONBody(
            {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.served_model_name,
                "choices": [
                    {
                        "index": 0,
                        "text": "".join(output.text for output in outputs),
                        "logprobs": None,
                        "finish_reason": final.finish_reason,
                    }
                ],
                "usage": _usage(final),
            }
        )

    async def tokenize(self, body: TokenizeRequest) -> Response:
        self._pick_adapters(body.model, body)
        answer = await self._tokenizer_call("tokenize", body.stage_kwargs(self.limits))
        tokens = answer["tokens"]
        return JSONBody(
            {
                "count": len(tokens),
                "max_model_len": answer["max_model_len"],
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def detokenize(self, body: DetokenizeRequest) -> Response:
        self._pick_adapters(body.model, body)
        answer = await self._tokenizer_call("detokenize", body.stage_kwargs(self.limits))
        return JSONBody({"prompt": answer["prompt"]})

    async def _tokenizer_call(self, method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``method`` on a replica of the first stage, which tokenizes the caller's text;
        its refusal as a 400 naming the field."""
        if self.orchestrator.output_kind != "text":
            raise RequestError(
                400,
                f"this pipeline makes images; /{method} is for pipelines that answer with text",
            )
        pool = self.pools[self.orchestrator.stages[0].stage_id]
        try:
            answer: dict[str, Any] = await pool.call_utility(
                method, kwargs, timeout=_TOKENIZER_TIMEOUT_S
            )
        except NoLiveReplicaError as e:
            raise PipelineError(503, str(e), kind="service_unavailable") from None
        except TimeoutError:
            raise PipelineError(
                504, f"{method} did not answer within {_TOKENIZER_TIMEOUT_S:g} s", kind="timeout"
            ) from None
        if "error" in answer:
            raise RequestError(400, answer["error"], answer.get("param"))
        return answer

    async def images(self, body: ImageGenerationRequest, http: Request) -> Response:
        self._pick_adapters(body.model, body)
        request = body.to_pipeline_request(
            f"img-{uuid.uuid4().hex}", self.orchestrator.output_kind, self.limits
        )
        request.adapters = self._pick_adapters(body.model, body, request)
        if body.stream:
            return await self._stream_images(request, "image_generation")
        return await self._images_response(request, http)

    async def image_edits(
        self, body: ImageEditRequest, images: list[bytes], http: Request
    ) -> Response:
        self._pick_adapters(body.model, body)
        # Decoding the image (PIL) takes milliseconds: not on the event loop.
        request = await asyncio.to_thread(
            body.to_pipeline_request,
            f"img-{uuid.uuid4().hex}",
            self.orchestrator.output_kind,
            self.limits,
            images,
        )
        request.adapters = self._pick_adapters(body.model, body, request)
        if body.stream:
            return await self._stream_images(request, "image_edit")
        return await self._images_response(request, http)

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "omni-operator",
                    "root": self.pipeline.model,
                },
                *self.adapters.models(created=0),
            ],
        }

    async def load_adapter(self, body: LoadLoraAdapterRequest) -> Response:
        """vLLM's /v1/load_lora_adapter: a replica of its stage loads the adapter now, and
        one it cannot load is refused (a 400 naming the file, as vLLM's); it is served from
        then on, and each other replica loads it on its first request."""
        scale = 1.0 if body.scale is None else float(body.scale)
        entry = self.adapters.entry(body.lora_name, body.lora_path, body.stage, scale)
        pool = self.pools[entry.stage.stage_id]
        adapter = entry.adapter
        try:
            answer: dict[str, Any] = await pool.call_utility(
                "load_adapter",
                {"name": adapter.name, "source": adapter.source, "scale": adapter.scale},
                timeout=_ADAPTER_LOAD_TIMEOUT_S,
            )
        except NoLiveReplicaError as e:
            raise PipelineError(
                503,
                f"no replica of stage {entry.stage.name!r} is up to load the adapter on: {e}",
                kind="service_unavailable",
                retry_after=5.0,
            ) from None
        except TimeoutError:
            raise PipelineError(
                504,
                f"lora_path: the adapter did not load within {_ADAPTER_LOAD_TIMEOUT_S:g} s",
                kind="timeout",
            ) from None
        if "error" in answer:
            raise RequestError(400, f"lora_path: {answer['error']}", "lora_path")
        self.adapters.insert(entry)
        logger.info(
            "adapter %r of stage %r added from %s", body.lora_name, entry.stage.name, body.lora_path
        )
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    def unload_adapter(self, body: UnloadLoraAdapterRequest) -> Response:
        """vLLM's /v1/unload_lora_adapter, for an adapter added at run time: requests naming
        it are refused from now on; replicas drop it as their caches need the room."""
        self.adapters.remove(body.lora_name)
        logger.info("adapter %r removed", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

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

    async def _images_response(self, request: PipelineRequest, http: Request) -> Response:
        outputs = await self._run_to_end(request, http)
        final = outputs[-1]
        encoded = await asyncio.to_thread(_png_base64, final.images)
        # OpenAI's field for the prompt the model actually drew from: BAGEL's plan.
        revised = {"revised_prompt": final.text} if final.text else {}
        data = [{"b64_json": b64, **revised} for b64 in encoded]
        return JSONBody({"created": int(time.time()), "data": data})

    def _pick_adapters(
        self, model: str | None, body: object, request: PipelineRequest | None = None
    ) -> dict[int, StageAdapter]:
        """The adapter of each stage that ``model`` picks, scaled by the body's lora_scale
        (which ``request``'s DiT params carry and lose here: it is the adapter's, not the
        pipeline's); RequestError (404 for a name not served) names the field."""
        scale = getattr(body, LORA_SCALE_FIELD, None)
        if request is not None:
            request.diffusion_params.pop(LORA_SCALE_FIELD, None)
        return self.adapters.pick(model, None if scale is None else float(scale))

    def _admit(self) -> None:
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

    async def _run_to_end(self, request: PipelineRequest, http: Request) -> list[StageServerOutput]:
        """Every output of ``request``, aborting it if the client goes away first."""
        self._admit()
        try:
            return await _until_disconnected(http, self.orchestrator.complete(request))
        finally:
            self.in_flight -= 1

    async def _open_stream(
        self, request: PipelineRequest
    ) -> tuple[
        StageServerOutput,
        AsyncGenerator[StageServerOutput, None],
        Callable[[], Awaitable[None]],
    ]:
        """The first output of a streamed request, the rest of them, and what releases the
        request (idempotent: it runs when the stream ends, and again when the response does,
        as a client gone before the first event never starts the stream)."""
        self._admit()
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

    async def _stream_images(self, request: PipelineRequest, kind: str) -> Response:
        """OpenAI's image stream: a ``<kind>.partial_image`` event per partial image, then
        ``<kind>.completed`` with the image (the same bytes as without streaming). A client
        that goes away ends the response, which aborts the request in every stage."""
        first, outputs, release = await self._open_stream(request)

        async def events() -> AsyncIterator[bytes]:
            try:
                output: StageServerOutput | None = first
                while output is not None:
                    if output.images is not None:  # a partial image, or the images
                        yield await asyncio.to_thread(_image_events, kind, output)
                    if output.finished:
                        break
                    output = await anext(outputs, None)
            except PipelineError as e:
                yield _sse(error_body(e.status, e.message, kind=e.kind, param=e.param))
            finally:
                await release()

        return _StreamWithCleanup(events(), release)

    @property
    def _sample_rate(self) -> int:
        family = self.pipeline.family_recipe
        assert family is not None
        assert family.speech is not None
        return family.speech.sample_rate

    async def _stream_speech(
        self, request: PipelineRequest, include_usage: bool, chunks: _ChunkWriter
    ) -> Response:
        """A spoken answer, streamed as OpenAI streams one: ``delta.audio`` chunks, the
        transcript as the thinker writes it, then the audio as pcm16 (about half a second a
        chunk), the last with the finish reason and when the audio expires."""
        first, outputs, release = await self._open_stream(request)
        audio_id = f"audio_{uuid.uuid4().hex}"
        rate = self._sample_rate

        async def events() -> AsyncIterator[bytes]:
            try:
                opening = chunks.opening()
                if opening:
                    yield opening
                output, sent_id = first, False
                step = 2 * max(1, int(rate * _AUDIO_CHUNK_S))
                while True:
                    if output.text:
                        delta: dict[str, Any] = {"transcript": output.text}
                        if not sent_id:
                            delta["id"], sent_id = audio_id, True
                        yield chunks.delta({"audio": delta}, None)
                    if output.audio is not None:
                        # Each piece of the answer's audio as code2wav makes it.
                        pcm = await asyncio.to_thread(audio_codec.pcm16_bytes, output.audio)
                        for start in range(0, len(pcm), step):
                            data = base64.b64encode(pcm[start : start + step]).decode("ascii")
                            yield chunks.delta({"audio": {"id": audio_id, "data": data}}, None)
                    if output.finished:
                        break
                    following = await anext(outputs, None)
                    if following is None:
                        break
                    output = following
                yield chunks.delta(
                    {"audio": {"id": audio_id, "expires_at": int(time.time()) + _AUDIO_TTL_S}},
                    output.finish_reason if output.finished else None,
                )
                if include_usage:
                    yield chunks.usage(_usage(output))
            except PipelineError as e:
                yield _sse(error_body(e.status, e.message, kind=e.kind, param=e.param))
            finally:
                await release()
            yield b"data: [DONE]\n\n"

        return _StreamWithCleanup(events(), release)

    async def _stream_text(
        self, request: PipelineRequest, http: Request, include_usage: bool, chunks: _ChunkWriter
    ) -> Response:
        first, outputs, release = await self._open_stream(request)

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
                    yield chunks.usage(_usage(last))
            except PipelineError as e:
                yield _sse(error_body(e.status, e.message, kind=e.kind, param=e.param))
            finally:
                await release()
            yield b"data: [DONE]\n\n"

        return _StreamWithCleanup(events(), release)


class _ChunkWriter:
    """The SSE frames of one streamed completion: chat (``chat.completion.chunk``: an
    opening frame with the role, then ``delta``s) or text (``text_completion``: ``text``).

    Only the text and finish reason change from chunk to chunk, so the rest of the frame
    is encoded once; per token the router encodes a few dozen bytes.
    """

    def __init__(self, request_id: str, model: str, kind: str) -> None:
        self.head = {"id": request_id, "object": kind, "created": int(time.time()), "model": model}
        self._chat = kind == "chat.completion.chunk"
        self._prefix = b"data: " + orjson.dumps(self.head)[:-1] + b',"choices":[{"index":0,'
        self._suffix = b"}]}\n\n"

    def opening(self) -> bytes | None:
        if not self._chat:
            return None
        return self._frame(b'"delta":{"role":"assistant","content":""}', None)

    def text(self, text: str, finish_reason: str | None) -> bytes:
        if self._chat:
            delta = orjson.dumps({"content": text} if text else {})
            return self._frame(b'"delta":' + delta, finish_reason)
        return self._frame(b'"text":' + orjson.dumps(text) + b',"logprobs":null', finish_reason)

    def delta(self, delta: dict[str, Any], finish_reason: str | None) -> bytes:
        """A chat chunk whose delta is ``delta`` (a spoken answer's audio)."""
        return self._frame(b'"delta":' + orjson.dumps(delta), finish_reason)

    def usage(self, usage: dict[str, int]) -> bytes:
        return _sse({**self.head, "choices": [], "usage": usage})

    def _frame(self, body: bytes, finish_reason: str | None) -> bytes:
        return (
            self._prefix + body + b',"finish_reason":' + orjson.dumps(finish_reason) + self._suffix
        )


def _sse(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _usage(final: StageServerOutput) -> dict[str, int]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }


def _audio_base64(samples: np.ndarray | None, sample_rate: int, audio_format: str) -> str:
    """A spoken answer's audio in ``audio_format``, base64 (none: an empty answer)."""
    if samples is None:
        samples = np.zeros(0, dtype=np.float32)
    return base64.b64encode(audio_codec.encode_audio(samples, sample_rate, audio_format)).decode(
        "ascii"
    )


def _png_base64(images: np.ndarray | None) -> list[str]:
    if images is None:
        return []
    return [base64.b64encode(encode_png(image)).decode("ascii") for image in images]


def _image_events(kind: str, output: StageServerOutput) -> bytes:
    """The SSE events of an output of an image stream (OpenAI's
    ``image_generation.partial_image`` / ``.completed`` and their ``image_edit`` twins): a
    partial image's (of the first image, where a request makes several), or one completed
    event per image, each a PNG."""
    assert output.images is not None
    partial = output.partial_index is not None
    event = f"{kind}.partial_image" if partial else f"{kind}.completed"
    images = output.images[:1] if partial else output.images
    frames = []
    for image in images:
        payload: dict[str, Any] = {
            "type": event,
            "b64_json": base64.b64encode(encode_png(image)).decode("ascii"),
            "created_at": int(time.time()),
            "size": f"{image.shape[1]}x{image.shape[0]}",
            "quality": "auto",
            "background": "opaque",
            "output_format": "png",
        }
        if partial:
            payload["partial_image_index"] = output.partial_index
        else:
            tokens = output.prompt_tokens
            payload["usage"] = {
                "input_tokens": tokens,
                "input_tokens_details": {"image_tokens": 0, "text_tokens": tokens},
                "output_tokens": 0,
                "total_tokens": tokens,
            }
        frames.append(b"event: " + event.encode() + b"\n" + _sse(payload))
    return b"".join(frames)


def _png_data_urls(images: np.ndarray | None) -> list[str]:
    return ["data:image/png;base64," + b64 for b64 in _png_base64(images)]


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


class _StreamWithCleanup(StreamingResponse):
    """An SSE response that releases its request however the response ends."""

    def __init__(
        self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()
