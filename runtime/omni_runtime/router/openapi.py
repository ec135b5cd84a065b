"""The router's OpenAPI document (GET /openapi.json): FastAPI's, from the routes, narrowed
to this deployment.

Each endpoint's room declares its routes with their answers' models (``response_model``),
their error statuses (``responses``, each an ``ErrorResponse``) and their request bodies;
FastAPI generates the paths, the operations and the answers' schemas from them, and lists
only the paths that serve this pipeline (``include_in_schema``; the others answer 400,
saying where to go). The handlers read raw bodies, so that the size limits hold while a
body streams in: FastAPI sees no body parameter, so a route names its body's schema
(``route_docs``) and this module adds the request models' schemas, as pydantic generates
them.

What no route declaration can say is the deployment's: the served model's name, the
``RouterLimits`` in force, the pipeline's outputs and its model family (whose own fields its
image bodies take, and no other family's; the multipart forms' fields, spelled as text), and
the API keys (a bearer scheme on every guarded path). The narrowing pass below writes them
into the schemas, so that a request valid by the schema is one the router takes (a fuzzer
in positive mode relies on it) and one outside it is refused with a 4xx. Two limits no JSON
schema can state stay in the descriptions: the prompt limit is on all messages together,
and a prompt must also fit the first stage's context in tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import BaseRoute

from omni_runtime import audio as audio_codec
from omni_runtime.families import Family
from omni_runtime.router.endpoints.bodies import RequestModels
from omni_runtime.router.endpoints.chat import ChatCompletionRequest
from omni_runtime.router.errors import ErrorResponse, error_responses
from omni_runtime.router.limits import RouterLimits
from omni_runtime.router.route_docs import ref as _ref
from omni_runtime.router.served import VIDEOS, Served

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{model}"


def openapi_document(
    *,
    title: str,
    version: str,
    routes: Sequence[BaseRoute],
    bodies: RequestModels,
    unseen: Sequence[type[BaseModel]],
    model_name: str,
    served: Served,
    limits: RouterLimits,
    family: Family | None = None,
    open_paths: frozenset[str] | None = None,
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the ``routes`` of a router serving ``model_name``, whose
    pipeline serves ``served``, within ``limits``, and is of ``family`` (None: of none),
    with the schemas of the models its routes name but FastAPI does not see: ``bodies``
    (those with the family's fields) and ``unseen`` (the other bodies, and the events of
    streams); with API keys, every path but ``open_paths`` needs one (a bearer security
    scheme)."""
    document = get_openapi(
        title=title,
        version=version,
        openapi_version=OPENAPI_VERSION,
        description=_description(model_name, served),
        routes=routes,
        # Validation mode for the answers too: a field with a default is one an answer may
        # leave out.
        separate_input_output_schemas=False,
    )
    # The errors' schema too, which the routes name (errors.error_responses).
    documented: list[type[BaseModel]] = [
        bodies.chat,
        bodies.images,
        bodies.edits,
        *unseen,
        ErrorResponse,
    ]
    _, top = models_json_schema([(model, "validation") for model in documented], ref_template=_REF)
    schemas: dict[str, Any] = document.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in copy.deepcopy(top["$defs"]).items():
        schemas.setdefault(name, schema)
    _narrow(schemas, model_name, served, limits, bodies, family)
    if open_paths is not None:
        _require_keys(document, open_paths)
    document["components"] = {
        key: dict(sorted(value.items())) if key == "schemas" else value
        for key, value in document["components"].items()
    }
    return document


def _description(model_name: str, served: Served) -> str:
    description = (
        f"Serves the model {model_name!r}, a pipeline that {served.makes}: {served.where}. "
        'Errors are OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`); '
        "unknown paths answer 404 and other methods 405 in the same shape. The API's paths "
        "for other kinds of pipeline answer 400 here, saying where this one's requests go, "
        "so they are not listed."
    )
    if served.output == "video" and served.requires_image:
        description += (
            f" Each clip starts from an input image: POST {VIDEOS} takes multipart/form-data "
            "with an input_reference file (a JSON body, which cannot carry one, is a 400)."
        )
    return description


