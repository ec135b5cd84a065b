"""The OpenAI-compatible request bodies the router takes, their limits, and their checks.

Bodies are validated here, before any stage sees them, so that a bad request is a 400 (or
413) whose message names the field and what is allowed. Unknown fields are refused, as
OpenAI refuses them. The image extensions of vLLM-Omni's API are accepted on chat
completions: ``modalities: ["image"]`` with height, width, num_inference_steps,
guidance_scale, seed and negative_prompt; input images come as data URLs in the content.
/v1/images/edits takes OpenAI's multipart form (``ImageEditForm`` parses it as it arrives,
within the limits) with the same extensions as form fields.

Beyond those, a pipeline's model family declares its DiT's own fields (``Family.
request_fields``: Qwen-Image's true_cfg_scale, BAGEL's guidance, ...), and a pipeline of no
family takes the generic diffusers ones (``familyless_fields``, and an edit's strength).
The models here hold the common fields only; ``request_models`` builds, once per set of
fields, the bodies a deployment parses (and documents), so that a pipeline takes its own
family's fields and refuses another's as unknown, naming the families that take it.

A pipeline of a family that speaks (Qwen3-Omni) takes OpenAI's audio: ``input_audio``
content parts (base64 WAV or MP3, decoded here to the samples its thinker's processor
takes), and ``modalities: ["text", "audio"]`` with ``audio: {voice, format}`` for an answer
spoken in one of its voices.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeVar

import numpy as np
import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    ValidationError,
    create_model,
)
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from omni_runtime import audio as audio_codec
from omni_runtime.config.loader import nesting_depth
from omni_runtime.engine.stage.stage_core_types import MAX_PARTIAL_IMAGES
from omni_runtime.families import FAMILIES, Family
from omni_runtime.families.base import RequestField, SpeechRecipe, VideoRecipe
from omni_runtime.images import decode_image
from omni_runtime.router.orchestrator import OutputKind, PipelineRequest
from omni_runtime.videos import frames_for

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks


@dataclass(frozen=True)
class RouterLimits:
    """What one request may ask for; each excess is a 4xx naming the limit."""

    max_body_bytes: int = 32 * 1024 * 1024
    max_prompt_chars: int = 32_000
    max_image_side: int = 2048
    max_steps: int = 200
    max_n: int = 4
    max_tokens: int = 8192
    max_input_image_bytes: int = 16 * 1024 * 1024
    max_input_image_pixels: int = 4096 * 4096
    # Far deeper than any body of this API (about 6 levels), far shallower than what
    # would exhaust a recursive validator or repr.
    max_json_nesting: int = 64
    # Requests in the router at once, and on one stage replica (a stage queues what it
    # cannot batch); beyond either, 429 with Retry-After.
    max_concurrent_requests: int = 256
    max_in_flight_per_replica: int = 64
    # How long a client may take to send its request, and leave the answer unread
    # (router.http_limits; past each, 408 or a close). A client sends its head in one write
    # as it connects: 10 s is a congested link's few retransmits, and a connection that
    # never sends one costs its descriptor for no longer. A body that moves no byte for
    # 30 s, or a response left unread as long, has lost ~5 TCP retransmits in a row (1+2+4+
    # 8+16 s). 64 KiB/s is 512 kbit/s, a slow uplink's rate: to hold every connection the
    # router allows, bodies at that rate take 256 Mbit/s, no slow client's bandwidth; a
    # body at the floor is done within 30 s + max_body_bytes / rate (9 min for 32 MiB).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    min_body_bytes_per_s: float = 64 * 1024
    send_timeout_s: float = 30.0
    # HTTP connections one router process holds; past it a 503 (the probes still
    # answered). Twice max_concurrent_requests leaves room for clients' idle kept-alive
    # connections, and with the rest of the router it stays below the 1024 descriptors
    # that a container's soft limit often is (containerd 2 leaves it at systemd's
    # 1024:524288; 1.x set 1048576).
    max_connections: int = 512
    # A video's frames: 10 s at 24 fps and a latent frame's worth more.
    max_video_frames: int = 245


class RequestError(Exception):
    """A request refused before it reached a stage: status, message, offending field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class ImageURL(_Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(_Body):
    data: str
    format: str


class InputAudioPart(_Body):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioOutput(_Body):
    """A chat completion's ``audio``: the voice to answer in and the format of its data."""

    voice: str
    format: str


ContentPart = Annotated[TextPart | ImagePart | InputAudioPart, Field(discriminator="type")]


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class StreamOptions(_Body):
    include_usage: StrictBool = False


# Numbers as JSON has them: true, false and "1.5" are not numbers, though pydantic's lax
# mode would take them (form fields, text by nature, are parsed from their strings all the
# same: model_validate_strings). JSON has no inf or nan, but an overflowing 1e999 parses
# as inf and form fields spell both: refused everywhere.
Integer = Annotated[int, Strict()]
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]
NonNegativeFloat = Annotated[Number, Field(ge=0)]
Seed = Annotated[Integer, Field(ge=0, le=2**63 - 1)]
Positive = Annotated[Integer, Field(ge=1)]
NonEmptyText = Annotated[str, Field(min_length=1)]


