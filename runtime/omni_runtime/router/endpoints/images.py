"""POST /v1/images/generations (a JSON body) and /v1/images/edits (OpenAI's multipart
form: image, prompt, n, size, ...; image-to-image diffusion): b64_json images, or with
``stream`` OpenAI's image stream (partial images as events, then the images).

The bodies hold the common fields; a deployment's take its family's too
(``router.endpoints.bodies``). Images are PNG- and base64-encoded in a worker thread: a
1024x1024 PNG takes tens of milliseconds, which on the event loop would hold up every other
request's tokens.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, StrictBool

from omni_runtime.engine.stage.stage_core_types import MAX_PARTIAL_IMAGES, StageServerOutput
from omni_runtime.images import encode_png
from omni_runtime.router.body import Integer, NonNegativeFloat, Positive, Seed
from omni_runtime.router.errors import POST_ERRORS, RequestError, error_body, error_responses
from omni_runtime.router.json_body import parse_body, read_json
from omni_runtime.router.limits import RouterLimits, check_common, parse_size
from omni_runtime.router.media import decode_input_image
from omni_runtime.router.multipart import FileParts, MultipartForm, read_form
from omni_runtime.router.orchestrator import PipelineError
from omni_runtime.router.request_fields import FamilyFields
from omni_runtime.router.responses import JSONBody, StreamWithCleanup, png_base64, sse
from omni_runtime.router.route_docs import form_request, json_request
from omni_runtime.router.served import EDITS, GENERATIONS
from omni_runtime.router.serving import OpenAIServing
from omni_runtime.router.stage_requests import PipelineRequest

# The form's image parts: "image" as the openai client sends one file, "image[]" as it
# sends a list (of which this server takes as many as the pipeline's family allows).
IMAGE_PARTS = ("image", "image[]")


class ImageRequest(FamilyFields):
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

    def image_params(self, limits: RouterLimits, **more: Any) -> dict[str, Any]:
        """The diffusion stage's params for these images (``more``: those of one path);
        RequestError naming the field over a limit."""
        if self.response_format != "b64_json":
            raise RequestError(
                400,
                "response_format: only 'b64_json' is supported (images come back in the "
                f"response; this server keeps no files to link to); got {self.response_format!r}",
                param="response_format",
            )
        check_common(limits, len(self.prompt), self.n, self.num_inference_steps, "prompt")
        self.check_supported()
        height, width = parse_size(self.size, limits)
        # Partial images are events of a stream: without one, the answer is the images alone.
        if self.stream and self.partial_images and self.makes_partial_images:
            # A DiT that makes none is asked for none: the stream has the image alone, as
            # OpenAI's API allows (fewer partials than asked for).
            more["partial_images"] = self.partial_images
        return self.diffusion_params(height=height, width=width, **more)

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


class ImageGenerationRequest(ImageRequest):
    """POST /v1/images/generations (a JSON body)."""

    # No pipeline's generations take an input image, nor an edit's fields.
    takes_edit_fields: ClassVar[bool] = False

    def to_pipeline_request(self, request_id: str, limits: RouterLimits) -> PipelineRequest:
        """The pipeline request for these images; RequestError naming the field over a
        limit."""
        return self._pipeline_request(request_id, self.image_params(limits))


class ImageEditRequest(ImageRequest):
    """POST /v1/images/edits: the form's fields (the images travel beside, as bytes)."""

    def to_pipeline_request(
        self, request_id: str, limits: RouterLimits, images: Sequence[bytes]
    ) -> PipelineRequest:
        """The pipeline request that edits ``images`` (PNG/JPEG/... files' bytes, as many
        as the form may carry), decoded last, once every field has passed; RequestError
        naming the field otherwise. The decode takes milliseconds: call this off the event
        loop."""
        params = self.image_params(limits)
        return self._pipeline_request(
            request_id, params, [decode_input_image(image, limits, "image") for image in images]
        )


def edit_form(
    content_type: str, limits: RouterLimits, model: type[ImageEditRequest]
) -> MultipartForm:
    """The parser of an edit's form: ``model``'s fields, and as many images as it takes."""
    return MultipartForm(content_type, limits, model, _image_parts(model))


def _image_parts(model: type[ImageEditRequest]) -> FileParts:
    return FileParts(IMAGE_PARTS, "image", model.max_input_images, required=True)


