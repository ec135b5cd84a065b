"""Model families, one module each (the registry is the one place that lists them).

``base`` is the interface every family fills in; see it for what a family declares. To add a
family: write its module (its recipes, topology and rules), list it in ``FAMILIES`` and in
``FamilyName`` below, and build its tiny checkpoint in ``omni_runtime.tiny_models``
(docs/model-families.md walks through it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal, get_args

from .bagel import BAGEL
from .base import (
    Companion,
    DiTRecipe,
    EmbeddingsFamily,
    EncoderRecipe,
    Family,
    HandOffKind,
    RequestField,
    SpeechRecipe,
    SpeechRole,
    SpeechStage,
    StageView,
    TopologyStage,
    model_basename,
    prompt_image_size,
)
from .hunyuan_video import HUNYUAN_VIDEO, HUNYUAN_VIDEO_I2V
from .qwen3_omni import QWEN3_OMNI
from .qwen_image import QWEN_IMAGE, QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS
from .wan import WAN
from .z_image import Z_IMAGE

__all__ = [
    "FAMILIES",
    "FAMILY_NAMES",
    "MODEL_INDEX",
    "Companion",
    "DiTRecipe",
    "EmbeddingsFamily",
    "EncoderRecipe",
    "Family",
    "FamilyName",
    "HandOffKind",
    "SpeechRecipe",
    "SpeechRole",
    "SpeechStage",
    "StageView",
    "TopologyStage",
    "family_of_model_name",
    "family_of_pipeline_class",
    "familyless_request_fields",
    "model_basename",
    "prompt_image_size",
    "read_checkpoint_family",
]

# The pipeline schema's enum (and so the CRD's); a unit test keeps it equal to FAMILIES.
FamilyName = Literal[
    "qwen-image",
    "qwen-image-edit",
    "qwen-image-edit-plus",
    "z-image",
    "bagel",
    "wan2.2",
    "hunyuanvideo-1.5",
    "hunyuanvideo-1.5-i2v",
    "qwen3-omni",
]
FAMILY_NAMES: tuple[str, ...] = get_args(FamilyName)
FAMILIES: Mapping[str, Family] = MappingProxyType(
    {
        family.name: family
        for family in (
            QWEN_IMAGE,
            QWEN_IMAGE_EDIT,
            QWEN_IMAGE_EDIT_PLUS,
            Z_IMAGE,
            BAGEL,
            WAN,
            HUNYUAN_VIDEO,
            HUNYUAN_VIDEO_I2V,
            QWEN3_OMNI,
        )
    }
)
MODEL_INDEX = "model_index.json"


def family_of_pipeline_class(class_name: str) -> Family | None:
    """The family whose DiT runs diffusers' ``class_name``, if any."""
    for family in FAMILIES.values():
        if family.dit.pipeline_class == class_name:
            return family
    return None


def familyless_request_fields() -> tuple[RequestField, ...]:
    """What the DiT of a pipeline of no family takes beyond the common image fields: the
    fields of every family whose DiT is a diffusers pipeline (not an engine of its own),
    each handed to whichever pipeline is loaded where its __call__ takes it (FluxPipeline
    takes Qwen-Image's true_cfg_scale) and refused by name where not."""
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


def family_of_model_name(model: str) -> Family | None:
    """The family a model path or hub id names (``Qwen/Qwen-Image-Edit`` -> qwen-image-edit,
    ``Qwen/Qwen-Image-Edit-2509`` -> qwen-image-edit-plus, ``/models/z-image-turbo`` ->
    z-image, ``ByteDance-Seed/BAGEL-7B-MoT`` -> bagel), by the longest family name or alias
    in its last component."""
    basename = model_basename(model).replace("_", "-")
    matches = [
        (name, family)
        for family in FAMILIES.values()
        for name in (family.name, *family.aliases)
        if name in basename
    ]
    return max(matches, key=lambda match: len(match[0]))[1] if matches else None


def read_checkpoint_family(path: str) -> Family | None:
    """The family of the checkpoint at ``path``: its model_index.json's pipeline class (a
    diffusers checkpoint), else its config.json's architectures (a transformers model that
    holds every stage); None if ``path`` is no local checkpoint or names no known family."""
    root = os.path.expanduser(os.path.expandvars(path))
    class_name = _read_json_field(os.path.join(root, MODEL_INDEX), "_class_name")
    if isinstance(class_name, str):
        return family_of_pipeline_class(class_name)
    architectures = _read_json_field(os.path.join(root, "config.json"), "architectures")
    if not isinstance(architectures, list):
        return None
    for family in FAMILIES.values():
        if any(name in family.architectures for name in architectures):
            return family
    return None


def _read_json_field(path: str, name: str) -> object:
    """``name`` of the JSON object in the file at ``path``; None where there is none."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data.get(name) if isinstance(data, dict) else None