class _FamilyFields(_Body):
    """A body that makes images: its subclass for a deployment (``request_models``) adds
    the fields of the pipeline's family, and names them here."""

    family_fields: ClassVar[tuple[str, ...]] = ()
    # The most input images a request may carry (the family's; 0: its DiT takes none).
    max_input_images: ClassVar[int] = 1
    # Whether the pipeline edits an input image and makes nothing without one.
    requires_input_image: ClassVar[bool] = False
    # Common image fields the family's DiT does not take: refused by name.
    unsupported_fields: ClassVar[tuple[str, ...]] = ()
    # Whether the DiT makes partial images (its family's latents decode part way).
    makes_partial_images: ClassVar[bool] = False
    # A family that hears and speaks: its voices, rates and bounds; None: no audio.
    speech: ClassVar[SpeechRecipe | None] = None

    def _check_supported(self) -> None:
        for name in self.unsupported_fields:
            if getattr(self, name, None) is not None:
                raise RequestError(
                    400,
                    f"{name}: unknown parameter for this pipeline (its model family's DiT "
                    "does not take it)",
                    name,
                )


class _Sampling(_Body):
    """An LLM stage's sampling fields, as OpenAI's API and vLLM's server (its extensions:
    top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
    skip_special_tokens) name them. The router checks their types and ranges; the stage
    checks the rest with vLLM's own SamplingParams, and a refusal names the field."""

    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    # vLLM takes -1 and 0 for no top-k, and refuses less; a JSON integer past 64 bits
    # parses as a float, so the bound says where integers end.
    top_k: Annotated[Integer, Field(ge=-1, le=2**63 - 1)] | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0)] | None = None
    min_tokens: Annotated[Integer, Field(ge=0, le=2**31 - 1)] | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[Annotated[Integer, Field(ge=0, le=2**31 - 1)]] | None = None
    skip_special_tokens: StrictBool | None = None
    seed: Seed | None = None

    def _llm_params(self, max_tokens: int | None, limits: RouterLimits) -> dict[str, Any]:
        """The sampling params given, by the stage's names; RequestError past a limit."""
        if max_tokens is not None and max_tokens > limits.max_tokens:
            raise RequestError(
                400, f"max_tokens: at most {limits.max_tokens} (got {max_tokens})", "max_tokens"
            )
        most = max_tokens if max_tokens is not None else limits.max_tokens
        if self.min_tokens is not None and self.min_tokens > most:
            raise RequestError(
                400,
                f"min_tokens: at most max_tokens ({most}; got {self.min_tokens})",
                "min_tokens",
            )
        params = {
            name: getattr(self, name) for name in _LLM_PARAMS if getattr(self, name) is not None
        }
        if max_tokens is not None:
            params["max_tokens"] = max_tokens
        return params


class ChatCompletionRequest(_FamilyFields, _Sampling):
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
        return (*_IMAGE_ONLY_CHAT_FIELDS, *cls.family_fields)

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
        self, request_id: str, output_kind: OutputKind, limits: RouterLimits
    ) -> PipelineRequest:
        """The pipeline request this chat completion asks for; RequestError naming the
        field when the pipeline cannot answer it or it is over a limit."""
        if output_kind == "speech":
            return self._speech_request(request_id, limits)
        if self.audio is not None or "audio" in (self.modalities or []):
            raise RequestError(
                400,
                "modalities: this pipeline does not speak; leave out audio",
                "audio" if self.audio is not None else "modalities",
            )
        wants_image = "image" in (self.modalities or [])
        if wants_image and output_kind != "image":
            raise RequestError(
                400,
                "modalities: this pipeline ends in an LLM stage and answers with text; "
                'leave out "image"',
                param="modalities",
            )
        if not wants_image and output_kind == "image":
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
        llm_params = self._llm_params(self.max_completion_tokens or self.max_tokens, limits)
        if wants_image:
            if self.requires_input_image and not images:
                raise RequestError(
                    400,
                    "messages: this pipeline edits an input image; send it as an image_url "
                    "part of a message",
                    "messages",
                )
            self._check_supported()
            check_size(limits, self.height, self.width)
            llm_params.pop("seed", None)  # the seed is the image's
            return PipelineRequest(
                request_id=request_id,
                messages=messages,
                llm_params=llm_params,
                diffusion_params=_diffusion_params(self, height=self.height, width=self.width),
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
                "messages: a spoken answer to an image is not supported yet (the talker reads "
                "text and audio); ask for text alone, or leave the image out",
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
            llm_params=self._llm_params(self.max_completion_tokens or self.max_tokens, limits),
            sticky_key=self.user,
            stream=self.stream,
            audios=audios,
            voice=voice,
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


def hear_messages(
    messages: list[ChatMessage], speech: SpeechRecipe, limits: RouterLimits, max_images: int
) -> tuple[list[dict[str, Any]], list[np.ndarray], list[np.ndarray]]:
    """Chat messages as a thinker that hears and sees takes them (text, or a list of text,
    input_audio and image parts, their data taken out), the audio's samples, decoded at its
    processor's rate, and the images; RequestError naming the part for an image or audio
    that cannot be decoded."""
    flat: list[dict[str, Any]] = []
    audios: list[np.ndarray] = []
    images: list[np.ndarray] = []
    for index, message in enumerate(messages):
        if isinstance(message.content, str):
            flat.append({"role": message.role, "content": message.content})
            continue
        parts: list[dict[str, Any]] = []
        for part_index, part in enumerate(message.content):
            where = f"messages[{index}].content[{part_index}]"
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
            elif isinstance(part, InputAudioPart):
                try:
                    audios.append(
                        audio_codec.decode_input_audio(
                            part.input_audio.data,
                            part.input_audio.format,
                            sample_rate=speech.input_sample_rate,
                            max_seconds=speech.max_input_seconds,
                            param=f"{where}.input_audio",
                        )
                    )
                except audio_codec.InvalidAudioError as e:
                    raise RequestError(400, f"{e.param}: {e.message}", e.param) from None
                parts.append({"type": "input_audio"})
            else:
                if len(images) >= max_images:
                    raise RequestError(400, f"messages: {too_many_images(max_images)}", "messages")
                images.append(decode_data_url(part.image_url.url, limits, f"{where}.image_url.url"))
                parts.append({"type": "image"})
        flat.append({"role": message.role, "content": parts})
    return flat, audios, images


# The body fields that are an LLM stage's sampling params, by the same name.
_LLM_PARAMS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "seed",
)


