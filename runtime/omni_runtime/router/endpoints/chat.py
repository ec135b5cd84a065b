"""POST /v1/chat/completions: its body, its checks, its serving and its answers.

Text (``stream`` as SSE) from a pipeline that ends in an LLM; the image extensions of
vLLM-Omni's API from one that makes images: ``modalities: ["image"]`` with height, width,
num_inference_steps, guidance_scale, seed, negative_prompt and the family's own fields
(``router.request_fields``), input images as data URLs in the content. A pipeline of a
family that speaks (Qwen3-Omni) takes OpenAI's audio: ``input_audio`` content parts, and
``modalities: ["text", "audio"]`` with ``audio: {voice, format}`` for an answer spoken in one
of its voices, as OpenAI's ``message.audio`` (the text its transcript), or streamed as
``delta.audio`` chunks: the transcript as the thinker writes it, then the samples as pcm16.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, StrictBool

from omni_runtime import audio as audio_codec
from omni_runtime.families.base import SpeechRecipe
from omni_runtime.router.body import Body, NonNegativeFloat, Positive
from omni_runtime.router.errors import POST_ERRORS, RequestError, error_body, error_responses
from omni_runtime.router.json_body import parse_body, read_json
from omni_runtime.router.limits import RouterLimits, check_common, check_size
from omni_runtime.router.messages import (
    ChatMessage,
    ImagePart,
    InputAudioPart,
    flatten_messages,
    hear_messages,
)
from omni_runtime.router.orchestrator import PipelineError
from omni_runtime.router.request_fields import DIFFUSION_FIELDS, FamilyFields
from omni_runtime.router.responses import (
    ChunkWriter,
    JSONBody,
    StreamWithCleanup,
    Usage,
    png_base64,
    sse,
    usage,
)
from omni_runtime.router.route_docs import event_stream, json_request
from omni_runtime.router.sampling import Sampling, StreamOptions
from omni_runtime.router.served import CHAT, Served
from omni_runtime.router.serving import OpenAIServing
from omni_runtime.router.stage_requests import PipelineRequest

# How much audio one streamed chunk carries, in seconds: a client plays as it reads.
_AUDIO_CHUNK_S = 0.5
# A spoken answer's audio id is not kept for a later turn to refer to (the router keeps no
# state between requests): it expires as it is made.
_AUDIO_TTL_S = 0

# The common chat completion fields that only images use (seed seeds text sampling too).
IMAGE_ONLY_CHAT_FIELDS = (
    "height",
    "width",
    *(name for name in DIFFUSION_FIELDS if name != "seed"),
)


class AudioOutput(Body):
    """A chat completion's ``audio``: the voice to answer in and the format of its data."""

    voice: str
    format: str


