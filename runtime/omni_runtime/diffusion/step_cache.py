"""Step caching for a family's DiT: diffusers' TaylorSeer hooks, per request.

Why TaylorSeer, of diffusers' cache hooks (and not cache-dit, which patches the pipelines
it accelerates): which steps it computes is a fixed schedule of the tier and the step
count, not a decision taken on the data (as First-Block Cache and TeaCache take theirs),
so that a request's cost is known before it runs (what a cost-aware replica choice needs),
requests of one tier compute on the same steps (what a batch of them needs), and a cached
image is the same every time. It is diffusers' own documented API (hooks on the
transformer's modules), so nothing of diffusers is patched.

A request's hooks are put on the transformer for its run and taken off after, so that a
request of another tier, or of none, runs on a transformer left as loaded: the ``off`` tier
is exactly the uncached pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# diffusers' name for the hooks apply_taylorseer_cache registers (diffusers 0.42).
_HOOK_NAME = "taylorseer_cache"


@dataclass(frozen=True)
class StepCacheTier:
    """One tier's schedule (the stage config's StepCacheTier, as plain data)."""

    interval: int
    warmup_steps: int
    cooldown_steps: int = 0
    max_order: int = 1


def computed_steps(tier: StepCacheTier, steps: int) -> list[int]:
    """The steps (0-based) on which the transformer computes; it predicts the others.

    TaylorSeer's schedule (diffusers' TaylorSeerCacheHook): every step before the warm-up
    ends, then each ``interval``-th step counted from the one after it, and every step of
    the cool-down."""
    cooldown_from = steps - tier.cooldown_steps if tier.cooldown_steps else None
    return [
        step
        for step in range(steps)
        if step < tier.warmup_steps
        or (step - tier.warmup_steps - 1) % tier.interval == 0
        or (cooldown_from is not None and step >= cooldown_from)
    ]


@contextlib.contextmanager
def step_cache(
    transformer: Any,
    tier: StepCacheTier,
    steps: int,
    skip: tuple[str, ...],
    predict: tuple[str, ...],
    dtype: Any,
) -> Iterator[None]:
    """``transformer`` caching steps as ``tier`` says, for one run of ``steps`` steps:
    ``skip`` modules compute nothing on a predicted step, ``predict`` modules answer their
    Taylor expansion (in ``dtype``, the one the transformer computes in)."""
    from diffusers.hooks import HookRegistry, TaylorSeerCacheConfig, apply_taylorseer_cache
    from diffusers.models.cache_utils import CacheMixin

    config = TaylorSeerCacheConfig(
        cache_interval=tier.interval,
        disable_cache_before_step=tier.warmup_steps,
        disable_cache_after_step=steps - tier.cooldown_steps if tier.cooldown_steps else None,
        max_order=tier.max_order,
        taylor_factors_dtype=dtype,
        skip_predict_identifiers=list(skip),
        cache_identifiers=list(predict),
    )
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    apply_taylorseer_cache(transformer, config)
    # The registry keeps a list of the hooked modules below it, made before these hooks.
    registry.invalidate_child_registries_cache()
    try:
        if isinstance(transformer, CacheMixin):
            # Its pipeline names each denoiser call (cond, uncond), and the hooks keep a
            # state per name.
            yield
        else:
            # A pipeline that does not (ZImagePipeline) runs one denoiser call per step;
            # CacheMixin's context manager works on any module (it sets the hooks' state).
            with CacheMixin.cache_context(transformer, "denoise"):
                yield
    finally:
        registry.remove_hook(_HOOK_NAME, recurse=True)
        registry.invalidate_child_registries_cache()
