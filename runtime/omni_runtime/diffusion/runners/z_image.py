"""Z-Image's runner (family ``z-image``, diffusers' ZImagePipeline, 0.42.1): its pipeline
takes each prompt's embeddings as an array of rows of its own (a list, no padding, no
mask); and its guidance may stop part way (``cfg_truncation`` below 1), which halves the
DiT's batch from that step, so a step cache, whose predictions are made from the guided
steps, cannot run with it."""

from __future__ import annotations

from typing import Any

from omni_runtime.config import STEP_CACHE_OFF
from omni_runtime.diffusion.params import DiffusionParams, InvalidRequestError
from omni_runtime.diffusion.runners.base import PipelineRunner


class ZImageRunner(PipelineRunner):
    def embeds_kwargs(self, positives: list[Any], negatives: list[Any]) -> dict[str, Any]:
        return {
            "prompt_embeds": positives,
            "negative_prompt_embeds": negatives if negatives[0] is not None else None,
        }

    def check(self, params: DiffusionParams) -> None:
        tier = params.step_cache
        truncation = getattr(params, "cfg_truncation", None)
        if tier != STEP_CACHE_OFF and truncation is not None and truncation < 1:
            raise InvalidRequestError(
                f"step_cache: tier {tier!r} cannot run with cfg_truncation below 1 (guidance "
                f"that stops part way); use step_cache {STEP_CACHE_OFF!r} or cfg_truncation 1",
                "step_cache",
            )
