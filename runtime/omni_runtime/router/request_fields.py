"""The request fields a pipeline's model family adds to the bodies that make images.

A pipeline's model family declares its DiT's own fields (``Family.request_fields``:
Qwen-Image's true_cfg_scale, BAGEL's guidance, ...), and a pipeline of no family takes the
generic diffusers ones (``families.familyless_request_fields``, and an edit's strength).
The endpoints' models hold the common fields only; ``with_fields`` subclasses one with a
deployment's, so that a pipeline takes its own family's fields and refuses another's as
unknown, naming the families that take it (``unknown_field``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, Field, StrictBool, create_model

from omni_runtime.families import FAMILIES, familyless_request_fields
from omni_runtime.families.base import RequestField, SpeechRecipe
from omni_runtime.router.body import Body, Integer, Number, given
from omni_runtime.router.errors import RequestError

# The diffusion stage's params every image request spells the same way (besides its
# family's fields, also the DiT's by the same name).
DIFFUSION_FIELDS = ("num_inference_steps", "guidance_scale", "seed", "negative_prompt")


class FamilyFields(Body):
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
    # Whether the body may carry an input image, and so an edit's fields (not generations).
    takes_edit_fields: ClassVar[bool] = True

    def diffusion_params(self, **more: Any) -> dict[str, Any]:
        """The diffusion stage's params of this body: its shared fields and its family's,
        its ``n`` as num_images, and ``more`` (those its path spells its own way); unset
        ones left out."""
        shared = {name: getattr(self, name) for name in (*DIFFUSION_FIELDS, *self.family_fields)}
        return given(**shared, num_images=getattr(self, "n", 1), **more)

    def check_supported(self) -> None:
        for name in self.unsupported_fields:
            if getattr(self, name, None) is not None:
                raise RequestError(
                    400,
                    f"{name}: unknown parameter for this pipeline (its model family's DiT "
                    "does not take it)",
                    name,
                )


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


@dataclass(frozen=True)
class InputRules:
    """What a deployment's image bodies take beyond their fields: how many input images,
    whether one is required, which common fields its family's DiT refuses."""

    max_images: int
    requires_image: bool = False
    unsupported: tuple[str, ...] = ()
    partial_images: bool = False
    speech: SpeechRecipe | None = None


_Model = TypeVar("_Model", bound=FamilyFields)


def with_fields(
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
    if not issubclass(model, FamilyFields):
        return []  # no family adds to it
    takers = [
        family.name
        for family in FAMILIES.values()
        if any(field.name == name for field in family.request_fields)
    ]
    # Generations take no input image: no pipeline's take an edit's strength.
    edit = (STRENGTH,) if model.takes_edit_fields else ()
    if any(field.name == name for field in (*familyless_request_fields(), *edit)):
        takers.append("family-less")
    return takers


def unknown_field(name: str, model: type[BaseModel]) -> str:
    """Why the top-level field ``name`` of a ``model`` body is refused: not part of this
    API, or not of this pipeline (another family's field, named as such so that the caller
    knows where it belongs; "unknown parameter", as a DiT words one it does not take)."""
    if name == STEP_CACHE_FIELD and issubclass(model, FamilyFields):
        return "unknown parameter for this pipeline (its diffusion stage has no stepCache)"
    takers = _takers(name, model)
    if not takers:
        return "unknown field (not part of this API)"
    listed = ", ".join(takers[:-1]) + " and " + takers[-1] if len(takers) > 1 else takers[0]
    return f"unknown parameter for this pipeline ({listed} pipelines take it)"
