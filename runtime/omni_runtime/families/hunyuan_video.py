"""HunyuanVideo-1.5 (text-to-video): Qwen2.5-VL's language model reads the prompt in a
system template, and its residual stream two layers before the end, template rows dropped,
is the DiT's first text conditioning (diffusers' HunyuanVideo15Pipeline, whose
_get_mllm_prompt_embeds, encode_prompt and __call__ defaults this recipe follows, diffusers
0.42.1).

Its second text encoder, Glyph-SDXL-v2's ByT5 (``text_encoder_2``), stays in the DiT stage,
where the pipeline runs it: it reads only the text the prompt quotes (``"OPEN"``), a few
bytes through a small T5 encoder against the DiT's minutes, and it is no LLM vLLM serves.
So the DiT stage takes the prompt's text beside the encoder stage's embeddings.

Guidance is the pipeline's guider (classifier-free, 6 in the released checkpoints), on
while its scale is not 1; the negative prompt is "" unless one is given, which the
pipeline's template writes as one space.

Image-to-video (HunyuanVideo15ImageToVideoPipeline) is not served: it takes a SigLIP image
encoder and a checkpoint of its own (the ``..._i2v`` ones), not the t2v weights.
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
        # format_text_input: `p if p else " "`.
        return tuple(
            dataclasses.replace(companion, prompt=companion.prompt or " ")
            for companion in super().companions(prompt, has_image, dit_params, thinks)
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
        # Zero-padded to the 1000 rows the pipeline's tokenizer pads to, with the mask; the
        # DiT stage adds ByT5's embeddings of the prompt's quoted text itself.
        embeds="padded",
        guidance="guidance_scale",
        # The released checkpoints' guider (guider_config.json).
        guidance_default=6.0,
        # The Qwen encoder and its tokenizer; ByT5 (text_encoder_2, tokenizer_2) stays.
        text_components=("text_encoder", "tokenizer"),
        # The upstream scripts export at 24 fps; the VAE compresses 4 frames into one
        # latent frame after the first.
        video=VideoRecipe(fps=24, frame_step=4),
    ),
    topology=encoder_then_dit("encoder", "hidden_states"),
    hub_ids=(
        "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
        "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v",
    ),
    # The hub ids' own spelling is the name; the tiny checkpoint's folder spells it apart.
    aliases=("hunyuan-video-1.5",),
)
