"""The bodies one deployment parses and documents: the endpoints' models, with its model
family's request fields (``router.request_fields``)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from omni_runtime.families import Family, familyless_request_fields
from omni_runtime.families.base import RequestField
from omni_runtime.router.endpoints.chat import ChatCompletionRequest
from omni_runtime.router.endpoints.images import ImageEditRequest, ImageGenerationRequest
from omni_runtime.router.request_fields import (
    LORA_SCALE,
    STRENGTH,
    InputRules,
    step_cache_field,
    with_fields,
)


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
            (*familyless_request_fields(), *cache), (STRENGTH,), InputRules(max_images=1)
        )
    rules = InputRules(
        max_images=family.max_input_images,
        requires_image=family.dit.requires_image,
        unsupported=family.dit.unsupported_fields,
        partial_images=family.dit.preview is not None,
        speech=family.speech,
    )
    return _request_models((*family.request_fields, *cache), (), rules)


@functools.cache
def _request_models(
    fields: tuple[RequestField, ...], edit_fields: tuple[RequestField, ...], rules: InputRules
) -> RequestModels:
    return RequestModels(
        chat=with_fields(ChatCompletionRequest, fields, edit_fields, rules),
        images=with_fields(
            ImageGenerationRequest, fields, (), dataclasses.replace(rules, max_images=0)
        ),
        edits=with_fields(ImageEditRequest, fields, edit_fields, rules),
        fields=fields,
        edit_fields=edit_fields,
    )