class CompletionRequest(_Sampling):
    """POST /v1/completions: a text prompt continued, without a chat template (pipelines
    whose first stage is an LLM and that answer with text)."""

    model: str | None = None
    # OpenAI's API also takes several prompts, or token ids, in one request; one text
    # prompt per request here (a list of one is taken, as clients send it).
    prompt: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)]
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Unset: 16, OpenAI's and vLLM's default for completions (or the router's limit, if
    # lower).
    max_tokens: Positive | None = None
    n: Positive = 1
    user: str | None = None
    # Accepted as their "off" values, which clients (vLLM's benchmark among them) send.
    echo: StrictBool = False
    logprobs: Annotated[Integer, Field(ge=0)] | None = None
    suffix: str | None = None

    def to_pipeline_request(
        self, request_id: str, output_kind: OutputKind, limits: RouterLimits
    ) -> PipelineRequest:
        """The pipeline request this completion asks for; RequestError naming the field
        when the pipeline cannot answer it or it is over a limit."""
        if output_kind != "text":
            raise RequestError(
                400,
                "this pipeline makes images; /v1/completions is for pipelines that answer "
                "with text (POST /v1/images/generations)",
                param="prompt",
            )
        for name, off in (("echo", False), ("logprobs", None), ("suffix", None)):
            if getattr(self, name) != off:
                raise RequestError(400, f"{name}: not supported by this router", name)
        if self.n != 1:
            raise RequestError(400, f"n: only 1 completion per request (got {self.n})", "n")
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        check_common(limits, len(prompt), self.n, None, prompt_param="prompt")
        return PipelineRequest(
            request_id=request_id,
            prompt=prompt,
            llm_params=self._llm_params(
                self.max_tokens if self.max_tokens is not None else min(16, limits.max_tokens),
                limits,
            ),
            sticky_key=self.user,
            stream=self.stream,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): a prompt's token ids, or a conversation's through the chat
    template, as the pipeline's first stage computes them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool = True
    # vLLM's default; a conversation is tokenized as the first stage renders a chat request.
    add_generation_prompt: Literal[True] = True

    def stage_kwargs(self, limits: RouterLimits) -> dict[str, Any]:
        """The first stage's tokenize call for this request; RequestError when it is not
        exactly one of prompt and messages, or over the prompt limit."""
        if (self.prompt is None) == (self.messages is None):
            raise RequestError(400, "prompt: give exactly one of prompt and messages", "prompt")
        if self.prompt is not None:
            check_common(limits, len(self.prompt), 1, None, prompt_param="prompt")
            return {"prompt": self.prompt, "add_special_tokens": self.add_special_tokens}
        assert self.messages is not None
        if any(
            not isinstance(m.content, str) and any(isinstance(p, ImagePart) for p in m.content)
            for m in self.messages
        ):
            raise RequestError(400, "messages: /tokenize takes text only", "messages")
        messages, _ = flatten_messages(self.messages, limits, 0)
        check_common(limits, sum(len(m["content"]) for m in messages), 1, None)
        return {"messages": messages}


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's): token ids as text."""

    model: str | None = None
    tokens: list[Annotated[Integer, Field(ge=0, le=2**31 - 1)]]

    def stage_kwargs(self, limits: RouterLimits) -> dict[str, Any]:
        # Each token is at least a character of text: the prompt limit bounds them too.
        if len(self.tokens) > limits.max_prompt_chars:
            raise RequestError(
                400, f"tokens: at most {limits.max_prompt_chars} (got {len(self.tokens)})", "tokens"
            )
        return {"tokens": self.tokens}


class LoadLoraAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's): serve an adapter from now on, by name."""

    lora_name: str = Field(min_length=1, max_length=64, description="What requests name it by.")
    lora_path: str = Field(
        min_length=1,
        max_length=1024,
        description="Where its files are: an absolute path in the stage's pod, a hub id, or "
        "(a diffusion stage's) an https:// URL of one .safetensors file.",
    )
    stage: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        description="The stage it is for; unset: the one stage that takes adapters.",
    )
    scale: Annotated[Number, Field(ge=-8, le=8)] | None = Field(
        default=None, description="A diffusion stage's: how strongly it applies (unset: 1)."
    )


class UnloadLoraAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's): stop serving an adapter added at run time."""

    lora_name: str = Field(min_length=1, max_length=64)
    # vLLM's request carries it; names are what identify adapters here.
    lora_int_id: Integer | None = None


