"""Qwen-Image, Qwen-Image-Edit and Qwen-Image-Edit-Plus: Qwen2.5-VL's hidden states,
template rows dropped, are the MMDiT's text conditioning (diffusers' QwenImagePipeline,
QwenImageEditPipeline and QwenImageEditPlusPipeline, whose _get_qwen_prompt_embeds and
__call__ defaults these recipes follow, diffusers 0.42.1)."""

from __future__ import annotations

import dataclasses

from .base import (
    DiTRecipe,
    EmbeddingsFamily,
    EncoderRecipe,
    RequestField,
    StepCacheModules,
    encoder_then_dit,
)

_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
# The edit pipelines' template: their system prompt, then the user's turn. Edit-Plus (the
# 2509 and 2511 checkpoints) puts one "Picture N: ..." placeholder per input image before
# the user's text; the first edit pipeline has its one image's placeholder in the template.
_EDIT_PLUS_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
    "texture, objects, background), then explain how the user's text instruction should "
    "alter or modify the image. Generate a new image that meets the user's requirements "
    "while maintaining consistency with the original input where appropriate.<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
_IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
_EDIT_TEMPLATE = _EDIT_PLUS_TEMPLATE.format(_IMAGE_PLACEHOLDER + "{}")
_EDIT_PLUS_IMAGE_PROMPT = "Picture {}: " + _IMAGE_PLACEHOLDER

# The pipelines' classifier-free guidance scale (their __call__'s true_cfg_scale).
_REQUEST_FIELDS = (
    RequestField(
        name="true_cfg_scale",
        kind="number",
        description="Classifier-free guidance scale: above 1, and with a negative_prompt, "
        "the image is guided away from the negative prompt.",
        ge=0,
    ),
)

# QwenImageTransformer2DModel: its dual-stream blocks, then norm_out and proj_out.
_STEP_CACHE = StepCacheModules(skip=(r"transformer_blocks\.\d+",), predict=("proj_out",))

QWEN_IMAGE = EmbeddingsFamily(
    name="qwen-image",
    encoder=EncoderRecipe(
        template=_TEMPLATE,
        drop_prefix=34,
        max_length=1024 + 34,
        vision_language=True,
    ),
    dit=DiTRecipe(
        pipeline_class="QwenImagePipeline",
        guidance="true_cfg_scale",
        guidance_default=4.0,
        step_cache=_STEP_CACHE,
        preview="packed-3d",
    ),
    topology=encoder_then_dit("encoder", "hidden_states"),
    hub_ids=("Qwen/Qwen-Image",),
    request_fields=_REQUEST_FIELDS,
)


def _edit_dit(pipeline_class: str) -> DiTRecipe:
    """The edit pipelines' DiT: Qwen-Image's, with the input images, and without the
    processor (the encoder stage's) among the components it loads."""
    return DiTRecipe(
        pipeline_class=pipeline_class,
        guidance="true_cfg_scale",
        guidance_default=4.0,
        text_components=("text_encoder", "tokenizer", "processor"),
        takes_image=True,
        requires_image=True,
        step_cache=_STEP_CACHE,
        preview="packed-3d",
    )


_EDIT_ENCODER = EncoderRecipe(
    template=_EDIT_TEMPLATE,
    drop_prefix=64,
    max_length=None,
    image_area=1024 * 1024,
    tokenizer_subfolder="processor",
    vision_language=True,
)

QWEN_IMAGE_EDIT = EmbeddingsFamily(
    name="qwen-image-edit",
    encoder=_EDIT_ENCODER,
    dit=_edit_dit("QwenImageEditPipeline"),
    topology=encoder_then_dit("encoder", "hidden_states"),
    hub_ids=("Qwen/Qwen-Image-Edit",),
    request_fields=_REQUEST_FIELDS,
    max_input_images=1,
)

# Several input images (the model card's 1 to 3), each encoded at about 384x384 (the
# pipeline's CONDITION_IMAGE_SIZE) and given to the VAE at about 1024x1024 (its DiT's own
# resizing); the output's default size follows the last image.
QWEN_IMAGE_EDIT_PLUS = dataclasses.replace(
    QWEN_IMAGE_EDIT,
    name="qwen-image-edit-plus",
    encoder=dataclasses.replace(
        _EDIT_ENCODER,
        template=_EDIT_PLUS_TEMPLATE,
        image_area=384 * 384,
        image_prompt=_EDIT_PLUS_IMAGE_PROMPT,
    ),
    dit=_edit_dit("QwenImageEditPlusPipeline"),
    hub_ids=("Qwen/Qwen-Image-Edit-2509", "Qwen/Qwen-Image-Edit-2511"),
    aliases=("qwen-image-edit-2509", "qwen-image-edit-2511"),
    max_input_images=3,
)