# -- answers (built as plain dicts; these document them) -------------------------------------


class ImageData(BaseModel):
    b64_json: str = Field(description="A PNG file, base64-encoded.")
    revised_prompt: str | None = Field(
        default=None,
        description="The text the pipeline wrote before drawing (a thinking encoder's "
        "plan, or the prompt an LLM stage wrote for the DiT); absent where it wrote none.",
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


# OpenAPI 3.1 reads an event stream's schema as that of each event.
_IMAGE_STREAM = {
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
                "contentSchema": {
                    "anyOf": [
                        {"$ref": "#/components/schemas/ImageStreamEvent"},
                        {"$ref": "#/components/schemas/ErrorResponse"},
                    ]
                },
            },
        },
    }
}


# -- serving ---------------------------------------------------------------------------------


def routes(
    serving: OpenAIServing,
    generations: type[ImageGenerationRequest],
    edits: type[ImageEditRequest],
) -> APIRouter:
    """The images room's routes, taking the deployment's bodies (with its family's fields)."""
    router = APIRouter()
    served = serving.served
    answers = {
        200: {"content": {"text/event-stream": _IMAGE_STREAM}},
        **error_responses(*POST_ERRORS),
    }

    @router.post(
        GENERATIONS,
        summary="Create images from a prompt",
        operation_id="createImage",
        response_model=ImagesResponse,
        response_description="The images, as base64 PNGs (or their stream).",
        responses=answers,
        openapi_extra=json_request("ImageGenerationRequest"),
        include_in_schema=served.serves(GENERATIONS),
    )
    async def images_generations(request: Request) -> Response:
        body = parse_body(generations, await read_json(request, serving.limits))
        # An edit pipeline's refusal names the image it lacks.
        served.require(GENERATIONS, "image" if served.requires_image else None)
        serving.pick_adapters(body.model, body)
        pipeline_request = body.to_pipeline_request(f"img-{uuid.uuid4().hex}", serving.limits)
        pipeline_request.adapters = serving.pick_adapters(body.model, body, pipeline_request)
        if body.stream:
            return await _stream_images(serving, pipeline_request, "image_generation")
        return await _images_response(serving, pipeline_request, request)

    @router.post(
        EDITS,
        summary="Create images from an input image and a prompt",
        operation_id="createImageEdit",
        response_model=ImagesResponse,
        response_description="The images, as base64 PNGs (or their stream).",
        responses=answers,
        openapi_extra=form_request("ImageEditForm"),
        include_in_schema=served.serves(EDITS),
    )
    async def images_edits(request: Request) -> Response:
        form = await read_form(request, serving.limits, edits, _image_parts(edits))
        body, images = form.finish()
        served.require(EDITS, "image")
        serving.pick_adapters(body.model, body)
        # Decoding the image (PIL) takes milliseconds: not on the event loop.
        pipeline_request = await asyncio.to_thread(
            body.to_pipeline_request, f"img-{uuid.uuid4().hex}", serving.limits, images
        )
        pipeline_request.adapters = serving.pick_adapters(body.model, body, pipeline_request)
        if body.stream:
            return await _stream_images(serving, pipeline_request, "image_edit")
        return await _images_response(serving, pipeline_request, request)

    return router


async def _images_response(
    serving: OpenAIServing, request: PipelineRequest, http: Request
) -> Response:
    outputs = await serving.run_to_end(request, http)
    final = outputs[-1]
    encoded = await asyncio.to_thread(png_base64, final.images)
    # OpenAI's field for the prompt the model actually drew from: BAGEL's plan.
    revised = {"revised_prompt": final.text} if final.text else {}
    data = [{"b64_json": b64, **revised} for b64 in encoded]
    return JSONBody({"created": int(time.time()), "data": data})


async def _stream_images(serving: OpenAIServing, request: PipelineRequest, kind: str) -> Response:
    """OpenAI's image stream: a ``<kind>.partial_image`` event per partial image, then
    ``<kind>.completed`` with the image (the same bytes as without streaming). A client
    that goes away ends the response, which aborts the request in every stage."""
    first, outputs, release = await serving.open_stream(request)

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
            yield sse(error_body(e.status, e.message, kind=e.kind, param=e.param))
        finally:
            await release()

    return StreamWithCleanup(events(), release)


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
        frames.append(b"event: " + event.encode() + b"\n" + sse(payload))
    return b"".join(frames)
