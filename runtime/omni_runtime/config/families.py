"""Model families whose pipeline is "an LLM encodes, a DiT denoises", split over two stages.

A family's recipe says what its encoder stage must compute for the DiT to see exactly what
the family's own diffusers pipeline feeds it (the prompt template, the prefix of template
rows to drop, the layer, the length limit, whether the input image goes in too), and how
the DiT stage hands those embeddings to the pipeline (padded with a mask, or as a list of
rows), which guidance parameter the family uses, and when it needs negative embeddings.

Recipes are data and pure functions, shared by the router (which asks the encoder for the
negative prompt's embeddings as a companion request), the encoder stage and the DiT stage.
A pipeline names its family (``family``), or one is found from the model's name (a hub id
or directory name) or, where the checkpoint is at hand, from its ``model_index.json``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, get_args

from .topologies import model_basename

FamilyName = Literal["qwen-image", "qwen-image-edit", "z-image", "bagel"]
FAMILY_NAMES: tuple[str, ...] = get_args(FamilyName)
# BAGEL is one model, not an encoder and a DiT: its thinker's context (its KV cache, or
# for now the prompt and image it passes on) conditions the same model's generation
# expert, which omni_runtime.modeling.bagel runs. It has no recipe in FAMILIES; its
# pipelines are found by the BAGEL topology (config.topologies).
BAGEL_FAMILY = "bagel"
# How a family's pipeline takes text embeddings: "padded": [batch, tokens, width] with a
# mask (Qwen-Image); "rows": a list of [tokens, width] arrays, one per prompt (Z-Image).
EmbedsLayout = Literal["padded", "rows"]
# The __call__ argument that turns classifier-free guidance on: Qwen-Image's
# true_cfg_scale (> 1, and only with a negative prompt), Z-Image's guidance_scale (> 0,
# with "" as the negative prompt unless one is given).
GuidanceParam = Literal["true_cfg_scale", "guidance_scale"]


@dataclass(frozen=True)
class EncoderRecipe:
    """What the encoder stage computes from a prompt (and, for an edit, the input image)."""

    # A format string whose one {} takes the prompt; None: the tokenizer's chat template
    # over one user message, with ``chat_template_kwargs``.
    template: str | None
    # Leading rows of the hidden states that belong to the template, not the prompt: the
    # pipeline drops them before the DiT sees them.
    drop_prefix: int
    # The most tokens the pipeline's tokenizer call keeps (template included); None: no
    # truncation (the edit pipeline's processor call has none).
    max_length: int | None
    chat_template_kwargs: Mapping[str, object] = field(default_factory=dict)
    # Edit families: the input image is part of the encoder's input, resized to about this
    # many pixels (keeping its aspect ratio, sides multiples of 32) as the pipeline does.
    image_area: int | None = None
    # Where a diffusers checkpoint keeps the encoder's weights and its tokenizer (or, for
    # the edit family, the processor that also prepares the image).
    text_encoder_subfolder: str = "text_encoder"
    tokenizer_subfolder: str = "tokenizer"
    # A vLLM architecture (registered by omni_runtime.engine.models) computing the layer
    # the DiT reads, where the checkpoint's own architecture returns another one.
    architecture: str | None = None
    # Whether the text encoder is a vision-language model (Qwen2.5-VL): one that reads no
    # image is then loaded without its vision tower.
    vision_language: bool = False
    # The rows are each prompt token's keys and values in every layer (BAGEL's thinker:
    # ``omni_runtime.engine.models.bagel_thinker``), handed on as the DiT's context KV; every
    # prompt is then prefilled whole, in one step.
    context_kv: bool = False

    @property
    def takes_image(self) -> bool:
        # BAGEL's thinker reads an edit's input image as its own processor prepares it.
        return self.image_area is not None or self.context_kv


# BAGEL's thinker: a prompt is framed as BAGEL frames a text in its context.
BAGEL_THINKER = EncoderRecipe(
    template="<|im_start|>{}<|im_end|>",
    drop_prefix=0,
    max_length=None,
    architecture="OmniBagelThinker",
    context_kv=True,
)


@dataclass(frozen=True)
class DiTRecipe:
    """How the DiT stage runs the family's diffusers pipeline on embeddings from upstream."""

    pipeline_class: str
    embeds: EmbedsLayout
    guidance: GuidanceParam
    # The pipeline's own default for ``guidance`` (its __call__ signature's).
    guidance_default: float
    # Components a DiT stage fed by an encoder stage leaves out when it loads the
    # checkpoint: the encoder stage holds them.
    text_components: tuple[str, ...] = ("text_encoder", "tokenizer")
    takes_image: bool = False


