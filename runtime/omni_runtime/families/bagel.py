"""BAGEL-7B-MoT: one model split over two stages. Its thinker (the understanding expert, on
vLLM) prefills the request's context (the input image, then the prompt) and hands the DiT
(the generation expert, BAGEL's own engine) the context's KV cache; image guidance needs a
second context without the image. BAGEL's modelling code is in ``omni_runtime.modeling.bagel``
and its thinker's vLLM architecture in ``omni_runtime.engine.models.bagel_thinker``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .base import (
    Companion,
    DiTRecipe,
    EncoderRecipe,
    Family,
    Issue,
    RequestField,
    StageView,
    encoder_then_dit,
)

# BAGEL's planning system prompt (its inferencer's VLM_THINK_SYSTEM_PROMPT for generation).
THINK_SYSTEM_PROMPT = (
    "You should first think about the planning process in the mind and then generate the "
    "image. \nThe planning process is enclosed within <think> </think> tags, i.e. <think> "
    "planning process here </think> image here"
)


@dataclass(frozen=True)
class BagelFamily(Family):
    def companions(
        self, prompt: str, has_image: bool, dit_params: Mapping[str, Any], thinks: bool
    ) -> tuple[Companion, ...]:
        # Text to image without a plan: the image-dropped context is the full one.
        if not has_image and not thinks:
            return ()
        # The prompt alone (after think mode's system prompt, if the stage thinks): no
        # image, and no plan; the text-dropped context is a prefix of the full one.
        return (
            Companion(
                suffix="no-image",
                prompt=prompt,
                params={"think": False},
                inputs={"context_kv": "no_image_context_kv"},
            ),
        )

    def pipeline_issues(
        self, stages: Sequence[StageView], index_of_id: Mapping[int, int]
    ) -> list[Issue]:
        chain = sorted(stages, key=lambda s: s.stage_id)
        kinds = [(stage.type, stage.output) for stage in chain]
        if kinds == [("llm", "text"), ("diffusion", None)]:
            return []
        where = f"stages[{index_of_id[chain[-1].stage_id]}]"
        return [
            (
                where,
                "a bagel pipeline is two stages: the thinker (type llm, output text) and then "
                "the DiT (type diffusion)",
            )
        ]


BAGEL = BagelFamily(
    name="bagel",
    architectures=("BagelForConditionalGeneration",),
    encoder=EncoderRecipe(
        # A prompt is framed as BAGEL frames a text in its context.
        template="<|im_start|>{}<|im_end|>",
        drop_prefix=0,
        max_length=None,
        architecture="OmniBagelThinker",
        hand_off="context_kv",
        stage_output="text",
        image_placeholder="<|image_pad|>",
        reserved_tokens=("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|vision_pad|>"),
        think_system_prompt=THINK_SYSTEM_PROMPT,
        dit_params=("seed",),
    ),
    dit=DiTRecipe(
        pipeline_class="BAGEL",
        takes_image=True,
        # Its guidance runs against contexts without the text or the image, not a
        # negative prompt.
        unsupported_fields=("negative_prompt",),
        engine="omni_runtime.diffusion.bagel_engine:BagelEngine",
    ),
    topology=encoder_then_dit("thinker", None),
    hub_ids=("ByteDance-Seed/BAGEL-7B-MoT",),
    thinks=True,
    max_input_images=1,
    # BAGEL's guidance, under its inferencer's names: the DiT's parameters are these fields
    # with these bounds (and it checks what no schema states: cfg_interval's low below its
    # high).
    request_fields=(
        RequestField(
            name="cfg_text_scale",
            kind="number",
            description="Text guidance scale (guidance_scale is taken for it; give one).",
            ge=0,
        ),
        RequestField(
            name="cfg_img_scale",
            kind="number",
            description="Image guidance scale: how closely an edit keeps its input image.",
            ge=0,
        ),
        RequestField(
            name="cfg_interval",
            kind="number_pair",
            description="[low, high]: guidance runs while the flow's time t is in (low, high].",
            ge=0,
            le=1,
        ),
        RequestField(
            name="cfg_renorm_type",
            kind="enum",
            description="How the guided velocity is rescaled to the unguided one's norm: "
            "over everything, per token, or per token of the text guidance.",
            values=("global", "channel", "text_channel"),
        ),
        RequestField(
            name="cfg_renorm_min",
            kind="number",
            description="The lowest factor the renormalisation scales the guided velocity by.",
            ge=0,
            le=1,
        ),
        RequestField(
            name="timestep_shift",
            kind="number",
            description="Shifts the schedule towards high noise (above 1: more steps there).",
            gt=0,
            le=100,
        ),
    ),
)