class _ImageRequest(_FamilyFields):
    """What /v1/images/generations and /v1/images/edits share: the prompt, how many images
    of what size, and the diffusion stage's params; one place checks them all."""

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: Positive = 1
    size: str | None = None
    # OpenAI's default is "url" for its older models; this server keeps no files to link to.
    response_format: str = "b64_json"
    seed: Seed | None = None
    num_inference_steps: Positive | None = None
    guidance_scale: NonNegativeFloat | None = None
    negative_prompt: str | None = None
    user: str | None = None
    # OpenAI's image streaming: partial images as events, then the image.
    stream: StrictBool = False
    partial_images: Annotated[Integer, Field(ge=0, le=MAX_PARTIAL_IMAGES)] | None = None

    def _diffusion_params(
        self, output_kind: OutputKind, limits: RouterLimits, **more: Any
    ) -> dict[str, Any]:
        """The diffusion stage's params for these images (``more``: those of one path);
        RequestError naming the field when the pipeline makes no images or a field is over
        a limit."""
        if output_kind != "image":
            raise RequestError(
                400,
                "this pipeline ends in an LLM stage and makes no images; use /v1/chat/completions",
            )
        if self.response_format != "b64_json":
            raise RequestError(
                400,
                "response_format: only 'b64_json' is supported (images come back in the "
                f"response; this server keeps no files to link to); got {self.response_format!r}",
                param="response_format",
            )
        check_common(limits, len(self.prompt), self.n, self.num_inference_steps, "prompt")
        self._check_supported()
        height, width = parse_size(self.size, limits)
        # Partial images are events of a stream: without one, the answer is the images alone.
        if self.stream and self.partial_images and self.makes_partial_images:
            # A DiT that makes none is asked for none: the stream has the image alone, as
            # OpenAI's API allows (fewer partials than asked for).
            more["partial_images"] = self.partial_images
        return _diffusion_params(self, height=height, width=width, **more)

    def _pipeline_request(
        self, request_id: str, params: dict[str, Any], images: list[np.ndarray] | None = None
    ) -> PipelineRequest:
        return PipelineRequest(
            request_id=request_id,
            # As a chat message: an LLM first stage reads it through its chat template, like
            # the same prompt sent to /v1/chat/completions.
            messages=[{"role": "user", "content": self.prompt}],
            diffusion_params=params,
            images=images or [],
            sticky_key=self.user,
        )


class ImageGenerationRequest(_ImageRequest):
    """POST /v1/images/generations (a JSON body)."""

    def to_pipeline_request(
        self, request_id: str, output_kind: OutputKind, limits: RouterLimits
    ) -> PipelineRequest:
        """The pipeline request for these images; RequestError naming the field when the
        pipeline makes no images or the request is over a limit."""
        params = self._diffusion_params(output_kind, limits)
        if self.requires_input_image:
            raise RequestError(
                400,
                "image: this pipeline edits an input image and makes none from text alone: "
                "POST /v1/images/edits with the image (or a chat completion with it)",
                "image",
            )
        return self._pipeline_request(request_id, params)


class ImageEditRequest(_ImageRequest):
    """POST /v1/images/edits: the form's fields (the images travel beside, as bytes)."""

    def to_pipeline_request(
        self,
        request_id: str,
        output_kind: OutputKind,
        limits: RouterLimits,
        images: Sequence[bytes],
    ) -> PipelineRequest:
        """The pipeline request that edits ``images`` (PNG/JPEG/... files' bytes, as many
        as the form may carry), decoded last, once every field has passed; RequestError
        naming the field otherwise. The decode takes milliseconds: call this off the event
        loop."""
        params = self._diffusion_params(output_kind, limits)
        return self._pipeline_request(
            request_id, params, [decode_input_image(image, limits, "image") for image in images]
        )


# OpenAI's clip length when a request gives none.
DEFAULT_VIDEO_SECONDS = 4


class VideoCreateRequest(_Body):
    """POST /v1/videos: OpenAI's fields (``input_reference``, an image file, travels beside
    as bytes) and the video DiT's own, spelled as the image endpoints spell them."""

    prompt: str = Field(min_length=1)
    model: str | None = None
    # OpenAI's clients send "4", "8" or "12"; any length in seconds is taken here.
    seconds: str | None = None
    size: str | None = None
    num_inference_steps: Positive | None = None
    seed: Seed | None = None
    guidance_scale: NonNegativeFloat | None = None
    negative_prompt: str | None = None
    # The clip's frames, instead of those ``seconds`` asks for; and its frame rate.
    num_frames: Positive | None = None
    fps: Positive | None = None
    user: str | None = None

    def job_params(self, recipe: VideoRecipe, limits: RouterLimits) -> dict[str, Any]:
        """The diffusion params of this clip (frames from ``seconds`` at the family's fps,
        or ``num_frames``) and its ``fps``; RequestError naming the field over a limit."""
        check_common(limits, len(self.prompt), 1, self.num_inference_steps, "prompt")
        height, width = parse_size(self.size, limits)
        fps = self.fps or recipe.fps
        # Checked even where num_frames wins over it: a bad field is refused, not ignored.
        seconds = _seconds(self.seconds)
        frames = self.num_frames
        if frames is None:
            frames = frames_for(seconds, fps, recipe.frame_step)
        if frames > limits.max_video_frames:
            field = "num_frames" if self.num_frames is not None else "seconds"
            raise RequestError(
                400,
                f"{field}: at most {limits.max_video_frames} frames a clip "
                f"({limits.max_video_frames / fps:.1f} s at {fps} fps); this asks for {frames}",
                param=field,
            )
        if (frames - 1) % recipe.frame_step:
            raise RequestError(
                400,
                f"num_frames: 1 + a multiple of {recipe.frame_step} (the VAE's "
                f"compression), such as {frames_for(frames / fps, fps, recipe.frame_step)}; "
                f"got {frames}",
                param="num_frames",
            )
        return _given(
            height=height,
            width=width,
            num_frames=frames,
            fps=fps,
            num_inference_steps=self.num_inference_steps,
            seed=self.seed,
            guidance_scale=self.guidance_scale,
            negative_prompt=self.negative_prompt,
        )


def _seconds(value: str | None) -> float:
    if value is None:
        return float(DEFAULT_VIDEO_SECONDS)
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not (seconds > 0 and seconds != float("inf")):
        raise RequestError(
            400, f"seconds: a positive number of seconds, such as 4 (got {value!r})", "seconds"
        )
    return seconds


def _given(**params: Any) -> dict[str, Any]:
    return {name: value for name, value in params.items() if value is not None}