@dataclass(frozen=True)
class Family:
    name: FamilyName
    encoder: EncoderRecipe
    dit: DiTRecipe
    # Hub ids of the family's public checkpoints (for docs and examples).
    hub_ids: tuple[str, ...] = ()

    def negative_prompt(self, params: Mapping[str, object]) -> str | None:
        """The negative prompt whose embeddings the DiT needs for a request whose effective
        diffusion params are ``params``; None when the family's pipeline would run no
        guidance for it. Values of the wrong type count as absent: the DiT refuses them."""
        negative = params.get("negative_prompt")
        negative = negative if isinstance(negative, str) else None
        scale = params.get(self.dit.guidance)
        if not isinstance(scale, int | float) or isinstance(scale, bool):
            scale = self.dit.guidance_default
        if self.dit.guidance == "true_cfg_scale":
            return negative if scale > 1 else None
        return (negative if negative is not None else "") if scale > 0 else None


_QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
_QWEN_IMAGE_EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
    "texture, objects, background), then explain how the user's text instruction should "
    "alter or modify the image. Generate a new image that meets the user's requirements "
    "while maintaining consistency with the original input where appropriate.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)

# What diffusers 0.42.1's QwenImagePipeline, QwenImageEditPipeline and ZImagePipeline do
# (their _get_qwen_prompt_embeds / _encode_prompt and __call__ defaults).
FAMILIES: Mapping[str, Family] = MappingProxyType(
    {
        "qwen-image": Family(
            name="qwen-image",
            encoder=EncoderRecipe(
                template=_QWEN_IMAGE_TEMPLATE,
                drop_prefix=34,
                max_length=1024 + 34,
                vision_language=True,
            ),
            dit=DiTRecipe(
                pipeline_class="QwenImagePipeline",
                embeds="padded",
                guidance="true_cfg_scale",
                guidance_default=4.0,
            ),
            hub_ids=("Qwen/Qwen-Image",),
        ),
        "qwen-image-edit": Family(
            name="qwen-image-edit",
            encoder=EncoderRecipe(
                template=_QWEN_IMAGE_EDIT_TEMPLATE,
                drop_prefix=64,
                max_length=None,
                image_area=1024 * 1024,
                tokenizer_subfolder="processor",
                vision_language=True,
            ),
            dit=DiTRecipe(
                pipeline_class="QwenImageEditPipeline",
                embeds="padded",
                guidance="true_cfg_scale",
                guidance_default=4.0,
                text_components=("text_encoder", "tokenizer", "processor"),
                takes_image=True,
            ),
            hub_ids=("Qwen/Qwen-Image-Edit",),
        ),
        "z-image": Family(
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
                embeds="rows",
                guidance="guidance_scale",
                guidance_default=5.0,
            ),
            hub_ids=("Tongyi-MAI/Z-Image-Turbo",),
        ),
    }
)
MODEL_INDEX = "model_index.json"


def family_of_pipeline_class(class_name: str) -> Family | None:
    """The family whose DiT runs diffusers' ``class_name``, if any."""
    for family in FAMILIES.values():
        if family.dit.pipeline_class == class_name:
            return family
    return None


def family_of_model_name(model: str) -> Family | None:
    """The family a model path or hub id names (``Qwen/Qwen-Image-Edit`` -> qwen-image-edit,
    ``/models/z-image-turbo`` -> z-image), by the longest family name in its last component."""
    basename = model_basename(model).replace("_", "-")
    matches = [name for name in FAMILIES if name in basename]
    return FAMILIES[max(matches, key=len)] if matches else None


def read_checkpoint_family(path: str) -> Family | None:
    """The family of the diffusers checkpoint at ``path`` (its model_index.json's class);
    None if ``path`` is no local checkpoint or its pipeline is of no known family."""
    index = os.path.join(os.path.expanduser(os.path.expandvars(path)), MODEL_INDEX)
    try:
        with open(index, encoding="utf-8") as f:
            class_name = json.load(f).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    return family_of_pipeline_class(class_name) if isinstance(class_name, str) else None


def prompt_image_size(width: int, height: int, area: int) -> tuple[int, int]:
    """The (width, height) an edit pipeline resizes an input image to before encoding it:
    about ``area`` pixels, the same aspect ratio, each side a multiple of 32."""
    ratio = width / height
    new_width = math.sqrt(area * ratio)
    new_height = new_width / ratio
    return round(new_width / 32) * 32, round(new_height / 32) * 32
