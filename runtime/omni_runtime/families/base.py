"""The family interface: everything one model family declares, as data and pure functions.

A model family (Qwen-Image, Z-Image, BAGEL, ...) is served split: an encoder stage on vLLM
(an LLM that reads the prompt, and for an edit the input image) hands a DiT stage on
diffusers what the family's own pipeline would compute before its denoising loop. What
differs from family to family is declared here, once per family, in its own module of this
package; the layers that run requests (router, orchestrator, stage servers, connectors,
replica pool, pipeline schema) read these declarations and name no family:

- ``topology``: the stages a pipeline of the family has (filled in from the model's name);
- ``encoder`` (an EncoderRecipe): what the encoder stage renders and hands over;
- ``dit`` (a DiTRecipe): how the DiT stage runs the family's pipeline on named inputs;
- ``companions``: the other encoder requests a user request needs (the negative prompt's
  embeddings, BAGEL's image-dropped context), and which DiT input each one's hand-off is;
- ``encoder_params``: what the encoder takes of the request's DiT params (BAGEL's seed);
- ``pipeline_issues``: the family's rules on a pipeline's stages, for the schema's errors;
- ``request_fields`` (RequestField each): the request fields the family's DiT takes beyond those
  every image request has, which the router accepts (and documents) for its pipelines only,
  and which are the DiT's own parameters (with the bounds declared there).

This package imports nothing but the standard library (the operator's image has no ML
libraries, and the pipeline schema imports it); what runs a family's model lives with the
model's code (``omni_runtime.modeling``, ``engine.models``, ``diffusion.runners``) and is
named here by import path where a family needs its own engine (``DiTRecipe.engine``) or its
diffusers pipeline its own runner (``DiTRecipe.runner``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .graph import AnswerKind, StageGraph, chain_graph, outputs_hidden_states

# The __call__ argument that turns classifier-free guidance on: Qwen-Image's
# true_cfg_scale (> 1, and only with a negative prompt), Z-Image's guidance_scale (> 0,
# with "" as the negative prompt unless one is given).
GuidanceParam = Literal["true_cfg_scale", "guidance_scale"]
# What an encoder stage hands the DiT, by the name the DiT reads it under: each prompt
# token's hidden state (the DiT's text conditioning), or its keys and values in every layer
# (BAGEL's context KV cache).
HandOffKind = Literal["prompt_embeds", "context_kv"]
# How a DiT's latents become pixels, for partial images (omni_runtime.diffusion.previews):
# "packed-3d": 2x2-packed, a video VAE normalised per channel (Qwen-Image); "scaled":
# [batch, channels, height, width] with the VAE's scaling and shift (Z-Image).
PreviewLayout = Literal["packed-3d", "scaled"]
# The part an LLM stage of a speaking family plays (SpeechRecipe): the thinker writes the
# answer and hands the talker what it read; the talker speaks it as codec frames.
SpeechRole = Literal["thinker", "talker"]
# One issue with a pipeline: the field at fault (a path such as "stages[1].output") and why.
Issue = tuple[str, str]
# A request field's JSON type: a number, an integer, true/false, one of ``values`` (strings),
# or a pair of numbers ([low, high], each within the bounds).
RequestFieldKind = Literal["number", "integer", "boolean", "enum", "number_pair"]


class StageView(Protocol):
    """What a family's rules read of a pipeline's stage (the schema's StageConfig)."""

    @property
    def stage_id(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def type(self) -> str: ...
    @property
    def output(self) -> str | None: ...
    @property
    def think(self) -> bool | None: ...
    @property
    def input_stages(self) -> Mapping[int, str]: ...


@dataclass(frozen=True)
class RequestField:
    """A request field a family's DiT takes beyond the common image fields (height, width,
    size, num_inference_steps, guidance_scale, seed, negative_prompt, n), as plain data: the
    router turns it into a body field (and its OpenAPI schema) of that family's pipelines,
    and passes its value to the DiT among the diffusion params, under the same name.

    Bounds are JSON Schema's and pydantic's (``ge``: at least, ``gt``: more than, ``le``:
    at most, ``lt``: less than); they hold for a number, an integer, or each of a pair.
    """

    name: str
    kind: RequestFieldKind
    # One line, for the OpenAPI document (what the field does, not its bounds).
    description: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    # An enum's values.
    values: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # A slip here would otherwise surface as a router that cannot start.
        # A leading underscore is private to pydantic: no body field.
        if not self.name.isidentifier() or self.name.startswith("_"):
            raise ValueError(
                f"request field {self.name!r}: not a field name (an identifier, no leading _)"
            )
        if (self.kind == "enum") != bool(self.values):
            raise ValueError(f"request field {self.name}: values are for an enum, and only")
        bounded = any(b is not None for b in (self.ge, self.gt, self.le, self.lt))
        if bounded and self.kind not in ("number", "integer", "number_pair"):
            raise ValueError(f"request field {self.name}: a {self.kind} has no bounds")


@dataclass(frozen=True)
class TopologyStage:
    """One stage of a family's pipeline, as a config that leaves it out gets it."""

    stage_id: int
    name: str
    type: Literal["llm", "diffusion"]
    output: Literal["text", "hidden_states"] | None = None


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
    # Edit families: the input images are part of the encoder's input, each resized to
    # about this many pixels (keeping its aspect ratio, sides multiples of 32) as the
    # pipeline does.
    image_area: int | None = None
    # Edit families whose template takes any number of images: what stands for image N
    # (its ``{}``, counted from 1), all of them put before the prompt in the template's
    # ``{}`` (Qwen-Image-Edit-Plus: "Picture 1: <|vision_start|>...Picture 2: ...").
    # None: the template holds the one image's placeholder itself.
    image_prompt: str | None = None
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
    # What the stage hands the DiT. "context_kv": each prompt token's keys and values in
    # every layer (BAGEL's thinker: ``omni_runtime.engine.models.bagel_thinker``); every
    # prompt is then prefilled whole, in one step, and the image goes in as the model's
    # own processor prepares it, where ``image_placeholder`` stands in the prompt.
    hand_off: HandOffKind = "prompt_embeds"
    # The encoder's output the LLM stage's config names (hidden states, or text: BAGEL's
    # thinker, whose plan in think mode is text).
    stage_output: Literal["text", "hidden_states"] = "hidden_states"
    # A context-KV encoder: the token that stands for the input image in the context, the
    # tokens a prompt's text may not contain (they frame an image's spans), the system
    # prompt a thinking request starts with, and the request's DiT params the encoder
    # takes too (by name; BAGEL's thinker samples the input image's VAE latent with the
    # seed's first draw).
    image_placeholder: str | None = None
    reserved_tokens: tuple[str, ...] = ()
    think_system_prompt: str | None = None
    dit_params: tuple[str, ...] = ()

    @property
    def context_kv(self) -> bool:
        return self.hand_off == "context_kv"

    @property
    def takes_image(self) -> bool:
        return self.image_area is not None or self.image_placeholder is not None

    def template_text(self, prompt: str, image_count: int) -> str:
        """The template filled in with the prompt, after the images' own placeholders where
        the template takes several (``image_prompt``)."""
        assert self.template is not None
        if self.image_prompt is None:
            return self.template.format(prompt)
        images = "".join(self.image_prompt.format(n + 1) for n in range(image_count))
        return self.template.format(images + prompt)


@dataclass(frozen=True)
class StepCacheModules:
    """Where a family's DiT takes a step cache (diffusers' TaylorSeer hooks): module names,
    as regular expressions matched whole against the transformer's ``named_modules()``.

    On a step the cache predicts, the ``skip`` modules (the transformer's blocks) compute
    nothing and the ``predict`` module (the output projection) answers a Taylor expansion of
    its outputs on the last computed steps: the step costs the embeddings and little else.
    """

    skip: tuple[str, ...]
    predict: tuple[str, ...]


@dataclass(frozen=True)
class VideoRecipe:
    """A video family's clips: how fast its frames play and how its pipeline counts them."""

    # Frames a second, as the family's pipeline is trained and its examples export.
    fps: int
    # A clip has 1 + k x frame_step frames: its VAE compresses frame_step frames into one
    # latent frame after the first.
    frame_step: int = 4


@dataclass(frozen=True)
class DiTRecipe:
    """How the DiT stage runs the family's pipeline on its named inputs."""

    # The diffusers pipeline class a checkpoint of the family holds (model_index.json's
    # _class_name), or the family's own name for one that is no diffusers pipeline.
    pipeline_class: str
    guidance: GuidanceParam | None = None
    # The pipeline's own default for ``guidance`` (its __call__ signature's).
    guidance_default: float = 0.0
    # Components a DiT stage fed by an encoder stage leaves out when it loads the
    # checkpoint: the encoder stage holds them.
    text_components: tuple[str, ...] = ("text_encoder", "tokenizer")
    takes_image: bool = False
    # An edit family's pipeline edits an input image and makes nothing without one: its
    # pipelines have no text-to-image (no /v1/images/generations). An image-to-video
    # family's starts every clip from one: a video job without an input_reference is refused.
    requires_image: bool = False
    # The common image request fields its DiT does not take (BAGEL has no negative
    # prompt): its pipelines refuse them by name, and their documents leave them out.
    unsupported_fields: tuple[str, ...] = ()
    # "module:Class" of a family whose DiT is its own engine rather than a diffusers
    # pipeline (BAGEL's); imported only in the process that runs it.
    engine: str | None = None
    # "module:Class" of the runner (omni_runtime.diffusion.runners) that holds the call
    # conventions of a diffusers pipeline with quirks: a guider, no step callback, a second
    # text encoder run in the DiT stage, a second pipeline class for input images. None:
    # the default runner, diffusers' plain conventions. Imported only in the stage process.
    runner: str | None = None
    # Where its transformer takes a step cache; None: it takes none (a stage's stepCache is
    # refused).
    step_cache: StepCacheModules | None = None
    # How its latents decode to a partial image; None: it sends no partials.
    preview: PreviewLayout | None = None
    # A video family's clips; None: the DiT makes images.
    video: VideoRecipe | None = None
    # The pipeline sizes its output from the input image (the size bucket nearest the
    # image's aspect ratio at its checkpoint's resolution) and takes no height or width:
    # a request that asks for a size is refused by name rather than silently not obeyed
    # (HunyuanVideo-1.5's image-to-video). The router refuses a video job's size by it; the
    # DiT stage's runner refuses height and width.
    sized_by_image: bool = False

    def __post_init__(self) -> None:
        # A runner calls a diffusers pipeline; an engine of its own runs none.
        if self.engine is not None and self.runner is not None:
            raise ValueError(
                f"{self.pipeline_class}: a DiT with an engine of its own has no runner"
            )


@dataclass(frozen=True)
class SpeechRecipe:
    """A family that hears and speaks (Qwen3-Omni): its first LLM stage, the thinker, reads
    text, images and audio and writes the answer; its second, the talker, turns the
    thinker's rows for the request into codec frames; its diffusion-kind stage (the
    DiTRecipe's engine) turns the frames into a waveform. A request that asks for text alone
    ends at the thinker."""

    # The vLLM architectures (omni_runtime.engine.models) each LLM stage runs.
    thinker_architecture: str
    talker_architecture: str
    # The voices the talker knows (its config's speaker_id, lower case), the default first.
    voices: tuple[str, ...]
    # The waveform's samples a second.
    sample_rate: int
    # What the thinker's audio processor takes: samples a second, and the longest input.
    input_sample_rate: int
    max_input_seconds: float
    # The thinker's hand-off names: its rows (each read token's input embedding and the
    # talker's layer), and its prompt's token ids (where the talker finds the user's turns).
    rows: str = "thinker_rows"
    prompt: str = "thinker_prompt"
    # The talker's: its frames of codes, code2wav's input.
    codes: str = "codes"
    # A pipeline with asyncChunk: the talker hands code2wav its frames this many at a time
    # (12.5 a second), each chunk with up to ``context_frames`` frames before it, which
    # code2wav decodes and drops (transformers' chunked_decode, chunk by chunk).
    chunk_frames: int = 25
    context_frames: int = 25


@dataclass(frozen=True)
class SpeechStage:
    """An LLM stage of a speaking family: the family's recipe and the part it plays."""

    recipe: SpeechRecipe
    role: SpeechRole

    @property
    def architecture(self) -> str:
        if self.role == "thinker":
            return self.recipe.thinker_architecture
        return self.recipe.talker_architecture


@dataclass(frozen=True)
class Companion:
    """A request to the encoder stage that the DiT needs beside the user's own: the same
    stage, another prompt (a negative prompt, the prompt without its image)."""

    # Appended to the user's request id: "<id>-<suffix>".
    suffix: str
    prompt: str
    with_image: bool = False
    params: Mapping[str, Any] = field(default_factory=dict)
    # The DiT input that each of this request's hand-offs becomes, by the hand-off's name
    # ("prompt_embeds" -> "negative_prompt_embeds").
    inputs: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    """One model family: an encoder stage on vLLM feeding the family's DiT stage."""

    name: str
    # None: the family's DiT stage encodes its prompts itself (Wan's UMT5).
    encoder: EncoderRecipe | None
    dit: DiTRecipe
    topology: tuple[TopologyStage, ...]
    # Hub ids of the family's public checkpoints (for docs and examples).
    hub_ids: tuple[str, ...] = ()
    # The ``architectures`` a checkpoint's config.json names where one transformers model
    # holds every stage of the family (Qwen3-Omni's): a local checkpoint whose path names
    # no family is known by it.
    architectures: tuple[str, ...] = ()
    # Other names a model's path or hub id may carry for the family (lower case, "-" for
    # "_"): Qwen-Image-Edit-Plus is published as Qwen-Image-Edit-2509 and -2511.
    aliases: tuple[str, ...] = ()
    # The most input images one request may carry (an edit family's; 0: it takes none).
    max_input_images: int = 0
    # Whether the family's encoder may think (BAGEL's think mode: a plan written first).
    thinks: bool = False
    # The request fields of the family's own DiT (its guidance knobs), beyond the common
    # image fields, declared once: the router's bodies take them, and the DiT's parameters
    # are them, with these bounds (omni_runtime.diffusion.params); a pipeline of another
    # family refuses them as unknown fields.
    request_fields: tuple[RequestField, ...] = ()
    # A family that hears and speaks; None: its pipelines make images or videos.
    speech: SpeechRecipe | None = None

    def speech_stage(self, stage: StageView, stages: Sequence[StageView]) -> SpeechStage | None:
        """The part ``stage`` of a pipeline of this family (of ``stages``) plays in
        speech: the first LLM stage thinks, the second talks."""
        if self.speech is None or stage.type != "llm":
            return None
        llms = sorted(s.stage_id for s in stages if s.type == "llm")
        if stage.stage_id == llms[0]:
            return SpeechStage(self.speech, "thinker")
        if len(llms) > 1 and stage.stage_id == llms[1]:
            return SpeechStage(self.speech, "talker")
        return None

    def graph(self, stages: Sequence[StageView], async_chunk: bool) -> StageGraph:
        """The pipeline's stages (``stages``, checked by ``pipeline_issues``) as this family
        connects them: one chain, its encoder handing its DiT what it computed, the DiT's
        images or video the answer. ``async_chunk``: the pipeline streams between stages."""
        answer: AnswerKind = "video" if self.dit.video is not None else "image"
        return chain_graph(stages, answer, lambda s: self.is_encoder(s) or outputs_hidden_states(s))

    def is_encoder(self, stage: StageView) -> bool:
        """Whether ``stage`` of a pipeline of this family is its encoder."""
        return (
            self.encoder is not None
            and stage.type == "llm"
            and stage.output == self.encoder.stage_output
        )

    def companions(
        self, prompt: str, has_image: bool, dit_params: Mapping[str, Any], thinks: bool
    ) -> tuple[Companion, ...]:
        """The companion requests of a user request whose DiT params (defaults merged) are
        ``dit_params``; ``thinks``: the encoder stage is in think mode."""
        return ()

    def encoder_params(self, dit_params: Mapping[str, Any], has_image: bool) -> dict[str, Any]:
        """What the encoder stage takes of the request's DiT params."""
        if not has_image or self.encoder is None:
            return {}
        return {name: dit_params[name] for name in self.encoder.dit_params if name in dit_params}

    def pipeline_issues(
        self, stages: Sequence[StageView], index_of_id: Mapping[int, int]
    ) -> list[Issue]:
        """The family's rules on a pipeline's stages: (path, why) for each one broken."""
        return []

    def negative_prompt(self, params: Mapping[str, object]) -> str | None:
        """The negative prompt whose embeddings the DiT needs for a request whose effective
        diffusion params are ``params``; None when the family's pipeline would run no
        guidance for it. Values of the wrong type count as absent: the DiT refuses them."""
        if self.dit.guidance is None:
            return None
        negative = params.get("negative_prompt")
        negative = negative if isinstance(negative, str) else None
        scale = params.get(self.dit.guidance)
        if not isinstance(scale, int | float) or isinstance(scale, bool):
            scale = self.dit.guidance_default
        if self.dit.guidance == "true_cfg_scale":
            return negative if scale > 1 else None
        return (negative if negative is not None else "") if scale > 0 else None


@dataclass(frozen=True)
class EmbeddingsFamily(Family):
    """A family whose encoder's hidden states are the DiT's text conditioning, and whose
    guidance needs the negative prompt's too (Qwen-Image, Z-Image): the encoder stage ends
    the pipeline's first stage, hidden states out; the DiT is the last."""

    def companions(
        self, prompt: str, has_image: bool, dit_params: Mapping[str, Any], thinks: bool
    ) -> tuple[Companion, ...]:
        negative = self.negative_prompt(dit_params)
        if negative is None:
            return ()
        return (
            Companion(
                suffix="negative",
                prompt=negative,
                # An edit's negative prompt is encoded with the input image, as the pipeline does.
                with_image=has_image,
                inputs={"prompt_embeds": "negative_prompt_embeds"},
            ),
        )

    def pipeline_issues(
        self, stages: Sequence[StageView], index_of_id: Mapping[int, int]
    ) -> list[Issue]:
        last = max(stages, key=lambda s: s.stage_id)
        if last.type != "diffusion":
            where = f"stages[{index_of_id[last.stage_id]}].type"
            return [(where, f"a {self.name} pipeline ends in its DiT, a diffusion stage")]
        issues = []
        by_id = {stage.stage_id: stage for stage in stages}
        for upstream in last.input_stages:
            stage = by_id.get(upstream)
            if stage is not None and stage.type == "llm" and stage.output != "hidden_states":
                issues.append(
                    (
                        f"stages[{index_of_id[upstream]}].output",
                        f"the encoder of a {self.name} pipeline outputs hidden_states",
                    )
                )
        return issues


def encoder_then_dit(
    encoder_name: str, output: Literal["text", "hidden_states"] | None
) -> tuple[TopologyStage, ...]:
    """The two-stage topology every family here has: its encoder (stage 0), its DiT (1)."""
    return (
        TopologyStage(stage_id=0, name=encoder_name, type="llm", output=output),
        TopologyStage(stage_id=1, name="dit", type="diffusion"),
    )


def model_basename(model: str) -> str:
    """The lower-cased last component of a model path or hub id."""
    parts = [part for part in re.split(r"[/\\]", model.strip()) if part]
    return parts[-1].lower() if parts else ""


def prompt_image_size(width: int, height: int, area: int) -> tuple[int, int]:
    """The (width, height) an edit pipeline resizes an input image to before encoding it:
    about ``area`` pixels, the same aspect ratio, each side a multiple of 32."""
    ratio = width / height
    new_width = math.sqrt(area * ratio)
    new_height = new_width / ratio
    return round(new_width / 32) * 32, round(new_height / 32) * 32
