"""Wan2.2's runner (family ``wan2.2``): text-to-video is diffusers' WanPipeline, and a
request with an input image runs its WanImageToVideoPipeline, built with ``from_pipe`` on
the same weights (the image pins the first latent frame through the VAE)."""

from __future__ import annotations

from typing import Any

from omni_runtime.diffusion.params import DiffusionParams
from omni_runtime.diffusion.runners.base import PipelineRunner
from omni_runtime.families.base import Family


class WanRunner(PipelineRunner):
    def __init__(self, pipeline: Any, family: Family | None, device: str, dtype: Any) -> None:
        from diffusers import WanImageToVideoPipeline

        super().__init__(pipeline, family, device, dtype)
        self.image_pipeline = WanImageToVideoPipeline.from_pipe(pipeline)
        self.image_pipeline.set_progress_bar_config(disable=True)

    def __call__(self, params: DiffusionParams, kwargs: dict[str, Any], pictures: list[Any]) -> Any:
        if pictures:
            # The family takes one input image: the clip's first frame.
            return self.image_pipeline(image=pictures[0], **kwargs)
        return super().__call__(params, kwargs, pictures)
