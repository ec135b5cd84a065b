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

from omni_runtime.connectors.base import ConnectorHandle
from omni_runtime.engine.stage._stage_core_base import (
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
    "ContextKVRef",
    "InvalidStageRequestError",
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


class ContextKVRef(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Where a BAGEL DiT finds one context's KV cache: a connector handle of its keys and
    values, bf16 ``[2, layers, tokens, kv_heads, head_dim]`` (keys first), and the RoPE
    position the next token takes. A context whose first ``prefix_length`` tokens are a
    context of their own (the text-dropped context inside the full one) says where that
    one ends: ``prefix_length`` tokens, ``prefix_rope``."""

    kv: ConnectorHandle
    rope: int
    prefix_length: int = 0
    prefix_rope: int = 0


class TraceContext(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """The W3C trace context of the caller's span (``omni_runtime.tracing``): the
    ``traceparent`` and ``tracestate`` headers' values, so that the stage's spans of a
    request join the router's trace."""

    traceparent: str
    tracestate: str = ""


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
    # Image-to-image input: uint8 RGB, [height, width, 3].
    image: np.ndarray | None = None
    # Text conditioning computed upstream (an LLM stage's hidden states), [tokens, width];
    # replaces the pipeline's own text encoder for this request.
    prompt_embeds: np.ndarray | None = None
    # The negative prompt's, for guidance (from the same upstream stage), [tokens, width].
    negative_prompt_embeds: np.ndarray | None = None
    arrival_time: float = 0.0
    # BAGEL: the thinker's context KV cache (the full context, with the text-dropped one
    # as its prefix) and the image-dropped context's, fetched by the core itself (shared
    # memory: read in place, no copy). Last, as every field added to an array-like struct
    # is: a peer of an older revision reads the fields it knows and ignores the rest.
    context_kv: ContextKVRef | None = None
    no_image_context_kv: ContextKVRef | None = None


class StageDiffusionCoreOutput(StageCoreOutput):
    """A finished diffusion request: images, or why there are none."""

    request_id: str
    # uint8 RGB, [num_images, height, width, 3].
    images: np.ndarray | None = None
    # Why there are no images: a refused request, or one that broke.
    error: StageError | None = None
    aborted: bool = False
    # Seconds spent in the pipeline (0 for refused requests).
    execute_time: float = 0.0


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


class StageServerRequest(StageCoreRequest):
    """A request to a stage server (a stage's replica as routers reach it, over TCP).

    One type for every stage kind, in the caller's terms (text, chat messages, images,
    handles of upstream arrays): the server turns it into its core's own request
    (tokenizing for an LLM, fetching ``prompt_embeds`` through a connector for a
    diffusion stage), so that a router needs neither the model nor ML libraries.
    """

    request_id: str
    prompt: str | None = None
    # Chat messages, [{"role": ..., "content": ...}] (LLM stages: the chat template).
    messages: list[dict[str, str]] | None = None
    # Sampling params, merged over the stage's defaultSamplingParams by the server.
    params: dict[str, Any] = {}
    # Image-to-image input: uint8 RGB, [height, width, 3].
    image: np.ndarray | None = None
    # An upstream stage's hidden states, to fetch through their connector.
    prompt_embeds: ConnectorHandle | None = None
    # The same stage's hidden states of the request's negative prompt (guidance).
    negative_prompt_embeds: ConnectorHandle | None = None
    # LLM hidden-states stages: the connector that carries them to the next stage.
    output_connector: str | None = None
    # LLM generate stages: whether the caller reads the text as it is generated. False:
    # one output when the request finishes, with all of its text and token ids (a stage
    # that feeds another, or a caller that does not stream, needs no more).
    stream: bool = True
    # BAGEL's DiT: the thinker's context KV caches (StageDiffusionCoreRequest's fields).
    context_kv: ContextKVRef | None = None
    no_image_context_kv: ContextKVRef | None = None
    # The router's span of this stage call, when it traces. Last, as every field added
    # here: a frame without it decodes with None, and an older peer ignores it.
    trace_context: TraceContext | None = None


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
    # Diffusion stages: uint8 RGB, [num_images, height, width, 3].
    images: np.ndarray | None = None
    # Hidden-states stages: where the next stage fetches them.
    prompt_embeds: ConnectorHandle | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Seconds the stage spent on the request (0 for refused requests).
    execute_time: float = 0.0
    # BAGEL thinker stages: where the DiT fetches the prompt's context KV.
    context_kv: ContextKVRef | None = None


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


class StageServerOutputs(StageCoreOutputs):
    """One message from a stage server."""

    outputs: list[StageServerOutput] = []
    utility_output: StageUtilityOutput | None = None
    load: StageLoad | None = None
    # Set when the stage's core died: every request in flight on this server has failed.
    engine_dead: str | None = None
    timestamp: float = 0.0