def _require_keys(document: dict[str, Any], open_paths: frozenset[str]) -> None:
    document["components"]["securitySchemes"] = {
        "apiKey": {
            "type": "http",
            "scheme": "bearer",
            "description": "One of the router's API keys: Authorization: Bearer <key>.",
        }
    }
    unauthorized = {str(status): answer for status, answer in error_responses(401).items()}
    for path, operations in document["paths"].items():
        if path in open_paths:
            continue
        for operation in operations.values():
            operation["security"] = [{"apiKey": []}]
            operation["responses"].update(copy.deepcopy(unauthorized))


def _narrow(
    schemas: dict[str, Any],
    model_name: str,
    served: Served,
    limits: RouterLimits,
    bodies: RequestModels,
    family: Family | None,
) -> None:
    """Write the deployment's facts into the request schemas, and the forms' schemas,
    which are the bodies' fields spelled as form fields."""
    requires_image = served.output == "image" and served.requires_image
    chat_model = bodies.chat
    _narrow_requests(schemas, model_name, served, limits, chat_model)
    if requires_image:
        # An edit pipeline's chat completion carries the image it edits.
        messages = schemas["ChatCompletionRequest"]["properties"]["messages"]
        messages["contains"] = {
            "type": "object",
            "properties": {"content": {"type": "array", "contains": _ref("ImagePart")}},
            "required": ["content"],
        }
        messages["description"] = "At least one holds the image to edit (an image_url part)."
    for name in ("ChatCompletionRequest", "ImageGenerationRequest", "ImageEditRequest"):
        # Common fields the family's DiT does not take: refused by name.
        for field in chat_model.unsupported_fields:
            schemas[name]["properties"].pop(field, None)
    # A form field is text: a pair of numbers has no spelling there.
    pairs = {
        field.name for field in (*bodies.fields, *bodies.edit_fields) if field.kind == "number_pair"
    }
    schemas["ImageEditForm"] = _edit_form(
        schemas["ImageEditRequest"], pairs, chat_model.max_input_images
    )
    if served.output != "video":
        return
    form = schemas["VideoCreateForm"] = _video_form(schemas["VideoCreateRequest"])
    if not served.takes_image:
        # Text to video alone: an input_reference is refused (400).
        del form["properties"]["input_reference"]
    if served.requires_image:
        form["required"] = ["input_reference", *form["required"]]
        form["properties"]["input_reference"]["description"] = (
            "The image file the clip starts from (its first frame): required, this "
            "pipeline makes clips from an image and a prompt."
        )
    for name in ("VideoCreateRequest", "VideoCreateForm"):
        _narrow_video(schemas[name], model_name, limits)
        if family is not None and family.dit.sized_by_image:
            _size_from_image(schemas[name]["properties"]["size"])


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


def _narrow_requests(
    schemas: dict[str, Any],
    model_name: str,
    served: Served,
    limits: RouterLimits,
    chat_model: type[ChatCompletionRequest],
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
    if served.output == "image":
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
        for name in chat_model.image_only_fields():
            del chat[name]
        _set(chat["n"], enum=[1])
        spoken = ["text", "audio"] if served.output == "speech" else ["text"]
        _set(chat["modalities"], items={"enum": spoken, "type": "string"})
    content = schemas["ChatMessage"]["properties"]["content"]["anyOf"][1]
    if served.output == "speech":
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
        speech = chat_model.speech
        if speech is not None:
            _set(audio["voice"], enum=list(speech.voices))
        _set(audio["format"], enum=list(audio_codec.AUDIO_FORMATS))
    else:
        # Only a pipeline that speaks takes audio, in or out.
        del chat["audio"]
        schemas.pop("InputAudioPart", None)
        schemas.pop("InputAudio", None)
        schemas.pop("AudioOutput", None)
        if not (served.output == "image" and served.takes_image):
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
