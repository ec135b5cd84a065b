"""HunyuanVideo-1.5, text-to-video and image-to-video: Qwen2.5-VL's language model reads the
prompt in a system template, and its residual stream two layers before the end, template
rows dropped, is the DiT's first text conditioning (diffusers' HunyuanVideo15Pipeline and
HunyuanVideo15ImageToVideoPipeline, whose _get_mllm_prompt_embeds, encode_prompt and
__call__ defaults these recipes follow, diffusers 0.42.1; the two pipelines' text encoding
is one copied method).

Its second text encoder, Glyph-SDXL-v2's ByT5 (``text_encoder_2``), stays in the DiT stage,
where the pipeline runs it: it reads only the text the prompt quotes (``"OPEN"``), a few
bytes through a small T5 encoder against the DiT's minutes, and it is no LLM vLLM serves.
So the DiT stage takes the prompt's text beside the encoder stage's embeddings.

Guidance is the pipeline's guider (classifier-free, 6 in the released checkpoints), on
while its scale is not 1; the negative prompt is "" unless one is given, which the
pipeline's template writes as one space.

Image-to-video is a family of its own, ``hunyuanvideo-1.5-i2v``, not a variant of the
text-to-video one as Wan2.2's is: its released checkpoints (``..._i2v``) are other weights
(a transformer trained on the image's latent and SigLIP tokens, ``task_type: i2v``), with
their own ``model_index.json`` class (HunyuanVideo15ImageToVideoPipeline) and a SigLIP image
encoder the t2v ones lack; each pipeline runs well only on its own weights. So a
deployment's model says which it serves, and what a request must carry follows from it:

- the image is required (the pipeline has no text-only path: it always conditions on the
  image's latent as the first frame), sent as the Videos API's ``input_reference``; a
  request without it is refused by name when the job is created;
- the clip's size is the pipeline's own: the size bucket nearest the image's aspect ratio
  at the checkpoint's resolution (480p's 640 px, 720p's 960 px); it takes no height or
  width, so a request's ``size`` is refused rather than ignored;
- the SigLIP encoder (``image_encoder``, so400m: ~0.4 B parameters, one 384 px pass a clip)
  stays in the DiT stage with its ``feature_extractor``, as ByT5 does: it is no LLM vLLM
  serves, its one pass costs milliseconds against the DiT's minutes, and a stage of its own
  would add a hand-off and a replica set to scale for nothing a DiT replica cannot do. The
  VAE encodes the image there too, as the DiT stage holds the VAE. The encoder stage reads
  the prompt alone: the pipeline's Qwen template takes no image (the same recipe as
  text-to-video's, so the same encoder serves both).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .base import (
    Companion,
    DiTRecipe,
    EmbeddingsFamily,
    EncoderRecipe,
    VideoRecipe,
    encoder_then_dit,
)

# The pipeline's system message, as its __init__ writes it: one string literal continued
# over lines with a backslash, so each line break is the next line's indentation.
_SYSTEM = (
    "You are a helpful assistant. Describe the video by detailing the following aspects: "
    "        1. The main content and theme of the video. "
    "        2. The color, shape, size, texture, quantity, text, and spatial relationships of "
    "the objects. "
    "        3. Actions, events, behaviors temporal relationships, physical movement changes "
    "of the objects. "
    "        4. background environment, light, style and atmosphere. "
    "        5. camera angles, movements, and transitions used in the video."
)
# Qwen2.5-VL's chat template over [system, user] with the generation prompt: what the
# pipeline's tokenizer.apply_chat_template(..., add_generation_prompt=True) renders.
_TEMPLATE = (
    f"<|im_start|>system\n{_SYSTEM}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# prompt_template_encode_start_idx, and tokenizer_max_length after it: the pipeline pads
# and truncates the template to 1000 + 108 tokens and drops the first 108 rows.
_CROP = 108
_MAX_TOKENS = 1000


@dataclass(frozen=True)
class HunyuanVideoFamily(EmbeddingsFamily):
    """HunyuanVideo-1.5's guidance rules: its guider's classifier-free guidance runs while
    the scale is not 1 (diffusers' own formulation: 0 is the unconditional prediction
    alone, still two passes); its template writes an empty prompt as one space."""

    def negative_prompt(self, params: Mapping[str, object]) -> str | None:
        negative = params.get("negative_prompt")
        negative = negative if isinstance(negative, str) else None
        scale = params.get("guidance_scale")
        if not isinstance(scale, int | float) or isinstance(scale, bool):
            scale = self.dit.guidance_default
        if math.isclose(scale, 1.0):
            return None
        return negative if negative is not None else ""

    def companions(
        self, prompt: str, has_image: bool, dit_params: Mapping[str, Any], thinks: bool
    ) -> tuple[Companion, ...]:
        # format_text_input: `p if p else " "`. The encoder reads the text alone (an input
        # image goes to the DiT stage), the negative prompt's too.
        return tuple(
            dataclasses.replace(companion, prompt=companion.prompt or " ")
            for companion in super().companions(prompt, False, dit_params, thinks)
        )


HUNYUAN_VIDEO = HunyuanVideoFamily(
    name="hunyuanvideo-1.5",
    encoder=EncoderRecipe(
        template=_TEMPLATE,
        drop_prefix=_CROP,
        max_length=_MAX_TOKENS + _CROP,
        # hidden_states[-3]: N-2 decoder layers, no final norm; the text-only Qwen2.5-VL
        # checkpoint read as Qwen2 (omni_runtime.engine.models.CONFIG_FIXES).
        architecture="OmniQwen2AntepenultimateModel",
    ),
    dit=DiTRecipe(
        pipeline_class="HunyuanVideo15Pipeline",
        guidance="guidance_scale",
        # The released checkpoints' guider (guider_config.json).
        guidance_default=6.0,
        # The Qwen encoder and its tokenizer; ByT5 (text_encoder_2, tokenizer_2) stays.
        text_components=("text_encoder", "tokenizer"),
        # The upstream scripts export at 24 fps; the VAE compresses 4 frames into one
        # latent frame after the first.
        video=VideoRecipe(fps=24, frame_step=4),
        # Its guider, no step callback, ByT5 in the DiT stage, sizing by the input image.
        runner="omni_runtime.diffusion.runners.hunyuan_video:HunyuanVideoRunner",
    ),
    topology=encoder_then_dit("encoder", "hidden_states"),
    hub_ids=(
        "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
        "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v",
    ),
    # The hub ids' own spelling is the name; the tiny checkpoint's folder spells it apart.
    aliases=("hunyuan-video-1.5",),
)

# Image-to-video: the same encoder stage and guidance, on the ``..._i2v`` checkpoints.
HUNYUAN_VIDEO_I2V = dataclasses.replace(
    HUNYUAN_VIDEO,
    name="hunyuanvideo-1.5-i2v",
    dit=dataclasses.replace(
        HUNYUAN_VIDEO.dit,
        pipeline_class="HunyuanVideo15ImageToVideoPipeline",
        # SigLIP (image_encoder, feature_extractor) stays with the DiT, as ByT5 does.
        takes_image=True,
        requires_image=True,
        sized_by_image=True,
    ),
    hub_ids=(
        "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v",
        "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_i2v",
    ),
    # A model's name finds its family by the longest name or alias it contains: these
    # outrank the text-to-video family's "hunyuanvideo-1.5" in the hub ids (with or
    # without "Diffusers", and their distilled variants), and its tiny checkpoint's
    # folder. A local checkpoint is also known by its model_index.json's class.
    aliases=(
        "hunyuan-video-1.5-i2v",
        "hunyuanvideo-1.5-480p-i2v",
        "hunyuanvideo-1.5-720p-i2v",
        "hunyuanvideo-1.5-diffusers-480p-i2v",
        "hunyuanvideo-1.5-diffusers-720p-i2v",
    ),
    # The clip's first frame.
    max_input_images=1,
)
