"""A pipeline's LoRA adapters: which stage each applies to and where its files are."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from omni_runtime.adapters import ADAPTER_NAME_PATTERN, ADAPTER_NAME_RULE, source_issue

from .base import SchemaModel

ADAPTER_NAME_PATTERN_RE = re.compile(ADAPTER_NAME_PATTERN)


class AdapterConfig(SchemaModel):
    """A LoRA adapter of one stage, which a request picks by name (its model field)."""

    name: str = Field(
        description="What requests name it by: model '<servedModelName>:<name>' or '<name>' "
        f"(GET /v1/models lists it); {ADAPTER_NAME_RULE}, unique in the pipeline.",
        json_schema_extra={"pattern": ADAPTER_NAME_PATTERN, "maxLength": 64},
    )
    stage: str = Field(
        description="The name of the stage it applies to: an llm stage that generates text, "
        "or a diffusion stage run by diffusers (not BAGEL's DiT or Qwen3-Omni's stages)."
    )
    source: str = Field(
        min_length=1,
        description="Where its files are: an absolute path in the stage's pod (a directory "
        "with PEFT's adapter_config.json and adapter_model.safetensors; for a diffusion stage "
        "also one .safetensors file in diffusers' LoRA format), mounted from a "
        "PersistentVolumeClaim or an image volume; a hub id (org/name); or, for a diffusion "
        "stage, an https:// URL of one .safetensors file.",
    )
    scale: float = Field(
        default=1.0,
        ge=-8.0,
        le=8.0,
        description="Diffusion stages: how strongly it applies (diffusers' adapter weight), "
        "unless the request's lora_scale says; llm stages apply an adapter at its trained "
        "scale, so 1.",
    )

    missing_hints = {
        "name": "the adapter's name, which requests pick it by",
        "stage": "the name of the stage it applies to",
        "source": "a path in the stage's pod, a hub id, or an https:// URL",
    }

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not ADAPTER_NAME_PATTERN_RE.fullmatch(value):
            raise ValueError(f"{value!r} is not a valid adapter name: use {ADAPTER_NAME_RULE}")
        return value

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        issue = source_issue(value)
        if issue is not None:
            raise ValueError(issue)
        return value
