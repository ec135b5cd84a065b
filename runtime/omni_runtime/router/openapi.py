"""The router's OpenAPI document (GET /openapi.json), built from the request models.

The handlers read raw bodies (``router.app``: the size limits hold while a body streams
in), so FastAPI sees no body parameter and would document none. This module writes the
document instead: request bodies from ``router.protocol``'s models (their JSON schema, as
pydantic generates it), narrowed to what this router accepts, and every status a handler
can answer with, each error in OpenAI's shape.

The document describes this deployment, not the API in general: the served model's name,
the ``RouterLimits`` in force, the pipeline's output (text or images) and its model family
(whose own fields its image bodies take, and no other family's) narrow the schemas, so
that a request valid by the schema is one the router takes (a fuzzer in positive mode
relies on it) and one outside it is refused with a 4xx. Two limits no JSON schema can
state stay in the descriptions: the prompt limit is on all messages together, and a
prompt must also fit the first stage's context in tokens.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from omni_runtime import audio as audio_codec
from omni_runtime.families import Family
from omni_runtime.router.orchestrator import OutputKind
from omni_runtime.router.protocol import (
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    RequestModels,
    RouterLimits,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    VideoCreateRequest,
    request_models,
)

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{model}"


# -- response bodies (documentation only: router.serving builds them as plain dicts) -------


class ErrorDetail(BaseModel):
    message: str = Field(description="What was wrong, naming the field and the limit.")
    type: str = Field(
        description="invalid_request_error (4xx), rate_limit_exceeded (429), "
        "service_unavailable (503), timeout (504), server_error (500)."
    )
    param: str | None = Field(description="The request field at fault, when one is.")
    code: int | None = Field(description="The HTTP status.")


class ErrorResponse(BaseModel):
    """Every error: ``{"error": {"message", "type", "param", "code"}}``, as OpenAI's."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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
        "after the text the pipeline wrote first where it wrote one (BAGEL's plan); null "
        "for a spoken answer, whose text is its audio's transcript."
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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class Completion(BaseModel):
    """A completion; streamed (stream: true), each event is one of these with the new
    text, and the last, with stream_options.include_usage, has no choices and the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: None


class DetokenizeResponse(BaseModel):
    prompt: str


class ImageData(BaseModel):
    b64_json: str = Field(description="A PNG file, base64-encoded.")
    revised_prompt: str | None = Field(
        default=None,
        description="The text the pipeline wrote before drawing (BAGEL's plan in think "
        "mode, or the prompt an LLM stage wrote for the DiT); absent where it wrote none.",
    )


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]


class ImageStreamEvent(BaseModel):
    """One event of an image stream (stream: true): a partial image, or the image."""

    type: Literal[
        "image_generation.partial_image",
        "image_generation.completed",
        "image_edit.partial_image",
        "image_edit.completed",
    ]
    b64_json: str = Field(description="A PNG file, base64-encoded.")
    created_at: int
    size: str = Field(description="WIDTHxHEIGHT of the image.")
    quality: Literal["auto"]
    background: Literal["opaque"]
    output_format: Literal["png"]
    partial_image_index: int | None = Field(
        default=None, description="Partial images only: which, from 0."
    )
    usage: dict[str, Any] | None = Field(
        default=None, description="The completed event's: input tokens (the prompt's)."
    )


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="The model's path, or an adapter's source.")
    parent: str | None = Field(
        default=None, description="A LoRA adapter's: the served model it adapts."
    )
    stage: str | None = Field(default=None, description="A LoRA adapter's: the stage it runs on.")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    live_replicas: dict[str, int] = Field(description="Live replicas of each stage, by name.")
    revision: str | None = Field(
        default=None, description="The pipeline revision new requests run on (200 only)."
    )
    error: str | None = Field(default=None, description="Why nothing can be served (503 only).")


class Liveness(BaseModel):
    status: Literal["ok"]


class VideoError(BaseModel):
    code: str
    message: str


class Video(BaseModel):
    """A video job (OpenAI's Video object)."""

    id: str
    object: Literal["video"]
    created_at: int
    completed_at: int | None = Field(description="When it ended (completed or failed).")
    expires_at: int | None = Field(description="When it and its clip are deleted.")
    error: VideoError | None = Field(description="Why it failed (failed only).")
    model: str
    progress: int = Field(ge=0, le=100, description="Percent of its denoising steps done.")
    prompt: str
    remixed_from_video_id: None
    seconds: str = Field(description="The clip's length: frames / fps.")
    size: str = Field(description="WIDTHxHEIGHT, or auto until done where none was asked.")
    status: Literal["queued", "in_progress", "completed", "failed"]


class VideoList(BaseModel):
    object: Literal["list"]
    data: list[Video]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"]
    deleted: Literal[True]


_RESPONSE_MODELS: tuple[type[BaseModel], ...] = (
    ErrorResponse,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    TokenizeResponse,
    DetokenizeResponse,
    ImagesResponse,
    ImageStreamEvent,
    ModelList,
    Health,
    Liveness,
    Video,
    VideoList,
    VideoDeleted,
)

# Why each error status is answered; the statuses an operation lists are those its
# handler (and the layers around it) can return.
_ERRORS: dict[int, str] = {
    400: "The body breaks a rule (the message names the field and the rule), is not "
    "valid JSON or form data, nests too deep, is over a RouterLimits limit, or a stage "
    "refused a parameter.",
    401: "Missing or wrong API key (when the router requires one).",
    404: "The model named is not served here (the model, or one of its LoRA adapters), or "
    "(videos) no such job.",
    409: "The video job is not completed: its content does not exist yet.",
    413: "The body, or an input image, is over its size limit.",
    415: "The Content-Type is not the one the path takes.",
    429: "The router or a stage replica is at its concurrency limit: retry after the "
    "Retry-After header's seconds.",
    500: "A stage failed on the request.",
    503: "No pipeline revision has a live replica of every stage, or (videos) the job store "
    "cannot be reached.",
    504: "The request did not finish within the router's timeout.",
}
_POST_ERRORS = (400, 401, 404, 413, 415, 429, 500, 503, 504)


def openapi_document(
    *,
    title: str,
    version: str,
    model_name: str,
    output_kind: OutputKind,
    limits: RouterLimits,
    open_paths: frozenset[str] | None = None,
    family: Family | None = None,
    step_cache_tiers: tuple[str, ...] = (),
    dit_adapters: bool = False,
    adapters: bool = False,
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of a router serving ``model_name``, whose pipeline makes
    ``output_kind``, within ``limits``, and is of ``family`` (None: of none), its DiT
    caching steps in ``step_cache_tiers`` (none: it does not); with API keys, every path but
    ``open_paths`` needs one (a bearer security scheme)."""
    models = request_models(family, step_cache_tiers, dit_adapters)
    _, top = models_json_schema(
        [(model, "validation") for model in _request_models(models)]
        # Validation mode: a field with a default is one a response may leave out.
        + [(model, "validation") for model in _RESPONSE_MODELS],
        ref_template=_REF,
    )
    schemas: dict[str, Any] = copy.deepcopy(top["$defs"])
    # A family's DiT says whether it takes an input image; a pipeline of no family may
    # (its diffusers pipeline's image-to-image variant, which only its stage knows of).
    takes_image = output_kind == "image" and (family is None or family.dit.takes_image)
    requires_image = output_kind == "image" and models.chat.requires_input_image
    _narrow_requests(schemas, model_name, output_kind, limits, models, takes_image)
    if requires_image:
        # An edit pipeline's chat completion carries the image it edits.
        messages = schemas["ChatCompletionRequest"]["properties"]["messages"]
        messages["contains"] = {
            "type": "object",
            "properties": {
                "content": {"type": "array", "contains": {"$ref": _REF.format(model="ImagePart")}}
            },
            "required": ["content"],
        }
        messages["description"] = "At least one holds the image to edit (an image_url part)."
    for name in ("ChatCompletionRequest", "ImageGenerationRequest", "ImageEditRequest"):
        # Common fields the family's DiT does not take: refused by name.
        for field in models.chat.unsupported_fields:
            schemas[name]["properties"].pop(field, None)
    # A form field is text: a pair of numbers has no spelling there.
    pairs = {
        field.name for field in (*models.fields, *models.edit_fields) if field.kind == "number_pair"
    }
    schemas["ImageEditForm"] = _edit_form(
        schemas["ImageEditRequest"], pairs, models.edits.max_input_images
    )
    paths: dict[str, Any] = {}
    if output_kind != "video":
        paths["/v1/chat/completions"] = {"post": _chat_operation(output_kind)}
    # Image to video alone (HunyuanVideo-1.5's i2v): a job without an input_reference is
    # refused (400), and so is a JSON body, which has no file to carry one.
    image_to_video = output_kind == "video" and family is not None and family.dit.requires_image
    if output_kind == "video":
        form = schemas["VideoCreateForm"] = _video_form(schemas["VideoCreateRequest"])
        if family is not None and not family.dit.takes_image:
            # Text to video alone: an input_reference is refused (400).
            del form["properties"]["input_reference"]
        if image_to_video:
            form["required"] = ["input_reference", *form["required"]]
            form["properties"]["input_reference"]["description"] = (
                "The image file the clip starts from (its first frame): required, this "
                "pipeline makes clips from an image and a prompt."
            )
        for name in ("VideoCreateRequest", "VideoCreateForm"):
            _narrow_video(schemas[name], model_name, limits)
            if family is not None and family.dit.sized_by_image:
                _size_from_image(schemas[name]["properties"]["size"])
        paths.update(_video_paths(json_body=not image_to_video))
    elif output_kind == "image":
        if not requires_image:
            paths["/v1/images/generations"] = {"post": _images_generations()}
        if takes_image:
            paths["/v1/images/edits"] = {"post": _images_edits()}
    elif output_kind == "text":
        paths["/v1/completions"] = {"post": _completions_operation()}
        paths["/tokenize"] = {"post": _tokenizer_operation("tokenize")}
        paths["/detokenize"] = {"post": _tokenizer_operation("detokenize")}
    if adapters:
        paths["/v1/load_lora_adapter"] = {"post": _adapter_operation("load")}
        paths["/v1/unload_lora_adapter"] = {"post": _adapter_operation("unload")}
    paths.update(_get_paths())
    answers = {
        "image": "images",
        "video": "videos (jobs)",
        "text": "text",
        "speech": "text, spoken too where a chat completion asks for audio",
    }[output_kind]
    description = (
        f"Serves the model {model_name!r}, a pipeline that answers with "
        f"{answers}. Errors are OpenAI-shaped "
        '(`{"error": {"message", "type", "param", "code"}}`); unknown paths answer 404 and '
        "other methods 405 in the same shape."
    )
    if output_kind == "video":
        description += (
            " Only the Videos API (/v1/videos) makes its videos: the chat, completion and "
            "image paths answer 400 here, so they are not listed."
        )
        if image_to_video:
            description += (
                " Each clip starts from an input image: POST /v1/videos takes "
                "multipart/form-data with an input_reference file (a JSON body, which "
                "cannot carry one, is a 400)."
            )
    elif output_kind == "text":
        description += (
            " /v1/images/generations and /v1/images/edits answer 400 here (this pipeline "
            "makes no images), so they are not listed."
        )
    elif output_kind == "speech":
        description += (
            " Only chat completions reach its thinker (they carry its input_audio parts and "
            "ask for audio with modalities and audio): /v1/completions, /tokenize, "
            "/detokenize and the image paths answer 400 here, so they are not listed."
        )
    else:
        description += (
            " /v1/completions, /tokenize and /detokenize answer 400 here (this pipeline "
            "answers with images), so they are not listed."
        )
        if not takes_image:
            description += (
                " Nor is /v1/images/edits: this pipeline's model family takes no input "
                "image (a request with one is a 400)."
            )
        if requires_image:
            description += (
                " Nor is /v1/images/generations: this pipeline edits an input image and "
                "makes none from text alone (a request there is a 400)."
            )
    components: dict[str, Any] = {"schemas": schemas}
    if open_paths is not None:
        components["securitySchemes"] = {
            "apiKey": {
                "type": "http",
                "scheme": "bearer",
                "description": "One of the router's API keys: Authorization: Bearer <key>.",
            }
        }
        for path, operations in paths.items():
            if path in open_paths:
                continue
            for operation in operations.values():
                operation["security"] = [{"apiKey": []}]
                operation["responses"].update(_errors(401))
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": components,
    }


def _request_models(models: RequestModels) -> tuple[type[BaseModel], ...]:
    return (
        models.chat,
        CompletionRequest,
        TokenizeRequest,
        DetokenizeRequest,
        LoadLoraAdapterRequest,
        UnloadLoraAdapterRequest,
        models.images,
        models.edits,
        VideoCreateRequest,
    )


def _video_form(fields: dict[str, Any]) -> dict[str, Any]:
    """POST /v1/videos' multipart form (what OpenAI's client sends): VideoCreateRequest's
    fields and the optional input_reference image file."""
    properties = {
        "input_reference": {
            "type": "string",
            "format": "binary",
            "description": "An image file to start the clip from (image-to-video).",
        },
        **{name: _form_field(schema) for name, schema in fields["properties"].items()},
    }
    # A form field is text: seconds' "4" reads the same whichever JSON type it came from.
    seconds = properties["seconds"]
    properties["seconds"] = {
        "anyOf": [{k: v for k, v in seconds.items() if k != "description"}, {"type": "number"}],
        "description": seconds.get("description", "The clip's length in seconds."),
    }
    return {
        "type": "object",
        "properties": properties,
        "required": fields.get("required", []),
        "additionalProperties": False,
    }


def _narrow_video(schema: dict[str, Any], model_name: str, limits: RouterLimits) -> None:
    properties = schema["properties"]
    _set(properties["model"], enum=[model_name])
    _set(properties["size"], pattern=_size_pattern(limits.max_image_side))
    # A positive decimal: a nonzero digit before the point, or after it.
    _set(
        properties["seconds"],
        pattern=r"^([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)$",
    )
    _set(properties["prompt"], maxLength=limits.max_prompt_chars)
    _set(properties["num_inference_steps"], maximum=limits.max_steps)
    _set(properties["num_frames"], maximum=limits.max_video_frames)


def _size_from_image(size: dict[str, Any]) -> None:
    """A video ``size`` of a pipeline that sizes its clip from its input image: ``auto``
    alone (any WIDTHxHEIGHT is a 400)."""
    branches = [b for b in size.get("anyOf", []) if b.get("type") != "null"]
    branch = branches[0] if branches else size
    branch.pop("pattern", None)
    branch["enum"] = ["auto"]
    size["description"] = (
        "auto alone: the clip's size is the size bucket nearest the input image's aspect "
        "ratio, at the checkpoint's resolution."
    )


def _video_paths(*, json_body: bool = True) -> dict[str, Any]:
    """The Videos API's paths; ``json_body``: POST /v1/videos takes a JSON body beside the
    form (not where every clip needs an input_reference file)."""
    job = {"name": "video_id", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "/v1/videos": {
            "post": {
                "summary": "Create a video job",
                "operationId": "createVideo",
                "requestBody": {
                    "required": True,
                    "content": {
                        "multipart/form-data": {"schema": _ref("VideoCreateForm")},
                        **(_json("VideoCreateRequest") if json_body else {}),
                    },
                },
                "responses": {
                    "200": {"description": "The job, queued.", "content": _json("Video")},
                    **_errors(400, 401, 404, 413, 415, 429, 500, 503),
                },
            },
            "get": {
                "summary": "List video jobs",
                "operationId": "listVideos",
                "parameters": [
                    {"name": "after", "in": "query", "schema": {"type": "string"}},
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 1, "maximum": 100},
                    },
                    {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
                ],
                "responses": {
                    "200": {"description": "A page of jobs.", "content": _json("VideoList")},
                    **_errors(400, 401, 404, 500, 503),
                },
            },
        },
        "/v1/videos/{video_id}": {
            "get": {
                "summary": "Retrieve a video job",
                "operationId": "retrieveVideo",
                "parameters": [job],
                "responses": {
                    "200": {"description": "The job.", "content": _json("Video")},
                    **_errors(401, 404, 500, 503),
                },
            },
            "delete": {
                "summary": "Delete a video job (aborting it if it runs) and its clip",
                "operationId": "deleteVideo",
                "parameters": [job],
                "responses": {
                    "200": {"description": "Deleted.", "content": _json("VideoDeleted")},
                    **_errors(401, 404, 500, 503),
                },
            },
        },
        "/v1/videos/{video_id}/content": {
            "get": {
                "summary": "Download a completed job's clip (MP4, H.264)",
                "operationId": "downloadVideoContent",
                "parameters": [
                    job,
                    {"name": "variant", "in": "query", "schema": {"enum": ["video"]}},
                ],
                "responses": {
                    "200": {
                        "description": "The clip.",
                        "content": {
                            "video/mp4": {"schema": {"type": "string", "format": "binary"}}
                        },
                    },
                    **_errors(400, 401, 404, 409, 500, 503),
                },
            }
        },
    }


def _narrow_requests(
    schemas: dict[str, Any],
    model_name: str,
    output_kind: OutputKind,
    limits: RouterLimits,
    models: RequestModels,
    takes_image: bool,
) -> None:
    """Write the deployment's facts into the request schemas: the one model name, the
    limits, and what this pipeline's output (and its input, ``takes_image``) allows."""
    chat = schemas["ChatCompletionRequest"]["properties"]
    _set(chat["model"], enum=[model_name])
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        _set(chat[name], maximum=limits.max_tokens)
    prompt = {"maxLength": limits.max_prompt_chars}
    _set(schemas["ChatMessage"]["properties"]["content"]["anyOf"][0], **prompt)
    _set(schemas["TextPart"]["properties"]["text"], **prompt)
    if output_kind == "image":
        for name in ("height", "width"):
            _set(chat[name], maximum=limits.max_image_side)
        _set(chat["num_inference_steps"], maximum=limits.max_steps)
        _set(chat["n"], maximum=limits.max_n)
        # An image answer comes whole (the image endpoints stream partials).
        _set(chat["stream"], enum=[False])
        # Images are asked for explicitly, as vLLM-Omni's API asks for them.
        chat["modalities"] = {
            "type": "array",
            "items": {"enum": ["text", "image"], "type": "string"},
            "contains": {"const": "image"},
            "description": 'Must include "image": this pipeline answers with images.',
        }
        schemas["ChatCompletionRequest"]["required"].append("modalities")
    else:
        # A text pipeline refuses what only images use, and makes one completion.
        for name in models.chat.image_only_fields():
            del chat[name]
        _set(chat["n"], enum=[1])
        spoken = ["text", "audio"] if output_kind == "speech" else ["text"]
        _set(chat["modalities"], items={"enum": spoken, "type": "string"})
    content = schemas["ChatMessage"]["properties"]["content"]["anyOf"][1]
    if output_kind == "speech":
        # A message's parts are text and audio.
        content["items"] = {
            "oneOf": [_ref("TextPart"), _ref("InputAudioPart")],
            "discriminator": {
                "propertyName": "type",
                "mapping": {
                    "text": _REF.format(model="TextPart"),
                    "input_audio": _REF.format(model="InputAudioPart"),
                },
            },
        }
        audio = schemas["AudioOutput"]["properties"]
        speech = models.chat.speech
        if speech is not None:
            _set(audio["voice"], enum=list(speech.voices))
        _set(audio["format"], enum=list(audio_codec.AUDIO_FORMATS))
    else:
        # Only a pipeline that speaks takes audio, in or out.
        del chat["audio"]
        schemas.pop("InputAudioPart", None)
        schemas.pop("InputAudio", None)
        schemas.pop("AudioOutput", None)
        if not takes_image:
            # A message's parts are text.
            content["items"] = {"$ref": _REF.format(model="TextPart")}
        else:
            content["items"] = {
                "oneOf": [_ref("TextPart"), _ref("ImagePart")],
                "discriminator": {
                    "propertyName": "type",
                    "mapping": {
                        "text": _REF.format(model="TextPart"),
                        "image_url": _REF.format(model="ImagePart"),
                    },
                },
            }
    completion = schemas["CompletionRequest"]["properties"]
    _set(completion["model"], enum=[model_name])
    _set(completion["max_tokens"], maximum=limits.max_tokens)
    _set(completion["min_tokens"], maximum=limits.max_tokens)
    _set(completion["n"], enum=[1])
    # The off values alone (the router takes them as clients send them).
    _set(completion["echo"], enum=[False])
    completion["logprobs"] = {"type": "null", "default": None}
    completion["suffix"] = {"type": "null", "default": None}
    prompts = completion["prompt"]["anyOf"]
    _set(prompts[0], maxLength=limits.max_prompt_chars)
    _set(prompts[1]["items"], maxLength=limits.max_prompt_chars)
    tokenize = schemas["TokenizeRequest"]["properties"]
    _set(tokenize["model"], enum=[model_name])
    _set(tokenize["prompt"], maxLength=limits.max_prompt_chars)
    detokenize = schemas["DetokenizeRequest"]["properties"]
    _set(detokenize["model"], enum=[model_name])
    _set(detokenize["tokens"], maxItems=limits.max_prompt_chars)
    for name in ("ImageGenerationRequest", "ImageEditRequest"):
        fields = schemas[name]["properties"]
        _set(fields["model"], enum=[model_name])
        _set(fields["prompt"], maxLength=limits.max_prompt_chars)
        _set(fields["n"], maximum=limits.max_n)
        _set(fields["num_inference_steps"], maximum=limits.max_steps)
        _set(fields["response_format"], enum=["b64_json"])
        _set(fields["size"], pattern=_size_pattern(limits.max_image_side))


def _set(schema: dict[str, Any], **keywords: Any) -> None:
    """Add ``keywords`` to a property's schema: to its non-null branch if it is optional."""
    branches = [b for b in schema.get("anyOf", []) if b.get("type") != "null"]
    (branches[0] if branches else schema).update(keywords)


def _size_pattern(max_side: int) -> str:
    """``auto`` or WIDTHxHEIGHT, each side from 1 to ``max_side``, as a regex."""
    return f"^(auto|{_up_to(max_side)}x{_up_to(max_side)})$"


def _up_to(limit: int) -> str:
    """A regex of the decimal integers 1..limit (no leading zeros)."""
    digits = str(limit)
    alternatives = []
    # Shorter numbers than the limit: any.
    for length in range(1, len(digits)):
        alternatives.append("[1-9]" + "[0-9]" * (length - 1))
    # Numbers as long as the limit: a prefix of it, then a smaller digit, then any.
    for position, digit in enumerate(digits):
        low = "1" if position == 0 else "0"
        if int(digit) > int(low):
            smaller = f"[{low}-{int(digit) - 1}]"
            alternatives.append(
                digits[:position] + smaller + "[0-9]" * (len(digits) - position - 1)
            )
    alternatives.append(digits)
    return "(" + "|".join(alternatives) + ")"


def _form_field(schema: dict[str, Any]) -> dict[str, Any]:
    """A body field's schema as a form field's: a form has no null (a field left out takes
    its default; the text "null" is no number), so an optional field's null branch goes."""
    branches = [b for b in schema.get("anyOf", []) if b.get("type") != "null"]
    if not branches or len(branches) == len(schema.get("anyOf", [])):
        return schema
    field = {k: v for k, v in schema.items() if k not in ("anyOf", "default")}
    if len(branches) == 1:
        return {**branches[0], **field}
    return {**field, "anyOf": branches}


def _edit_form(fields: dict[str, Any], left_out: set[str], max_images: int) -> dict[str, Any]:
    """/v1/images/edits' multipart form: the image file (or, where the pipeline takes
    several, ``image[]`` files, up to ``max_images``) and ImageEditRequest's fields but
    ``left_out``."""
    binary = {"type": "string", "format": "binary"}
    images: dict[str, Any] = {
        "image": {**binary, "description": "The input image file (PNG, JPEG, WebP, ...)."}
    }
    form: dict[str, Any] = {"required": ["image", *fields.get("required", [])]}
    if max_images > 1:
        images["image[]"] = {
            "type": "array",
            "items": binary,
            "maxItems": max_images,
            "description": f"The input image files, 1 to {max_images}, in the order the "
            "prompt numbers them (picture 1, picture 2, ...); instead of image.",
        }
        # One spelling or the other. A form has no empty list (image[] with no file is no
        # part at all), so the rules count image[]'s files rather than ask if it is there.
        form = {
            "required": fields.get("required", []),
            "oneOf": [
                {"required": ["image"], "properties": {"image[]": {"maxItems": 0}}},
                {
                    "required": ["image[]"],
                    "properties": {"image[]": {"minItems": 1}, "image": False},
                },
            ],
        }
    properties = {
        **images,
        **{
            name: _form_field(schema)
            for name, schema in fields["properties"].items()
            if name not in left_out
        },
    }
    return {
        "type": "object",
        "properties": properties,
        **form,
        "additionalProperties": False,
        "description": fields.get("description", ""),
    }


# -- operations -----------------------------------------------------------------------------


def _ref(model: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=model)}


