"""Z-Image: Qwen3's penultimate layer is the DiT's text conditioning, one array of rows per
prompt (diffusers' ZImagePipeline, whose _encode_prompt and __call__ defaults this recipe
follows, diffusers 0.42.1)."""

from __future__ import annotations

from types import MappingProxyType

from .base import (
    DiTRecipe,
    EmbeddingsFamily,
    EncoderRecipe,
    RequestField,
    StepCacheModules,
    encoder_then_dit,
)

Z_IMAGE = EmbeddingsFamily(
    name="z-image",
    encoder=EncoderRecipe(
        template=None,
        chat_template_kwargs=MappingProxyType(
            {"add_generation_prompt": True, "enable_thinking": True}
        ),
        drop_prefix=0,
        max_length=512,
        architecture="OmniQwen3PenultimateModel",
    ),
    dit=DiTRecipe(
        pipeline_class="ZImagePipeline",
        guidance="guidance_scale",
        guidance_default=5.0,
        # ZImageTransformer2DModel: its refiners and main layers, then the final layer of
        # the request's patch size ("2-1").
        step_cache=StepCacheModules(
            skip=(r"(noise_refiner|context_refiner|layers)\.\d+",),
            predict=(r"all_final_layer\.[^.]+",),
        ),
        preview="scaled",
        # Guidance that stops part way (cfg_truncation) cannot run with a step cache.
        runner="omni_runtime.diffusion.runners.z_image:ZImageRunner",
    ),
    topology=encoder_then_dit("encoder", "hidden_states"),
    hub_ids=("Tongyi-MAI/Z-Image-Turbo",),
    # ZImagePipeline.__call__'s guidance knobs, beyond guidance_scale.
    request_fields=(
        RequestField(
            name="cfg_normalization",
            kind="boolean",
            description="Renormalise the guided prediction to the norm of the unguided one.",
        ),
        RequestField(
            name="cfg_truncation",
            kind="number",
            description="Guidance stops once this fraction of the steps is done.",
            ge=0,
            le=1,
        ),
    ),
)
