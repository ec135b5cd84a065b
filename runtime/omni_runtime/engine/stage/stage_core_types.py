"""Wire types of every stage core, as the seed's third inheritance diagram draws them.

``StageCoreRequest``/``Output``/``Outputs`` are field-less markers: code that handles any
stage (the replica pool, the router) types against them. The LLM types are vLLM's own
engine-core messages *and* markers, so a vLLM engine core accepts them unchanged; the
diffusion types carry what a diffusers pipeline needs. All are msgspec structs encoded by
``omni_runtime.wire`` (arrays as raw frames, never pickle).

The three LLM types are defined in ``_stage_llm_core_types`` and resolved here on first
use (PEP 562): subclassing vLLM's structs means importing vLLM, about 7 s, which a
diffusion core proc would otherwise pay at every start for types it never uses. The
markers and StageError they derive from are in ``_stage_core_base`` (re-exported here), so
that module never imports this one.
"""

from __future__ import annotations

import enum
import importlib
import re
from typing import TYPE_CHECKING, Any, Self

import msgspec
import numpy as np

from omni_runtime.engine.stage._stage_core_base import (
    HandOff,
    StageCoreOutput,
    StageCoreOutputs,
    StageCoreRequest,
    StageError,
    StageErrorCode,
)

if TYPE_CHECKING:
    from omni_runtime.engine.stage._stage_llm_core_types import (
        StageLLMCoreOutput,
        StageLLMCoreOutputs,
        StageLLMCoreRequest,
    )

__all__ = [
    "HandOff",
    "InvalidStageRequestError",
    "StageAdapter",
    "StageCoreOutput",
    "StageCoreOutputs",
    "StageCoreRequest",
    "StageCoreRequestType",
    "StageDiffusionCoreOutput",
    "StageDiffusionCoreOutputs",
    "StageDiffusionCoreRequest",
    "StageError",
    "StageErrorCode",
    "StageLLMCoreOutput",
    "StageLLMCoreOutputs",
    "StageLLMCoreRequest",
    "StageLoad",
    "StageServerOutput",
    "StageServerOutputs",
    "StageServerRequest",
    "StageUtilityCall",
    "StageUtilityOutput",
    "TraceContext",
]
_LLM_TYPES = frozenset({"StageLLMCoreRequest", "StageLLMCoreOutput", "StageLLMCoreOutputs"})


def __getattr__(name: str) -> Any:
    if name in _LLM_TYPES:
        module = importlib.import_module("omni_runtime.engine.stage._stage_llm_core_types")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class InvalidStageRequestError(ValueError):
    """A request a stage refuses, raised where it is checked; the message starts with the
    offending field, which ``param`` names (a sampling parameter by its own name: "height",
    not "params.height"). ``error`` is what goes on the wire."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    @property
    def error(self) -> StageError:
        return StageError.bad_request(str(self), self.param)

    @classmethod
    def from_validation(cls, error: msgspec.ValidationError, where: str) -> Self:
        """The refusal of params that msgspec could not convert, ``where`` naming them.

        msgspec gives the field only in its text ("Expected `int` >= 1 - at `$.height`"):
        it becomes "params.height: Expected `int` >= 1", param "height".
        """
        message = str(error)
        located = re.fullmatch(r"(.*) - at `\$\.?(.*)`", message)
        if located and located[2]:
            return cls(f"{where}.{located[2]}: {located[1]}", located[2])
        return cls(f"{where}: {located[1] if located else message}")


class TraceContext(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """The W3C trace context of the caller's span (``omni_runtime.tracing``): the
    ``traceparent`` and ``tracestate`` headers' values, so that the stage's spans of a
    request join the router's trace."""

    traceparent: str
    tracestate: str = ""