# The diffusion stage's params every image request spells the same way (besides its
# family's fields, also the DiT's by the same name).
_DIFFUSION_FIELDS = ("num_inference_steps", "guidance_scale", "seed", "negative_prompt")
# The common chat completion fields that only images use (seed seeds text sampling too).
_IMAGE_ONLY_CHAT_FIELDS = (
    "height",
    "width",
    *(name for name in _DIFFUSION_FIELDS if name != "seed"),
)


def _diffusion_params(body: ChatCompletionRequest | _ImageRequest, **more: Any) -> dict[str, Any]:
    """The diffusion stage's params of an image request: its shared fields and its family's,
    its ``n`` as num_images, and ``more`` (those the path spells its own way); unset ones
    left out."""
    shared = {name: getattr(body, name) for name in (*_DIFFUSION_FIELDS, *body.family_fields)}
    return _given(**shared, num_images=body.n, **more)


# -- the bodies of one deployment: the common fields and its family's --------------------


@dataclass(frozen=True)
class RequestModels:
    """The image-making bodies one deployment parses and documents (the others have no
    family fields): the common models, subclassed with ``fields``, and the ones that take
    an input image (chat completions, edits) with ``edit_fields`` too."""

    chat: type[ChatCompletionRequest]
    images: type[ImageGenerationRequest]
    edits: type[ImageEditRequest]
    fields: tuple[RequestField, ...]
    edit_fields: tuple[RequestField, ...]


# Image-to-image's: how far from the input image to go. Only a pipeline of no family has
# that variant (diffusers' AutoPipelineForImage2Image beside its own pipeline); a family's
# DiT edits its own way and refuses it. Without an input image the DiT runs text-to-image
# and leaves it out, as it always has.
STRENGTH = RequestField(
    name="strength",
    kind="number",
    description="An edit's: how far from the input image to go (1 ignores it).",
    gt=0,
    le=1,
)


# The request field that picks a step-cache tier (the DiT's params take it by this name).
STEP_CACHE_FIELD = "step_cache"


def step_cache_field(tiers: tuple[str, ...]) -> RequestField:
    """The field that picks one of a DiT stage's step-cache ``tiers`` (config.StepCacheConfig)."""
    return RequestField(
        name=STEP_CACHE_FIELD,
        kind="enum",
        description="The DiT's step-cache tier: 'off' computes every step (exact); the others "
        "predict some steps from the computed ones (faster, close to exact). Unset: the "
        "stage's default tier.",
        values=tiers,
    )


# The request field that scales the DiT's LoRA adapter (the router takes it out of the DiT's
# params into the adapter's scale).
LORA_SCALE_FIELD = "lora_scale"
LORA_SCALE = RequestField(
    name=LORA_SCALE_FIELD,
    kind="number",
    description="How strongly the DiT's LoRA adapter (named in model) applies; unset: the "
    "adapter's own scale.",
    ge=-8,
    le=8,
)


def request_models(
    family: Family | None, step_cache_tiers: tuple[str, ...] = (), dit_adapters: bool = False
) -> RequestModels:
    """The bodies a pipeline of ``family`` (None: of no family) takes, with a step_cache
    field where its DiT has ``step_cache_tiers`` and a lora_scale field where its DiT takes
    adapters (``dit_adapters``); built once per set of fields, so that the app and its
    OpenAPI document share the very classes."""
    cache: tuple[RequestField, ...] = (
        (step_cache_field(step_cache_tiers),) if step_cache_tiers else ()
    )
    cache += (LORA_SCALE,) if dit_adapters else ()
    if family is None:
        # Its DiT's image-to-image variant takes one input image.
        return _request_models(
            (*familyless_fields(), *cache), (STRENGTH,), InputRules(max_images=1)
        )
    rules = InputRules(
        max_images=family.max_input_images,
        requires_image=family.dit.requires_image,
        unsupported=family.dit.unsupported_fields,
        partial_images=family.dit.preview is not None,
        speech=family.speech,
    )
    return _request_models((*family.request_fields, *cache), (), rules)


@dataclass(frozen=True)
class InputRules:
    """What a deployment's image bodies take beyond their fields: how many input images,
    whether one is required, which common fields its family's DiT refuses."""

    max_images: int
    requires_image: bool = False
    unsupported: tuple[str, ...] = ()
    partial_images: bool = False
    speech: SpeechRecipe | None = None


def familyless_fields() -> tuple[RequestField, ...]:
    """What a pipeline of no family takes beyond the common fields.

    Its DiT runs a plain diffusers pipeline in DiffusionEngine, whose DiffusionParams take
    the call arguments of every family that a diffusers pipeline runs (true_cfg_scale,
    cfg_normalization, cfg_truncation) and hand each to whichever pipeline is loaded when
    its __call__ takes it (FluxPipeline takes true_cfg_scale), refusing it by name when not.
    So such a pipeline takes those families' fields together, exactly as it did before
    families declared them (tests/unit/omni_runtime/router checks the set against
    DiffusionParams). A family with an engine of its own (BAGEL's) declares fields that no
    DiffusionEngine takes (DiffusionParams refuses them): those are left out.
    """
    fields: dict[str, RequestField] = {}
    for family in FAMILIES.values():
        if family.dit.engine is not None:
            continue
        for field in family.request_fields:
            if fields.setdefault(field.name, field) != field:
                raise ValueError(
                    f"request field {field.name}: families declare it differently; a pipeline "
                    "of no family could not take both"
                )
    return tuple(fields.values())