class ChatCompletionRequest(FamilyFields, Sampling):
    """POST /v1/chat/completions."""

    # Optional as in vLLM's own server: a request without it is served by the one model
    # this router serves (the seed's curl sends none).
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Positive | None = None
    max_completion_tokens: Positive | None = None
    n: Positive = 1
    user: str | None = None
    # vLLM-Omni's image generation extensions.
    modalities: list[Literal["text", "image", "audio"]] | None = None
    audio: AudioOutput | None = None
    height: Positive | None = None
    width: Positive | None = None
    num_inference_steps: Positive | None = None
    guidance_scale: NonNegativeFloat | None = None
    negative_prompt: str | None = None

    @classmethod
    def image_only_fields(cls) -> tuple[str, ...]:
        """The fields only images use (the seed seeds text sampling too), which a text
        pipeline refuses by name."""
        return (*IMAGE_ONLY_CHAT_FIELDS, *cls.family_fields)

    def has_input_image(self) -> bool:
        """Whether converting this request decodes an image or audio (worth a thread of its
        own)."""
        return any(
            isinstance(part, ImagePart | InputAudioPart)
            for message in self.messages
            if not isinstance(message.content, str)
            for part in message.content
        )

    def to_pipeline_request(
        self, request_id: str, served: Served, limits: RouterLimits
    ) -> PipelineRequest:
        """The pipeline request this chat completion asks for; RequestError naming the
        field when the pipeline cannot answer it or it is over a limit."""
        if not served.serves(CHAT):
            raise served.elsewhere(CHAT)
        if served.output == "speech":
            return self._speech_request(request_id, limits)
        if self.audio is not None or "audio" in (self.modalities or []):
            raise RequestError(
                400,
                "modalities: this pipeline does not speak; leave out audio",
                "audio" if self.audio is not None else "modalities",
            )
        wants_image = "image" in (self.modalities or [])
        makes_images = served.output == "image"
        if wants_image and not makes_images:
            raise RequestError(
                400,
                "modalities: this pipeline ends in an LLM stage and answers with text; "
                'leave out "image"',
                param="modalities",
            )
        if not wants_image and makes_images:
            raise RequestError(
                400,
                'modalities: this pipeline makes images; ask for them with "modalities": ["image"]',
                param="modalities",
            )
        if wants_image and self.stream:
            # A chat chunk has no image part; an answer that ignored stream would break the
            # client that waits for events.
            raise RequestError(
                400,
                "stream: a chat completion's image comes whole; stream an image's partials "
                "with /v1/images/generations or /v1/images/edits (stream, partial_images)",
                param="stream",
            )
        most = self.max_input_images if wants_image else 0
        messages, images = flatten_messages(self.messages, limits, most)
        prompt_chars = sum(len(m["content"]) for m in messages)
        check_common(limits, prompt_chars, self.n, self.num_inference_steps)
        llm_params = self.llm_params(self.max_completion_tokens or self.max_tokens, limits)
        if wants_image:
            if self.requires_input_image and not images:
                raise RequestError(
                    400,
                    "messages: this pipeline edits an input image; send it as an image_url "
                    "part of a message",
                    "messages",
                )
            self.check_supported()
            check_size(limits, self.height, self.width)
            llm_params.pop("seed", None)  # the seed is the image's
            return PipelineRequest(
                request_id=request_id,
                messages=messages,
                llm_params=llm_params,
                diffusion_params=self.diffusion_params(height=self.height, width=self.width),
                images=images,
                sticky_key=self.user,
            )
        for name in self.image_only_fields():
            # Ignoring it would answer a question the caller did not ask.
            if getattr(self, name) is not None:
                raise RequestError(
                    400,
                    f"{name}: a parameter of image output; this pipeline answers with text",
                    name,
                )
        if self.n != 1:
            raise RequestError(400, f"n: only 1 completion per request (got {self.n})", "n")
        return PipelineRequest(
            request_id=request_id,
            messages=messages,
            llm_params=llm_params,
            sticky_key=self.user,
            stream=self.stream,
        )

    def _speech_request(self, request_id: str, limits: RouterLimits) -> PipelineRequest:
        """A chat completion of a pipeline that hears and speaks: text and input_audio
        parts in, text out, and audio too where ``modalities`` asks for it."""
        speech = self.speech
        assert speech is not None
        modalities = set(self.modalities or ["text"])
        if "image" in modalities:
            raise RequestError(
                400,
                'modalities: this pipeline answers in text and audio; leave out "image"',
                "modalities",
            )
        if modalities == {"audio"}:
            raise RequestError(
                400,
                'modalities: an answer in audio comes with its text: ["text", "audio"]',
                "modalities",
            )
        voice: str | None = None
        if "audio" in modalities:
            voice = self._voice(speech)
        elif self.audio is not None:
            raise RequestError(
                400,
                'audio: an answer in audio is asked for with modalities ["text", "audio"]',
                "audio",
            )
        for name in self.image_only_fields():
            if getattr(self, name) is not None:
                raise RequestError(400, f"{name}: a parameter of image output", name)
        if self.n != 1:
            raise RequestError(400, f"n: only 1 completion per request (got {self.n})", "n")
        messages, audios, images = hear_messages(
            self.messages, speech, limits, self.max_input_images
        )
        if images and voice is not None:
            raise RequestError(
                400,
                "messages: a spoken answer to an image is not supported yet (the stage that "
                "speaks reads text and audio); ask for text alone, or leave the image out",
                "messages",
            )
        prompt_chars = sum(
            len(m["content"])
            if isinstance(m["content"], str)
            else sum(len(p.get("text", "")) for p in m["content"])
            for m in messages
        )
        check_common(limits, prompt_chars, self.n, None)
        return PipelineRequest(
            request_id=request_id,
            messages=messages,
            llm_params=self.llm_params(self.max_completion_tokens or self.max_tokens, limits),
            sticky_key=self.user,
            stream=self.stream,
            audios=audios,
            answer="audio" if voice is not None else None,
            stage_params={"voice": voice} if voice is not None else {},
            images=images,
        )

    def _voice(self, speech: SpeechRecipe) -> str:
        if self.audio is None:
            raise RequestError(
                400,
                'audio: required with modalities ["text", "audio"]: {"voice": one of '
                f'{", ".join(speech.voices)}, "format": one of '
                f"{', '.join(audio_codec.AUDIO_FORMATS)}}}",
                "audio",
            )
        voice = self.audio.voice.lower()
        if voice not in speech.voices:
            raise RequestError(
                400,
                f"audio.voice: unknown voice {self.audio.voice!r} (voices: "
                f"{', '.join(speech.voices)})",
                "audio.voice",
            )
        formats = audio_codec.STREAM_FORMATS if self.stream else audio_codec.AUDIO_FORMATS
        if self.audio.format not in formats:
            why = "a streamed answer's audio comes as " if self.stream else "one of "
            raise RequestError(
                400,
                f"audio.format: {self.audio.format!r} is not supported ({why}{', '.join(formats)})",
                "audio.format",
            )
        return voice

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# -- answers (serve_chat builds them as plain dicts; these document them) --------------------


class OutputImageURL(BaseModel):
    url: str = Field(description="data:image/png;base64,...")


class OutputImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: OutputImageURL


class OutputTextPart(BaseModel):
    type: Literal["text"]
    text: str