def _json(model: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _errors(*statuses: int) -> dict[str, Any]:
    responses: dict[str, Any] = {}
    for status in statuses:
        response: dict[str, Any] = {
            "description": _ERRORS[status],
            "content": _json("ErrorResponse"),
        }
        if status == 429:
            response["headers"] = {
                "Retry-After": {
                    "description": "Seconds to wait before retrying.",
                    "schema": {"type": "integer", "minimum": 1},
                }
            }
        responses[str(status)] = response
    return responses


def _chat_operation(output_kind: OutputKind) -> dict[str, Any]:
    content: dict[str, Any] = _json("ChatCompletion")
    if output_kind in ("text", "speech"):
        # OpenAPI 3.1 reads an event stream's schema as that of each event.
        content["text/event-stream"] = {
            "schema": {
                "type": "object",
                "required": ["data"],
                "properties": {
                    "data": {
                        "description": "With stream: true, one event per delta (a "
                        "chat.completion.chunk), an error object if the request fails after "
                        "the stream started, then [DONE].",
                        "anyOf": [
                            {"const": "[DONE]"},
                            {
                                "type": "string",
                                "contentMediaType": "application/json",
                                "contentSchema": {
                                    "anyOf": [_ref("ChatCompletionChunk"), _ref("ErrorResponse")]
                                },
                            },
                        ],
                    }
                },
            }
        }
    return {
        "summary": "Create a chat completion",
        "operationId": "createChatCompletion",
        "requestBody": {"required": True, "content": _json("ChatCompletionRequest")},
        "responses": {
            "200": {"description": "The completion (or its stream).", "content": content},
            **_errors(*_POST_ERRORS),
        },
    }


def _completions_operation() -> dict[str, Any]:
    stream = {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {
                    "description": "With stream: true, one event per new text (a "
                    "text_completion), an error object if the request fails after the "
                    "stream started, then [DONE].",
                    "anyOf": [
                        {"const": "[DONE]"},
                        {
                            "type": "string",
                            "contentMediaType": "application/json",
                            "contentSchema": {"anyOf": [_ref("Completion"), _ref("ErrorResponse")]},
                        },
                    ],
                }
            },
        }
    }
    return {
        "summary": "Continue a text prompt (no chat template)",
        "operationId": "createCompletion",
        "requestBody": {"required": True, "content": _json("CompletionRequest")},
        "responses": {
            "200": {
                "description": "The completion (or its stream).",
                "content": {**_json("Completion"), "text/event-stream": stream},
            },
            **_errors(*_POST_ERRORS),
        },
    }


