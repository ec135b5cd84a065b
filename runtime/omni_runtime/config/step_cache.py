"""A diffusion stage's step cache: the named tiers a request picks from."""

from __future__ import annotations

import re
from typing import Annotated, Self

from pydantic import Field, field_validator, model_validator

from .base import SchemaModel

# The tier every step-cached stage has: the DiT computes every step (exact).
STEP_CACHE_OFF = "off"
# A tier's name: what a request's step_cache field gives (the CRD checks it too).
STEP_CACHE_TIER_PATTERN = "^[a-z][a-z0-9-]{0,30}$"
_TIER_NAME = re.compile(STEP_CACHE_TIER_PATTERN)


class StepCacheTier(SchemaModel):
    """One way of caching a DiT's steps (diffusers' TaylorSeer): after warmupSteps computed
    steps, the transformer computes one step in every interval and predicts the others from
    the last computed ones (a Taylor expansion of order maxOrder); the last cooldownSteps
    are computed again. Defaults: diffusers' own (its TaylorSeerCacheConfig)."""

    interval: Annotated[int, Field(ge=2, le=100)] = Field(
        default=5, description="Steps from one computed step to the next (2: every other)."
    )
    warmup_steps: Annotated[int, Field(ge=1, le=1000)] = Field(
        default=3, description="Steps computed before any is predicted."
    )
    cooldown_steps: Annotated[int, Field(ge=0, le=1000)] = Field(
        default=0, description="Last steps computed again (the image's fine detail)."
    )
    max_order: Annotated[int, Field(ge=0, le=2)] = Field(
        default=1,
        description="Order of the Taylor expansion that predicts a step (0: reuse the last "
        "computed one).",
    )


class StepCacheConfig(SchemaModel):
    """A diffusion stage's step cache: named tiers a request picks with its step_cache field
    (off, every step computed, is always one), and the tier of requests that pick none."""

    tiers: dict[str, StepCacheTier] = Field(
        min_length=1,
        max_length=8,
        description="Tier name (lower-case letters, digits and '-'; not 'off') -> its settings.",
    )
    default: str = Field(
        default=STEP_CACHE_OFF,
        max_length=31,
        description="The tier of a request that names none: 'off' (exact) or one of tiers.",
    )

    @field_validator("tiers")
    @classmethod
    def _check_tiers(cls, value: dict[str, StepCacheTier]) -> dict[str, StepCacheTier]:
        for name in value:
            if name == STEP_CACHE_OFF or not _TIER_NAME.fullmatch(name):
                raise ValueError(
                    f"tier name {name!r}: use 1-31 lower-case letters, digits and '-', "
                    f"starting with a letter, and not {STEP_CACHE_OFF!r} (always a tier)"
                )
        return value

    @model_validator(mode="after")
    def _check_default(self) -> Self:
        if self.default != STEP_CACHE_OFF and self.default not in self.tiers:
            known = ", ".join([STEP_CACHE_OFF, *self.tiers])
            raise ValueError(f"default: {self.default!r} is not a tier; tiers: {known}")
        return self

    @property
    def tier_names(self) -> tuple[str, ...]:
        """What a request's step_cache may say: off, then the tiers."""
        return (STEP_CACHE_OFF, *self.tiers)