class OutputAudio(BaseModel):
    id: str
    data: str = Field(description="The spoken answer, base64, in the format asked for.")
    expires_at: int = Field(
        description="When the id stops being usable (now: a later turn cannot refer to it)."
    )
    transcript: str = Field(description="The answer's text.")


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | list[OutputTextPart | OutputImagePart] | None = Field(
        description="Text, or (a pipeline that makes images) one image part per image, "
        "after the text the pipeline wrote first where it wrote one (a thinking encoder's "
        "plan); null for a spoken answer, whose text is its audio's transcript."
    )
    audio: OutputAudio | None = Field(
        default=None, description="A spoken answer (modalities text and audio)."
    )


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChunkAudio(BaseModel):
    id: str | None = None
    transcript: str | None = Field(default=None, description="The next piece of the text.")
    data: str | None = Field(default=None, description="The next piece of audio, base64 pcm16.")
    expires_at: int | None = None


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    audio: ChunkAudio | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed completion; the last, with stream_options.include_usage,
    has no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


# -- serving ---------------------------------------------------------------------------------


def routes(serving: OpenAIServing, body_model: type[ChatCompletionRequest]) -> APIRouter:
    """The chat room's route, taking ``body_model`` (the deployment's, with its family's
    fields)."""
    router = APIRouter()
    served = serving.served
    streams = served.output in ("text", "speech")
    stream = event_stream("ChatCompletionChunk", "one event per delta (a chat.completion.chunk)")

    @router.post(
        CHAT,
        summary="Create a chat completion",
        operation_id="createChatCompletion",
        response_model=ChatCompletion,
        response_description="The completion (or its stream).",
        responses={
            **({200: {"content": {"text/event-stream": stream}}} if streams else {}),
            **error_responses(*POST_ERRORS),
        },
        openapi_extra=json_request("ChatCompletionRequest"),
        include_in_schema=served.serves(CHAT),
    )
    async def chat_completions(request: Request) -> Response:
        body = parse_body(body_model, await read_json(request, serving.limits))
        return await serve_chat(serving, body, request)

    return router


async def serve_chat(
    serving: OpenAIServing, body: ChatCompletionRequest, http: Request
) -> Response:
    serving.pick_adapters(body.model, body)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    served = serving.served
    if body.has_input_image():
        # Decoding an image (PIL) takes milliseconds: not on the event loop.
        request = await asyncio.to_thread(
            body.to_pipeline_request, request_id, served, serving.limits
        )
    else:
        request = body.to_pipeline_request(request_id, served, serving.limits)
    request.adapters = serving.pick_adapters(body.model, body, request)
    speaks = request.answer == "audio"
    model = serving.served_model_name
    if served.output != "image" and body.stream:
        frames = ChunkWriter(request_id, model, "chat.completion.chunk")
        if speaks:
            return await _stream_speech(serving, request, body.include_usage, frames)
        return await serving.stream_text(request, http, body.include_usage, frames)
    outputs = await serving.run_to_end(request, http)
    final = outputs[-1]
    message: dict[str, Any]
    if speaks:
        assert body.audio is not None
        text = "".join(output.text for output in outputs)
        pieces = [output.audio for output in outputs if output.audio is not None]
        samples = np.concatenate(pieces) if pieces else None
        data = await asyncio.to_thread(
            _audio_base64, samples, _sample_rate(serving), body.audio.format
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
    elif served.output == "image":
        urls = await asyncio.to_thread(png_base64, final.images)
        # The text the pipeline wrote before its images (BAGEL's plan), then the images.
        content: str | list[dict[str, Any]] = [
            *([{"type": "text", "text": final.text}] if final.text else []),
            *(
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + url}}
                for url in urls
            ),
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
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": final.finish_reason}],
            "usage": usage(final),
        }
    )


def _sample_rate(serving: OpenAIServing) -> int:
    family = serving.pipeline.family_recipe
    assert family is not None
    assert family.speech is not None
    return family.speech.sample_rate


async def _stream_speech(
    serving: OpenAIServing, request: PipelineRequest, include_usage: bool, chunks: ChunkWriter
) -> Response:
    """A spoken answer, streamed as OpenAI streams one: ``delta.audio`` chunks, the
    transcript as the thinker writes it, then the audio as pcm16 (about half a second a
    chunk), the last with the finish reason and when the audio expires."""
    first, outputs, release = await serving.open_stream(request)
    audio_id = f"audio_{uuid.uuid4().hex}"
    rate = _sample_rate(serving)

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
                yield chunks.usage(usage(output))
        except PipelineError as e:
            yield sse(error_body(e.status, e.message, kind=e.kind, param=e.param))
        finally:
            await release()
        yield b"data: [DONE]\n\n"

    return StreamWithCleanup(events(), release)


def _audio_base64(samples: np.ndarray | None, sample_rate: int, audio_format: str) -> str:
    """A spoken answer's audio in ``audio_format``, base64 (none: an empty answer)."""
    if samples is None:
        samples = np.zeros(0, dtype=np.float32)
    return base64.b64encode(audio_codec.encode_audio(samples, sample_rate, audio_format)).decode(
        "ascii"
    )