def _adapter_operation(method: Literal["load", "unload"]) -> dict[str, Any]:
    summary = {
        "load": "Serve a LoRA adapter from now on (vLLM's API): each replica of its stage "
        "loads it on first use. In this router's memory only: declare a cluster's adapters "
        "in the pipeline (spec.adapters).",
        "unload": "Stop serving a LoRA adapter added at run time (vLLM's API).",
    }[method]
    return {
        "summary": summary,
        "operationId": f"{method}LoraAdapter",
        "requestBody": {
            "required": True,
            "content": _json(f"{method.capitalize()}LoraAdapterRequest"),
        },
        "responses": {
            "200": {
                "description": "Done.",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **_errors(400, 401, 404, 413, 415),
        },
    }


def _tokenizer_operation(method: Literal["tokenize", "detokenize"]) -> dict[str, Any]:
    model = method.capitalize()
    summary = {
        "tokenize": "Token ids of a prompt, or of a conversation through the chat template",
        "detokenize": "Token ids as text",
    }[method]
    return {
        "summary": summary + " (vLLM's API; the pipeline's first stage's tokenizer)",
        "operationId": method,
        "requestBody": {"required": True, "content": _json(f"{model}Request")},
        "responses": {
            "200": {"description": summary + ".", "content": _json(f"{model}Response")},
            **_errors(*_POST_ERRORS),
        },
    }


def _image_stream() -> dict[str, Any]:
    # OpenAPI 3.1 reads an event stream's schema as that of each event.
    return {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {
                "event": {"type": "string", "description": "The event's type."},
                "data": {
                    "description": "With stream: true, one event per partial image "
                    "(partial_images), then the image; an error object if the request fails "
                    "after the stream started.",
                    "type": "string",
                    "contentMediaType": "application/json",
                    "contentSchema": {"anyOf": [_ref("ImageStreamEvent"), _ref("ErrorResponse")]},
                },
            },
        }
    }


