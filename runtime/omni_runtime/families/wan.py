"""Wan2.2 (TI2V-5B): text-to-video in diffusers' WanPipeline and image-to-video in its
WanImageToVideoPipeline on the same weights (the input image pins the first latent frame,
through the VAE: no image encoder), one stage.

Its text encoder (UMT5) stays in the DiT stage, where diffusers runs it: it is no LLM (an
encoder-only T5, which vLLM 0.32 does not serve), it runs once per clip for milliseconds
against the DiT's minutes, and as a stage of its own it would add a hand-off and a replica
set to scale for nothing a DiT replica cannot do itself.
"""

from __future__ import annotations

from .base import DiTRecipe, Family, TopologyStage, VideoRecipe

WAN = Family(
    name="wan2.2",
    encoder=None,
    dit=DiTRecipe(
        pipeline_class="WanPipeline",
        guidance="guidance_scale",
        guidance_default=5.0,
        takes_image=True,
        # An input image runs WanImageToVideoPipeline, built from the pipeline's weights.
        runner="omni_runtime.diffusion.runners.wan:WanRunner",
        # Wan2.2-TI2V-5B is trained at 24 fps (its model card: 720p at 24 fps); its VAE
        # compresses 4 frames into one latent frame after the first.
        video=VideoRecipe(fps=24, frame_step=4),
    ),
    topology=(TopologyStage(stage_id=0, name="dit", type="diffusion"),),
    hub_ids=("Wan-AI/Wan2.2-TI2V-5B-Diffusers",),
    # Image-to-video: the clip's first frame.
    max_input_images=1,
    aliases=("wan2.2-ti2v",),
)