@functools.cache
def _request_models(
    fields: tuple[RequestField, ...], edit_fields: tuple[RequestField, ...], rules: InputRules
) -> RequestModels:
    return RequestModels(
        chat=_with_fields(ChatCompletionRequest, fields, edit_fields, rules),
        images=_with_fields(
            ImageGenerationRequest, fields, (), dataclasses.replace(rules, max_images=0)
        ),
        edits=_with_fields(ImageEditRequest, fields, edit_fields, rules),
        fields=fields,
        edit_fields=edit_fields,
    )


_Model = TypeVar("_Model", bound=_FamilyFields)


def _with_fields(
    base: type[_Model],
    fields: tuple[RequestField, ...],
    edit_fields: tuple[RequestField, ...],
    rules: InputRules,
) -> type[_Model]:
    """``base`` with ``fields`` and ``edit_fields`` added, each optional (None: the stage's
    default), under ``base``'s name: the OpenAPI document's schemas keep their names; its
    requests follow ``rules``."""
    definitions: dict[str, Any] = {}
    for field in (*fields, *edit_fields):
        if field.name in base.model_fields or hasattr(base, field.name):
            # A family's field would silently replace a common one's checks.
            raise ValueError(f"request field {field.name}: {base.__name__} has it already")
        definitions[field.name] = (
            _annotation(field) | None,
            Field(default=None, description=field.description),
        )
    model = create_model(
        base.__name__,
        __base__=base,
        __module__=base.__module__,
        __doc__=base.__doc__,
        **definitions,
    )
    model.family_fields = tuple(field.name for field in (*fields, *edit_fields))
    model.max_input_images = rules.max_images
    model.requires_input_image = rules.requires_image
    model.unsupported_fields = rules.unsupported
    model.makes_partial_images = rules.partial_images
    model.speech = rules.speech
    return model


def _annotation(field: RequestField) -> Any:
    """The pydantic type of a family's field: JSON's types, strictly, as the common
    fields are (true is no number, "1.5" none either)."""
    # A bound left None is no bound (pydantic skips it).
    bounds = Field(ge=field.ge, gt=field.gt, le=field.le, lt=field.lt)
    match field.kind:
        case "number":
            return Annotated[Number, bounds]
        case "integer":
            return Annotated[Integer, bounds]
        case "boolean":
            return StrictBool
        case "enum":
            literal: Any = Literal
            return literal[field.values]
        case "number_pair":
            each: Any = Annotated[Number, bounds]
            return tuple[each, each]


def _takers(name: str, model: type[BaseModel]) -> list[str]:
    """The kinds of pipeline whose ``model`` body takes the field ``name``: families by
    name, and "family-less" for pipelines of none."""
    if not issubclass(model, _FamilyFields):
        return []  # no family adds to it
    takers = [
        family.name
        for family in FAMILIES.values()
        if any(field.name == name for field in family.request_fields)
    ]
    # Generations take no input image: no pipeline's take an edit's strength.
    edit = () if issubclass(model, ImageGenerationRequest) else (STRENGTH,)
    if any(field.name == name for field in (*familyless_fields(), *edit)):
        takers.append("family-less")
    return takers


def unknown_field(name: str, model: type[BaseModel]) -> str:
    """Why the top-level field ``name`` of a ``model`` body is refused: not part of this
    API, or not of this pipeline (another family's field, named as such so that the caller
    knows where it belongs; "unknown parameter", as a DiT words one it does not take)."""
    if name == STEP_CACHE_FIELD and issubclass(model, _FamilyFields):
        return "unknown parameter for this pipeline (its diffusion stage has no stepCache)"
    takers = _takers(name, model)
    if not takers:
        return "unknown field (not part of this API)"
    listed = ", ".join(takers[:-1]) + " and " + takers[-1] if len(takers) > 1 else takers[0]
    return f"unknown parameter for this pipeline ({listed} pipelines take it)"


def decode_json(raw: bytes, limits: RouterLimits) -> Any:
    """A request body's JSON; RequestError if it is not JSON or nests too deep.

    orjson stops at 1024 levels by itself, so the depth walk below never meets more, and
    neither recursion nor the input's size can take the router down.
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if "depth limit" in str(e):
            raise RequestError(400, _too_deep(limits)) from None
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    if nesting_depth(body, limits.max_json_nesting) > limits.max_json_nesting:
        raise RequestError(400, _too_deep(limits))
    return body


def _too_deep(limits: RouterLimits) -> str:
    return f"the body nests deeper than {limits.max_json_nesting} levels of arrays and objects"


def parse_body(model: type[_Body], body: Any) -> Any:
    """Validate ``body`` as ``model``; RequestError naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, not {type(body).__name__}")
    try:
        return model.model_validate(_integral_as_int(body))
    except ValidationError as e:
        raise _first_error(e, model) from None