def _images_generations() -> dict[str, Any]:
    return {
        "summary": "Create images from a prompt",
        "operationId": "createImage",
        "requestBody": {"required": True, "content": _json("ImageGenerationRequest")},
        "responses": {
            "200": {
                "description": "The images, as base64 PNGs (or their stream).",
                "content": {**_json("ImagesResponse"), "text/event-stream": _image_stream()},
            },
            **_errors(*_POST_ERRORS),
        },
    }


def _images_edits() -> dict[str, Any]:
    return {
        "summary": "Create images from an input image and a prompt",
        "operationId": "createImageEdit",
        "requestBody": {
            "required": True,
            "content": {"multipart/form-data": {"schema": _ref("ImageEditForm")}},
        },
        "responses": {
            "200": {
                "description": "The images, as base64 PNGs (or their stream).",
                "content": {**_json("ImagesResponse"), "text/event-stream": _image_stream()},
            },
            **_errors(*_POST_ERRORS),
        },
    }


def _get_paths() -> dict[str, Any]:
    return {
        "/v1/models": {
            "get": {
                "summary": "List the served model",
                "operationId": "listModels",
                "responses": {
                    "200": {"description": "The one model served.", "content": _json("ModelList")},
                    **_errors(401),
                },
            }
        },
        "/health": {
            "get": {
                "summary": "Readiness",
                "operationId": "health",
                "responses": {
                    "200": {
                        "description": "Some pipeline revision has a live replica of every stage.",
                        "content": _json("Health"),
                    },
                    "503": {
                        "description": "Nothing can be served; says why.",
                        "content": _json("Health"),
                    },
                },
            }
        },
        "/livez": {
            "get": {
                "summary": "Liveness",
                "operationId": "livez",
                "responses": {
                    "200": {"description": "The process serves.", "content": _json("Liveness")}
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "operationId": "metrics",
                "responses": {
                    "200": {
                        "description": "Prometheus' text exposition format.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
    }
