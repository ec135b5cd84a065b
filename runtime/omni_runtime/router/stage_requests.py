"""The request each stage of a route gets: pure functions of the caller's request, the edge
into the stage, and what its producer returned.

What a stage takes follows from its kind and the edge it is reached by, never from its name:
- the route's first stage reads the caller: an LLM its prompt or messages (with the images
  and audio where its graph says it reads them) and its sampling params, a family's
  encoder the prompt text (the input image where its recipe reads one, what its family
  takes of the DiT's params), a DiT the prompt text and its params;
- over a ``text`` edge, the producer's text is the prompt (an LLM's sampling params, or the
  DiT's, come with it);
- over a ``hand_off`` or ``stream`` edge, the producer's hand-offs are the inputs: a DiT gets
  the caller's prompt text beside them (for what its pipeline encodes itself: HunyuanVideo's
  glyph text) and its params; an LLM gets only the caller's params its graph gives it (the
  caller's sampling params are for text an LLM reads, not for a hand-off's consumer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_runtime.config import PipelineConfig, StageConfig
from omni_runtime.engine.stage.stage_core_types import (
    StageAdapter,
    StagePrompt,
    StageServerOutput,
    StageServerRequest,
)
from omni_runtime.families.graph import AnswerKind, GraphEdge


@dataclass
class PipelineRequest:
    """What the caller asked for, split by the kind of stage it is for."""

    request_id: str
    prompt: str | None = None
    # Content is text, or a list of parts where the stage takes them (an LLM that hears:
    # text and input_audio, whose samples are in ``audios``).
    messages: list[dict[str, Any]] | None = None
    # Sampling params for LLM stages that generate text, and for diffusion stages.
    llm_params: dict[str, Any] = field(default_factory=dict)
    diffusion_params: dict[str, Any] = field(default_factory=dict)
    # Input images (image-to-image, an edit's), uint8 RGB [height, width, 3] each.
    images: list[np.ndarray] = field(default_factory=list)
    sticky_key: str | None = None
    # Whether the caller reads the answer's text as it is generated.
    stream: bool = False
    # Input audio (an LLM that hears), float32 mono samples at its processor's rate each,
    # placed by the messages' input_audio parts.
    audios: list[np.ndarray] = field(default_factory=list)
    # The kind of answer asked for, where the pipeline answers with several (a spoken
    # answer: "audio"); None: the pipeline's first (StageGraph.routes).
    answer: AnswerKind | None = None
    # Params the caller gives the stage whose graph says it takes them, by name (a voice).
    stage_params: dict[str, Any] = field(default_factory=dict)
    # The LoRA adapter each stage runs the request with, by stage id (router.adapters).
    adapters: dict[int, StageAdapter] = field(default_factory=dict)


def stage_request_id(request: PipelineRequest, attempt: int) -> str:
    """The id of ``request``'s stage requests in ``attempt``: unique per stage and attempt,
    so that a retried request does not collide with what a replica may still hold of the
    first attempt."""
    return f"{request.request_id}-{attempt}" if attempt else request.request_id


def build_stage_request(
    pipeline: PipelineConfig,
    request: PipelineRequest,
    attempt: int,
    stage: StageConfig,
    edge: GraphEdge | None,
    upstream: StageServerOutput | None,
    upstream_text: str,
    *,
    caller_params: Sequence[str] = (),
    reads_media: bool = False,
    streams: bool = False,
) -> StageServerRequest:
    """``stage``'s request, reached by ``edge`` (None: the route's first) from a producer
    that returned ``upstream`` (its final output) and ``upstream_text`` (all its text).
    ``caller_params``: the caller's stage params it takes; ``reads_media``: an LLM that reads
    the caller's images and audio; ``streams``: the caller reads its text as it is
    written."""
    result = StageServerRequest(
        request_id=stage_request_id(request, attempt),
        adapter=request.adapters.get(stage.stage_id),
    )
    reads_text = edge is None or edge.kind == "text"
    if stage.type == "diffusion":
        result.params = dict(request.diffusion_params)
        result.images = request.images
        result.prompt = upstream_text if edge is not None and reads_text else prompt_text(request)
    elif edge is None:
        _read_caller(pipeline, request, stage, result, reads_media)
    elif reads_text:
        result.prompt = upstream_text
        result.params = dict(request.llm_params)
    if upstream is not None and not reads_text:
        result.inputs = dict(upstream.hand_offs)
    for name in caller_params:
        if name in request.stage_params:
            result.params[name] = request.stage_params[name]
    if stage.type == "llm":
        result.stream = streams
    return result


def _read_caller(
    pipeline: PipelineConfig,
    request: PipelineRequest,
    stage: StageConfig,
    result: StageServerRequest,
    reads_media: bool,
) -> None:
    """Fill in the request of an LLM stage that reads the caller's request."""
    encoder = pipeline.encoder_recipe(stage)
    if encoder is None:
        result.prompt, result.messages = request.prompt, request.messages
        result.params = dict(request.llm_params)
        if reads_media:
            result.images, result.audios = request.images, request.audios
        return
    # An encoder applies its model's own template to the prompt text.
    result.prompt = prompt_text(request)
    if encoder.takes_image:
        result.images = request.images
    family = pipeline.family_recipe
    if family is not None:
        # BAGEL's thinker samples the input image's VAE latent with the seed's first draw,
        # which the DiT's generator then skips, as the reference draws both from one
        # generator.
        result.params = family.encoder_params(dit_params(pipeline, request), bool(request.images))


def companions(
    pipeline: PipelineConfig, request: PipelineRequest, stage: StageConfig, prompt: str
) -> list[StagePrompt]:
    """The prompts ``stage`` runs beside the caller's (``prompt``) where it is its family's
    encoder: the companions its DiT needs (the negative prompt's embeddings, BAGEL's
    image-dropped context), each with the DiT input its hand-off becomes."""
    family = pipeline.family_recipe
    if family is None or pipeline.encoder_recipe(stage) is None:
        return []
    found = family.companions(
        prompt, bool(request.images), dit_params(pipeline, request), thinks=bool(stage.think)
    )
    return [
        StagePrompt(
            suffix=companion.suffix,
            prompt=companion.prompt,
            with_images=companion.with_image,
            params=dict(companion.params),
            names=dict(companion.inputs),
        )
        for companion in found
    ]


def dit_params(pipeline: PipelineConfig, request: PipelineRequest) -> dict[str, Any]:
    """The DiT's params for ``request``: its defaults, then the caller's."""
    defaults: Mapping[str, Any] = {}
    for stage in pipeline.stages:
        if stage.type == "diffusion":
            defaults = stage.default_sampling_params
    return {**defaults, **request.diffusion_params}


def prompt_text(request: PipelineRequest) -> str:
    """The caller's prompt as text: its prompt, else its last user message."""
    if request.prompt is not None:
        return request.prompt
    for message in reversed(request.messages or []):
        if message.get("role") == "user":
            content = message.get("content", "")
            return content if isinstance(content, str) else ""
    return ""