def _integral_as_int(value: Any) -> Any:
    """``value`` with each float that is a whole number as an int: JSON (and JSON Schema's
    "integer") makes no difference between 280.0 and 280, which clients that compute a size
    send either way. Past 2**53 a float stands for no one integer, and stays a float."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: _integral_as_int(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral_as_int(item) for item in value]
    return value


def _first_error(error: ValidationError, model: type[BaseModel]) -> RequestError:
    first = error.errors(include_url=False)[0]
    path = _path(first["loc"])
    if first["type"] == "extra_forbidden" and len(first["loc"]) == 1:
        return RequestError(400, f"{path}: {unknown_field(path, model)}", param=path)
    return RequestError(400, f"{path}: {_describe(first)}", param=path)


def _path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("text", "image_url") and path.endswith("]"):
            # The discriminated union's branch name is not a field the caller wrote.
            continue
        else:
            path += f".{part}" if path else str(part)
    return path or "body"


def _describe(error: Any) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown field (not part of this API)"
    if kind == "missing":
        return "required"
    if kind == "literal_error":
        return f"{error['msg']} (got {error.get('input')!r})"
    return f"{error['msg']} (got {_short(error.get('input'))})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_common(
    limits: RouterLimits,
    prompt_chars: int,
    n: int,
    steps: int | None,
    prompt_param: str = "messages",
) -> None:
    if prompt_chars > limits.max_prompt_chars:
        raise RequestError(
            400,
            f"prompt is {prompt_chars} characters; the limit is {limits.max_prompt_chars}",
            param=prompt_param,
        )
    if n > limits.max_n:
        raise RequestError(400, f"n: at most {limits.max_n} (got {n})", param="n")
    if steps is not None and steps > limits.max_steps:
        raise RequestError(
            400,
            f"num_inference_steps: at most {limits.max_steps} (got {steps})",
            param="num_inference_steps",
        )


def check_size(limits: RouterLimits, height: int | None, width: int | None) -> None:
    for name, value in (("height", height), ("width", width)):
        if value is not None and value > limits.max_image_side:
            raise RequestError(
                400, f"{name}: at most {limits.max_image_side} (got {value})", param=name
            )


_SIZE = re.compile(r"([1-9][0-9]*)x([1-9][0-9]*)")


def parse_size(size: str | None, limits: RouterLimits) -> tuple[int | None, int | None]:
    """``WIDTHxHEIGHT`` (OpenAI's order) -> (height, width); None: the stage's default."""
    if size is None or size == "auto":
        return None, None
    match = _SIZE.fullmatch(size)
    if match is None:
        raise RequestError(
            400, f"size: expected WIDTHxHEIGHT such as 512x512, or auto (got {size!r})", "size"
        )
    width, height = int(match.group(1)), int(match.group(2))
    check_size(limits, height, width)
    return height, width


_DATA_URL = re.compile(r"data:(image/[a-z0-9.+-]+)?(;[^,]*)?,", re.IGNORECASE)


def decode_data_url(url: str, limits: RouterLimits, where: str) -> np.ndarray:
    """The image of a ``data:image/...;base64,...`` URL as uint8 RGB."""
    match = _DATA_URL.match(url)
    if match is None or match.group(1) is None or ";base64" not in (match.group(2) or ""):
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise RequestError(
            400,
            f"{where}: only base64 data URLs of images are accepted "
            f"(data:image/png;base64,...); got {shown!r}",
            param=where,
        )
    payload = url[match.end() :]
    if len(payload) * 3 // 4 > limits.max_input_image_bytes:
        raise image_too_large(limits, where)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, f"{where}: the data URL is not valid base64", param=where) from None
    return decode_input_image(data, limits, where)


def decode_input_image(data: bytes, limits: RouterLimits, where: str) -> np.ndarray:
    """An input image file's bytes as uint8 RGB, within the limits; RequestError naming
    ``where`` (413 over the bytes limit, 400 over the pixels limit, read from the header
    before the pixels are decoded, or not an image)."""
    if len(data) > limits.max_input_image_bytes:
        raise image_too_large(limits, where)
    try:
        return decode_image(data, max_pixels=limits.max_input_image_pixels)
    except ValueError as e:
        raise RequestError(400, f"{where}: {e}", param=where) from None


def image_too_large(limits: RouterLimits, where: str) -> RequestError:
    return RequestError(
        413, f"{where}: the image is over {_amount(limits.max_input_image_bytes)}", param=where
    )


def body_too_large(limits: RouterLimits) -> RequestError:
    return RequestError(413, f"the body is over the limit of {_amount(limits.max_body_bytes)}")


def _amount(size: int) -> str:
    mib = 1024 * 1024
    return f"{size // mib} MiB" if size >= mib and size % mib == 0 else f"{size} bytes"


def flatten_messages(
    messages: list[ChatMessage], limits: RouterLimits, max_images: int
) -> tuple[list[dict[str, str]], list[np.ndarray]]:
    """Chat messages as the LLM stage takes them (text content), and the input images;
    RequestError for more than ``max_images`` of them, before any is decoded."""
    count = sum(
        isinstance(part, ImagePart)
        for message in messages
        if not isinstance(message.content, str)
        for part in message.content
    )
    if count > max_images:
        raise RequestError(400, f"messages: {too_many_images(max_images, count)}", "messages")
    flat: list[dict[str, str]] = []
    images: list[np.ndarray] = []
    for index, message in enumerate(messages):
        if isinstance(message.content, str):
            flat.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        for part_index, part in enumerate(message.content):
            if isinstance(part, TextPart):
                texts.append(part.text)
            elif isinstance(part, InputAudioPart):
                where = f"messages[{index}].content[{part_index}]"
                raise RequestError(400, f"{where}: this pipeline takes no audio", where)
            else:
                where = f"messages[{index}].content[{part_index}].image_url.url"
                images.append(decode_data_url(part.image_url.url, limits, where))
        flat.append({"role": message.role, "content": "\n".join(texts)})
    return flat, images


def too_many_images(most: int, count: int | None = None) -> str:
    """Why a request with ``count`` input images (None: more than ``most``) is refused."""
    if most == 0:
        return "this pipeline takes no input image"
    got = f" (got {count})" if count is not None else ""
    if most == 1:
        return f"at most one input image per request{got}"
    return f"at most {most} input images per request{got}"


# The form's image parts: "image" as the openai client sends one file, "image[]" as it
# sends a list (of which this server takes as many as the pipeline's family allows).
_IMAGE_PARTS = ("image", "image[]")


@dataclass(frozen=True)
class FileParts:
    """The file parts a form takes: the names it may spell them by (one kind per form),
    the field its errors name, how many it takes at most, and whether one is required."""

    names: tuple[str, ...]
    field: str
    most: int
    required: bool


# A video's image to start from (image-to-video): OpenAI's form part.
INPUT_REFERENCE = FileParts(("input_reference",), "input_reference", 1, required=False)

_UNSUPPORTED_PARTS = {
    "mask": "inpainting masks are not supported here; send the image alone (all of it is "
    "edited, as far as strength says)",
}


class ImageEditForm:
    """A /v1/images/edits ``multipart/form-data`` body, parsed chunk by chunk as it arrives.

    Every limit holds while the body streams in, so nothing is held past its limit: the
    whole body at ``max_body_bytes`` (413), the image at ``max_input_image_bytes`` (413
    naming ``image``), a text field at 4 bytes (UTF-8's most) per character of
    ``max_prompt_chars`` (413 naming it); python-multipart bounds each part's headers. A
    an image past the pipeline's count, a mask, a field given twice or one that is not part of
    this API is refused (400 naming it) as soon as its part's headers arrive, before its
    data: so a form has at most one part per field, and as many images as the pipeline
    takes. ``model``: the deployment's edit body (``request_models``).
    """

    def __init__(
        self,
        content_type: str,
        limits: RouterLimits,
        model: type[BaseModel],
        files: FileParts | None = None,
    ) -> None:
        """``files``: the form's file parts (None: an edit's images, as many as ``model``,
        an edit body, takes)."""
        media, options = parse_options_header(content_type)
        if media != b"multipart/form-data":
            raise RequestError(
                415,
                f"Content-Type must be multipart/form-data (got {content_type or 'none'!r})",
            )
        boundary = options.get(b"boundary")
        if not boundary:
            raise RequestError(
                400, "Content-Type: multipart/form-data needs its boundary parameter"
            )
        self.limits = limits
        self.model = model
        if files is None:
            most = getattr(model, "max_input_images", 1)
            files = FileParts(_IMAGE_PARTS, "image", most, required=True)
        self.files = files
        self.fields: dict[str, str] = {}
        self.images: list[bytes] = []
        # How the form spells its image parts (image, or image[] for a list).
        self._image_part: str | None = None
        self._max_field_bytes = 4 * limits.max_prompt_chars
        self._received = 0
        self._ended = False
        self._header = bytearray()
        self._value = bytearray()
        self._disposition = b""
        self._name = ""
        self._data = bytearray()
        callbacks: MultipartCallbacks = {
            "on_part_begin": self._part_begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }
        self._parser = MultipartParser(boundary, callbacks)

    def feed(self, chunk: bytes) -> None:
        """The body's next bytes; RequestError as soon as they break a limit or the format."""
        self._received += len(chunk)
        if self._received > self.limits.max_body_bytes:
            raise body_too_large(self.limits)
        try:
            self._parser.write(chunk)
        except FormParserError as e:
            raise RequestError(400, f"the body is not valid multipart/form-data: {e}") from None

    def finish(self) -> tuple[Any, list[bytes]]:
        """The validated fields (a ``model``) and the files' bytes, once the whole body is
        fed."""
        if not self._ended:
            raise RequestError(
                400, "the body is not valid multipart/form-data: it ends before its last boundary"
            )
        if self.files.required and not self.images:
            field = self.files.field
            raise RequestError(400, f"{field}: required (a file part named {field})", param=field)
        try:
            # Form fields are text: "2" is the integer 2 here, "abc" is not.
            request = self.model.model_validate_strings(self.fields)
        except ValidationError as e:
            raise _first_error(e, self.model) from None
        return request, self.images

    # -- python-multipart's callbacks --------------------------------------------------

    def _part_begin(self) -> None:
        self._disposition = b""
        self._data = bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            self._disposition = bytes(self._value)
        self._header = bytearray()
        self._value = bytearray()

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        raw = options.get(b"name")
        if not raw:
            raise RequestError(
                400, 'a form part has no name (Content-Disposition: form-data; name="...")'
            )
        name = raw.decode("utf-8", errors="replace")
        label = name if len(name) <= 60 else name[:57] + "..."
        self._name = name
        files = self.files
        if name in files.names:
            if len(self.images) >= files.most:
                why = too_many_images(files.most)
                raise RequestError(400, f"{files.field}: {why}", param=files.field)
            if self._image_part not in (None, name):
                raise RequestError(
                    400,
                    f"{files.field}: give one file as {files.field} or a list as "
                    f"{files.field}[], not both",
                    param=files.field,
                )
            self._image_part = name
        elif name in _UNSUPPORTED_PARTS:
            raise RequestError(400, f"{name}: {_UNSUPPORTED_PARTS[name]}", param=name)
        elif name not in self.model.model_fields:
            raise RequestError(400, f"{label}: {unknown_field(name, self.model)}", param=label)
        elif name in self.fields:
            raise RequestError(400, f"{name}: given more than once", param=name)

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if len(self._data) + end - start > self._part_limit():
            if self._name in self.files.names:
                raise image_too_large(self.limits, self.files.field)
            raise RequestError(
                413, f"{self._name}: over {self._part_limit()} bytes", param=self._name
            )
        self._data += data[start:end]

    def _part_limit(self) -> int:
        if self._name in self.files.names:
            return self.limits.max_input_image_bytes
        return self._max_field_bytes

    def _part_end(self) -> None:
        if self._name in self.files.names:
            self.images.append(bytes(self._data))
            return
        try:
            self.fields[self._name] = self._data.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(400, f"{self._name}: not UTF-8 text", param=self._name) from None

    def _end(self) -> None:
        self._ended = True
