"""The stage wire's base types: the markers every stage core's types derive from, the
error a stage returns, and a hand-off (an LLM request carries them too). Import them from
``stage_core_types``; they live here so that the LLM types (``_stage_llm_core_types``,
which subclass vLLM's) can use them without importing ``stage_core_types``, which
resolves those LLM types lazily: no import cycle.
"""

from __future__ import annotations

import enum

import msgspec

from omni_runtime.connectors.base import ConnectorHandle


class StageErrorCode(enum.Enum):
    """What kind of failure a StageError reports: what its receiver may do about it (the
    router answers with an HTTP status per code)."""

    # The request is wrong (a field, or its kind for this stage): sending it again will
    # fail again. ``param`` names the field where one is at fault.
    BAD_REQUEST = "bad_request"
    # An unfinished request holds this request's id; the first one goes on.
    REQUEST_ID_IN_FLIGHT = "request_id_in_flight"
    # The stage broke on the request (the engine failed, a connector did): not the
    # request's fault.
    STAGE_FAILED = "stage_failed"
    # The stage takes no requests now (its core is gone).
    UNAVAILABLE = "unavailable"
    # The replica is draining (its pod is going away) and handed the request back without
    # starting it: another replica of the stage may run it, and the router retries there.
    DRAINING = "draining"


class StageError(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """Why a stage did not run a request, as data: receivers branch on ``code`` and read
    ``param``, never the message, which is for people ("params.height: Expected `int` >= 1")."""

    code: StageErrorCode
    message: str
    # The request's field at fault, a sampling parameter by its own name ("height",
    # "temperature"; "prompt", "messages" for the prompt itself).
    param: str | None = None

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> StageError:
        return cls(StageErrorCode.BAD_REQUEST, message, param)

    def __str__(self) -> str:
        return self.message


class StageCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Marker: a request to a stage core of any kind."""


class StageCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Marker: one request's output from a stage core of any kind."""


class StageCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Marker: one message of outputs from a stage core of any kind."""


class HandOff(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """One array a stage hands the next through a connector: where it lies (``handle``:
    the consumer's core fetches it, onto its own device), and the few numbers a reader needs
    beside the array (BAGEL's context KV: the RoPE position the next token takes, ``rope``,
    and where the text-dropped context inside it ends, ``prefix_length`` and
    ``prefix_rope``). Stages name their hand-offs and inputs by what the array is
    ("prompt_embeds", "context_kv"); the router passes them on without reading them."""

    handle: ConnectorHandle
    meta: dict[str, int] = {}
