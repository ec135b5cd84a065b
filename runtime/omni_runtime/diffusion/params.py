"""The parameters a diffusion request may carry (``params`` on the wire), and the checks
every diffusion engine runs on a request before any compute.

What every image request takes (size, steps, guidance scale, seed, ...) is declared here,
once per kind of engine (:class:`DiffusionParams` for diffusers pipelines; BAGEL's engine
has its own). What a family's DiT takes beyond that is the family's ``request_fields``
(``omni_runtime.families``): :func:`with_fields` turns them into fields of the engine's
parameter set with the bounds they declare, so that the router's bodies and the DiT's
checks come from one declaration.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar, Union, cast

import msgspec

from omni_runtime.engine.stage.stage_core_types import (
    MAX_PARTIAL_IMAGES,
    InvalidStageRequestError,
    StageDiffusionCoreRequest,
)
from omni_runtime.families import familyless_request_fields
from omni_runtime.families.base import Family, RequestField

MAX_SIDE = 4096
MAX_IMAGES = 16
# A video's frames: Wan2.2's and HunyuanVideo-1.5's pipelines make 121 (5 s at 24 fps); a
# bound keeps one request from asking the DiT for hours of work.
MAX_FRAMES = 1024


class InvalidRequestError(InvalidStageRequestError):
    """A request the diffusion engine refuses."""


class DiffusionParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The sampling parameters every request to a diffusers pipeline may carry; the
    engine's parameter set adds its family's own (:func:`diffusers_params`).

    None (or left out) is the loaded pipeline's own default, as its ``__call__`` has it;
    a parameter the pipeline does not take is refused by name."""

    height: Annotated[int, msgspec.Meta(ge=1, le=MAX_SIDE)] | None = None
    width: Annotated[int, msgspec.Meta(ge=1, le=MAX_SIDE)] | None = None
    num_inference_steps: Annotated[int, msgspec.Meta(ge=1, le=1000)] | None = None
    guidance_scale: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    negative_prompt: str | None = None
    num_images: Annotated[int, msgspec.Meta(ge=1, le=MAX_IMAGES)] = 1
    # Image-to-image only: how far from the input image to go (1.0 ignores it).
    strength: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    # The stage's step-cache tier to run with ("off": every step computed).
    step_cache: str | None = None
    # Partial images to send while the request runs (its stream's).
    partial_images: Annotated[int, msgspec.Meta(ge=0, le=MAX_PARTIAL_IMAGES)] | None = None
    # A video pipeline's frames.
    num_frames: Annotated[int, msgspec.Meta(ge=1, le=MAX_FRAMES)] | None = None
    # Send the share of steps done as the request runs (outputs with ``progress``): what a
    # video job's status reports.
    report_progress: bool | None = None


# The common parameters passed to a pipeline's __call__ under their own name when set; a
# family's own fields are too.
CALL_PARAMS = ("num_inference_steps", "guidance_scale", "strength", "num_frames")

_S = TypeVar("_S", bound=msgspec.Struct)


def family_fields(family: Family | None) -> tuple[RequestField, ...]:
    """The request fields a diffusers pipeline of ``family`` takes beyond the common ones;
    a pipeline of no family takes every such family's (each refused by name where its
    ``__call__`` lacks it)."""
    return family.request_fields if family is not None else familyless_request_fields()


def diffusers_params(family: Family | None) -> type[DiffusionParams]:
    """The parameter set of a diffusers pipeline of ``family``."""
    return with_fields(DiffusionParams, family_fields(family))


def with_fields(base: type[_S], fields: Sequence[RequestField]) -> type[_S]:
    """``base`` with ``fields`` added, each optional (None: the pipeline's own default),
    under ``base``'s name, so that an error lists the same names either way."""
    if not fields:
        return base
    added = [(field.name, Union[field_type(field), None], None) for field in fields]  # noqa: UP007
    struct = msgspec.defstruct(
        base.__name__,
        added,
        bases=(base,),
        module=base.__module__,
        kw_only=True,
        forbid_unknown_fields=True,
    )
    return cast(type[_S], struct)


def field_type(field: RequestField) -> Any:
    """The msgspec type of a family's request field, with the bounds it declares."""
    bounds = {
        name: value
        for name in ("ge", "gt", "le", "lt")
        if (value := getattr(field, name)) is not None
    }
    number: Any = Annotated[float, msgspec.Meta(**bounds)] if bounds else float
    match field.kind:
        case "number":
            return number
        case "integer":
            return Annotated[int, msgspec.Meta(**bounds)] if bounds else int
        case "boolean":
            return bool
        case "enum":
            literal: Any = Literal
            return literal[field.values]
        case "number_pair":
            return tuple[number, number]


def parse_params(params: dict[str, Any], where: str, struct: type[_S]) -> _S:
    """``params`` as ``struct`` (an engine's parameter set); InvalidRequestError naming
    the field that is wrong, and for an unknown one, the names allowed."""
    try:
        return msgspec.convert(params, struct)
    except msgspec.ValidationError as e:
        # An unknown field is named in the text alone ("Object contains unknown field
        # `foo`"); the list of allowed ones is what the caller needs to fix it.
        unknown = re.fullmatch(r"Object contains unknown field `(.+)`", str(e))
        if unknown:
            name = unknown.group(1)
            allowed = ", ".join(struct.__struct_fields__)
            raise InvalidRequestError(
                f"{where}.{name}: unknown parameter (allowed: {allowed})", name
            ) from None
        raise InvalidRequestError.from_validation(e, where) from None


def check_input_names(request: StageDiffusionCoreRequest, takes: tuple[str, ...]) -> None:
    """InvalidRequestError naming an input of ``request`` that the engine does not take."""
    unknown = set(request.inputs) - set(takes)
    if unknown:
        name = min(unknown)
        raise InvalidRequestError(
            f"inputs.{name}: not an input of this stage (it takes {', '.join(takes)})", name
        )


def check_sizes(params: Any, multiple: int, max_side: int | None = None) -> None:
    """InvalidRequestError naming ``params``' height or width if it is no multiple of
    ``multiple`` or over ``max_side``."""
    for name in ("height", "width"):
        value = getattr(params, name)
        if value is None or (value % multiple == 0 and (max_side is None or value <= max_side)):
            continue
        at_most = f" and at most {max_side}" if max_side is not None else ""
        raise InvalidRequestError(
            f"{name}: must be a multiple of {multiple}{at_most} for this model (got {value})",
            name,
        )