class StageAdapter(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """The LoRA adapter a stage runs a request with (``omni_runtime.adapters``): its name,
    unique in the pipeline, where its files are (a path in the stage's pod, a hub id or an
    https URL; the stage resolves it), and its scale (diffusion stages; an LLM stage's
    adapters apply at their trained scale)."""

    name: str
    source: str
    scale: float = 1.0


class StageDiffusionCoreRequest(StageCoreRequest):
    """A generation request to a diffusion stage.

    ``params`` is the request's free-form sampling map (height, width, num_inference_steps,
    guidance_scale, true_cfg_scale, seed, negative_prompt, num_images, strength). It stays a
    map on the wire so that the engine, not every client, validates it against the loaded
    pipeline and answers a bad field with an error output naming it.
    """

    request_id: str
    prompt: str | None = None
    params: dict[str, Any] = {}
    # Input images (image-to-image, an edit's): uint8 RGB, [height, width, 3] each.
    images: list[np.ndarray] = []
    # Text conditioning given as arrays by a caller that holds them, [tokens, width]
    # (diffusers' own arguments): replaces the pipeline's own text encoder.
    prompt_embeds: np.ndarray | None = None
    negative_prompt_embeds: np.ndarray | None = None
    arrival_time: float = 0.0
    # What upstream stages handed off for this request, by input name ("prompt_embeds",
    # "negative_prompt_embeds", BAGEL's "context_kv" and "no_image_context_kv"), fetched by
    # the core itself onto its device in the dtype it computes in (from shared memory: read
    # in place). An input comes as an array or as a hand-off, not both.
    inputs: dict[str, HandOff] = {}
    # The LoRA adapter to run with (None: the stage's weights alone).
    adapter: StageAdapter | None = None


# The most partial images a request may ask for (OpenAI's Images API's bound).
MAX_PARTIAL_IMAGES = 3


class StageDiffusionCoreOutput(StageCoreOutput):
    """A finished diffusion request: images (or a video's frames), or why there are none;
    or, on the way, one of its partial images (``partial_index``) or how far it is
    (``progress``)."""

    request_id: str
    # uint8 RGB, [num_images, height, width, 3]; a video's frames, [frames, height, width, 3].
    images: np.ndarray | None = None
    # Why there are no images: a refused request, or one that broke.
    error: StageError | None = None
    aborted: bool = False
    # Seconds spent in the pipeline (0 for refused requests).
    execute_time: float = 0.0
    # Of those, the seconds spent fetching the request's handed-off inputs, which the core
    # does first.
    fetch_time: float = 0.0
    # A partial image (the request goes on; its final output follows): which, from 0.
    partial_index: int | None = None
    # The share of its denoising steps done, in percent (the request goes on), for a
    # request that asked for it (``report_progress``).
    progress: int | None = None
    # An engine that makes sound (code2wav): the waveform, float32 mono samples at its
    # model's rate, instead of images.
    audio: np.ndarray | None = None

    @property
    def final(self) -> bool:
        """Whether this is the request's last output (neither a partial image nor progress)."""
        return self.partial_index is None and self.progress is None


class StageUtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The answer to a collective_rpc call: its result or why it failed."""

    call_id: int
    result: Any = None
    failure_message: str | None = None


class StageDiffusionCoreOutputs(StageCoreOutputs):
    """One message from a diffusion stage core."""

    outputs: list[StageDiffusionCoreOutput] = []
    utility_output: StageUtilityOutput | None = None
    # Set on the last message of a core that is going away, with the reason. The client
    # fails every outstanding request with it.
    engine_dead: str | None = None
    timestamp: float = 0.0


class StageUtilityCall(msgspec.Struct, array_like=True, gc=False):
    """A collective_rpc call: run ``method`` on the stage's engine."""

    call_id: int
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class StageCoreRequestType(enum.Enum):
    """First frame of a client-to-core message: what the rest of the frames hold."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"
    # Stage servers only: "are you alive, and how loaded?" (answered with a StageLoad).
    HEALTH = b"\x04"


class StagePrompt(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Another prompt a stage request carries beside its own (a family's companion: the
    negative prompt, BAGEL's image-dropped context): the stage runs it alongside the
    request's, on the same replica, and answers once for both, with its hand-offs among
    the request's under the names ``names`` gives them ("prompt_embeds" ->
    "negative_prompt_embeds"). Its id is the request's, "-" and ``suffix``."""

    suffix: str
    prompt: str
    # Whether it reads the request's images too (an edit's negative prompt does).
    with_images: bool = False
    params: dict[str, Any] = {}
    names: dict[str, str] = {}


class StageServerRequest(StageCoreRequest):
    """A request to a stage server (a stage's replica as routers reach it, over TCP).

    One type for every stage kind, in the caller's terms (text, chat messages, images,
    handles of upstream arrays): the server turns it into its core's own request
    (tokenizing for an LLM, fetching ``prompt_embeds`` through a connector for a
    diffusion stage), so that a router needs neither the model nor ML libraries.
    """

    request_id: str
    prompt: str | None = None
    # Chat messages, [{"role": ..., "content": ...}] (LLM stages: the chat template); content
    # is text, or for a thinker that hears a list of text and input_audio parts.
    messages: list[dict[str, Any]] | None = None
    # Sampling params, merged over the stage's defaultSamplingParams by the server.
    params: dict[str, Any] = {}
    # Input images (image-to-image, an edit's): uint8 RGB, [height, width, 3] each.
    images: list[np.ndarray] = []
    # LLM hidden-states stages: the connector that carries them to the next stage.
    output_connector: str | None = None
    # LLM generate stages: whether the caller reads the text as it is generated. False:
    # one output when the request finishes, with all of its text and token ids (a stage
    # that feeds another, or a caller that does not stream, needs no more).
    stream: bool = True
    # What upstream stages handed off for this request, by the name this stage reads each
    # under (StageDiffusionCoreRequest.inputs): passed to the core, which fetches them.
    inputs: dict[str, HandOff] = {}
    # The router's span of this stage call, when it traces. Last, as every field added
    # here: a frame without it decodes with None, and an older peer ignores it.
    trace_context: TraceContext | None = None
    # Input audio (an LLM stage that hears: Qwen3-Omni's thinker), float32 mono samples
    # each, at the rate its model's processor takes; the messages' input_audio parts place
    # them, in order.
    audios: list[np.ndarray] = []
    # The LoRA adapter this stage runs the request with (None: none); the router picks it
    # from the request's model name.
    adapter: StageAdapter | None = None
    # Prompts the stage runs beside this one, in one message (an LLM stage's): the request
    # finishes when all have, and fails if one does.
    companions: list[StagePrompt] = []
    # Whether a later stage reads what this request hands off, for a stage that hands off
    # only when its route goes on from it (a thinker whose answer will be spoken).
    hand_off: bool = False


class StageServerOutput(StageCoreOutput):
    """One output of a stage server: a streamed step of an LLM request, or a final one."""

    request_id: str
    # New text and token ids since this request's previous output (generate stages).
    text: str = ""
    token_ids: list[int] = []
    finished: bool = False
    # stop | length | abort | error (LLM stages); None until finished.
    finish_reason: str | None = None
    # Why the request was refused, or failed (finished, finish_reason "error").
    error: StageError | None = None
    # Diffusion stages: uint8 RGB, [num_images, height, width, 3]; a video's frames,
    # [frames, height, width, 3].
    images: np.ndarray | None = None
    # What the request's stage handed off for the next one, by name ("prompt_embeds", a
    # context's "context_kv"): where the next stage's core fetches each.
    hand_offs: dict[str, HandOff] = {}
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Seconds the stage spent on the request (0 for refused requests).
    execute_time: float = 0.0
    # Diffusion stages: a partial image of a request that goes on (not finished): which,
    # from 0.
    partial_index: int | None = None
    # Diffusion stages: how far a request that goes on is (percent of its steps), where it
    # asked for it.
    progress: int | None = None
    # A stage that makes sound (code2wav): float32 mono samples at its model's rate.
    audio: np.ndarray | None = None


class StageLoad(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A stage server's answer to HEALTH: who it is, whether its core lives, its load."""

    stage_id: int
    name: str
    alive: bool
    in_flight: int = 0
    # Why the core is not alive.
    reason: str | None = None
    # Taking no new requests: finishing those it holds, then exiting. Sent to every peer
    # when the drain starts, so routers stop at once rather than when Kubernetes says so.
    draining: bool = False
    # The pipeline revision the replica runs (``omni_runtime.config.revision``); a router
    # pairs a request's stages only within one revision.
    revision: str = ""
    # The LoRA adapters the replica holds loaded, least recently used first, and how many it
    # holds at most (0: it takes none): routers prefer a replica that holds a request's.
    adapters: list[str] = []
    max_adapters: int = 0
    # What the heights and widths a DiT makes must be multiples of (its loaded pipeline's
    # VAE scale times its patch, which no config states), so that a router refuses a size
    # before any request reaches a replica. 0: the stage makes no images, or the replica
    # predates this field (a router then asks its describe()).
    size_multiple: int = 0


class StageServerOutputs(StageCoreOutputs):
    """One message from a stage server."""

    outputs: list[StageServerOutput] = []
    utility_output: StageUtilityOutput | None = None
    load: StageLoad | None = None
    # Set when the stage's core died: every request in flight on this server has failed.
    engine_dead: str | None = None
    timestamp: float = 0.0
