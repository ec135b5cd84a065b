"""StageFrontend: what a stage server asks of the stage it serves, whatever its kind.

A stage server speaks one protocol for every stage (StageServerRequest in,
StageServerOutput out); a frontend turns that into its core client's own requests and
back. The LLM frontend tokenizes, detokenizes and puts hidden states into a connector; the
diffusion frontend fetches upstream hidden states through their connector and returns
images. Each is a module of this package (``llm_frontend``, ``diffusion_frontend``); this
module holds what they share.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any

from opentelemetry.trace import Span, SpanKind

from omni_runtime import tracing
from omni_runtime.adapters import AdapterLRU
from omni_runtime.config import PipelineConfig, StageConfig
from omni_runtime.connectors import StageConnectors
from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase
from omni_runtime.engine.stage.stage_core_types import (
    StageAdapter,
    StageError,
    StageServerOutput,
    StageServerRequest,
)
from omni_runtime.tracing import SpanScope

logger = logging.getLogger(__name__)


def refusal(request_id: str, error: StageError) -> StageServerOutput:
    """The one, final output of a request the stage will not run."""
    return StageServerOutput(
        request_id=request_id, finished=True, finish_reason="error", error=error
    )


def stage_connector_names(pipeline: PipelineConfig, stage: StageConfig) -> set[str]:
    """The connectors ``stage`` uses: those it takes input through, and those later
    stages take its output through."""
    names = set(stage.input_connectors.values())
    for other in pipeline.stages:
        connector = other.input_stages.get(stage.stage_id)
        if connector is not None:
            names.add(connector)
    return names


class RequestSpans:
    """The stage's side of one request's trace: its connector hand-offs, its wait in the
    queue (from its arrival, or from the end of its connector gets, to the start of its
    execution) and its execution, all children of the router's span of the stage call
    (the request's ``trace_context``).

    The core runs in another process and reports only when a request ran (vLLM's
    scheduling events, the diffusion engine's ``execute_time``), so the queue span is
    recorded once the start is known, and the execution span starts at that moment. A
    frontend makes one per request only while tracing is on (:meth:`of`)."""

    __slots__ = (
        "_attributes",
        "_execute",
        "_execute_ns",
        "_finished",
        "_parent",
        "_queued_ns",
        "_stage",
    )

    def __init__(self, stage: StageConfig, request: StageServerRequest) -> None:
        context = request.trace_context
        self._parent = (
            tracing.parent_context(context.traceparent, context.tracestate) if context else None
        )
        self._stage = stage.name
        self._attributes: dict[str, str | int] = {
            tracing.REQUEST_ID: request.request_id,
            tracing.STAGE_NAME: stage.name,
            tracing.STAGE_ID: stage.stage_id,
        }
        self._queued_ns = time.time_ns()
        self._execute: Span | None = None
        self._execute_ns: int | None = None
        self._finished = False

    @classmethod
    def of(cls, stage: StageConfig, request: StageServerRequest) -> RequestSpans | None:
        return cls(stage, request) if tracing.enabled() else None

    def connector_put(self, connector: str) -> SpanScope:
        """The producer's put of a hand-off (within the execution, where it has begun). Its
        size, known once it is done, is the caller's to set."""
        attributes = {**self._attributes, tracing.CONNECTOR_NAME: connector}
        parent = self._parent
        if self._execute is not None:
            parent = tracing.context_of(self._execute)
        return tracing.span(
            "connector put", parent=parent, kind=SpanKind.PRODUCER, attributes=attributes
        )

    def connector_get(self, connector: str, nbytes: int, duration_ns: int) -> None:
        """The consumer's get of its hand-offs, which its core made in ``duration_ns`` as it
        began executing the request (after :meth:`started`)."""
        attributes = {**self._attributes, tracing.CONNECTOR_NAME: connector, tracing.BYTES: nbytes}
        parent = self._parent
        if self._execute is not None:
            parent = tracing.context_of(self._execute)
        span = tracing.start_span(
            "connector get",
            parent=parent,
            kind=SpanKind.CONSUMER,
            attributes=attributes,
            start_ns=self._execute_ns,
        )
        span.end(end_time=(self._execute_ns or time.time_ns()) + duration_ns)

    def queued(self) -> None:
        """The request goes into the core's queue now."""
        self._queued_ns = time.time_ns()

    def started(self, at_ns: int | None = None) -> None:
        """The core started executing the request (at ``at_ns``, else now): the queue
        span ends and the execution span begins. Only the first call counts."""
        if self._execute is not None or self._finished:
            return
        at_ns = max(self._queued_ns, at_ns if at_ns is not None else time.time_ns())
        self._execute_ns = at_ns
        self._record_queue(at_ns)
        self._execute = tracing.start_span(
            f"stage {self._stage} execute",
            parent=self._parent,
            attributes=self._attributes,
            start_ns=at_ns,
        )

    def finished(self, output: StageServerOutput) -> None:
        """The request's final output: the execution ends, failed if it did. One that
        never ran (refused, aborted in the queue) has its wait alone."""
        if self._finished:
            return
        error = output.error
        if self._execute is None and (error is not None or output.finish_reason == "abort"):
            message = f"{error.code.value}: {error.message}" if error else None
            self._record_queue(time.time_ns(), error=message, aborted=error is None)
            self._finished = True
            return
        if self._execute is None:
            # The core did not say when it began (an engine without scheduling events):
            # all of it counts as execution.
            self.started(self._queued_ns)
        assert self._execute is not None
        if error is not None:
            tracing.fail(self._execute, f"{error.code.value}: {error.message}")
        elif output.finish_reason == "abort":
            self._execute.set_attribute("omni.aborted", True)
        self._execute.end()
        self._finished = True

    def aborted(self) -> None:
        """The request was aborted (its caller went away, or the stage is draining)."""
        if self._finished:
            return
        if self._execute is None:
            self._record_queue(time.time_ns(), aborted=True)
        else:
            self._execute.set_attribute("omni.aborted", True)
            self._execute.end()
        self._finished = True

    def _record_queue(self, end_ns: int, error: str | None = None, aborted: bool = False) -> None:
        queue = tracing.start_span(
            f"stage {self._stage} queue",
            parent=self._parent,
            attributes=self._attributes,
            start_ns=self._queued_ns,
        )
        if aborted:
            queue.set_attribute("omni.aborted", True)
        if error is not None:
            tracing.fail(queue, error)
        queue.end(end_time=end_ns)


class StageFrontend(ABC):
    """One stage's core client behind the stage server protocol."""

    # Set by __init__ where the stage takes LoRA adapters (below).
    adapters: AdapterLRU | None = None

    def __init__(
        self,
        pipeline: PipelineConfig,
        stage: StageConfig,
        client: StageCoreClientBase,
        connectors: StageConnectors,
    ) -> None:
        self.pipeline = pipeline
        self.stage = stage
        self.client = client
        self.connectors = connectors
        capacity = pipeline.adapter_capacity(stage)
        # The LoRA adapters this replica holds, least recently used first, as the frontend
        # sent them to its core (whose own cache has the same capacity and order): what
        # the stage server tells routers, which prefer a replica that holds a request's.
        self.adapters = AdapterLRU(capacity) if capacity else None

    @property
    def size_multiple(self) -> int:
        """What the sizes this stage makes must be multiples of (StageLoad.size_multiple);
        0: it makes none, or cannot say."""
        return 0

    @property
    def held_adapters(self) -> list[str]:
        """The adapters this replica holds, least recently used first."""
        return self.adapters.names() if self.adapters is not None else []

    def adapter_refusal(self, request: StageServerRequest) -> StageError | None:
        """Why ``request``'s adapter cannot run here (the stage takes none), or None."""
        if request.adapter is None or self.adapters is not None:
            return None
        why = self.pipeline.adapter_stage_issue(self.stage) or (
            "no adapter is declared for it and its maxLoras is unset"
        )
        return StageError.bad_request(
            f"stage {self.stage.name!r} takes no LoRA adapters ({why}); adapter "
            f"{request.adapter.name!r} cannot run on it",
            "model",
        )

    @abstractmethod
    async def add(self, request: StageServerRequest) -> list[StageServerOutput]:
        """Start ``request``; returns its outputs at once if the stage refuses it."""

    @abstractmethod
    async def next_outputs(self) -> list[StageServerOutput]:
        """Wait for the core's next outputs. Raises StageCoreDeadError once it is gone."""

    @abstractmethod
    async def abort(self, request_ids: list[str]) -> None:
        """Stop the given requests, and drop whatever they left in a connector."""

    @property
    @abstractmethod
    def in_flight(self) -> int:
        """Requests started and not yet finished."""

    def unstarted(self) -> list[str]:
        """Ids of requests taken but not yet being executed, which a draining server
        hands back to be run elsewhere. None by default: an engine that batches (vLLM)
        runs what it takes at once, and those requests finish where they are."""
        return []

    def check_health(self) -> None:
        self.client.check_health()

    # Utility methods this frontend answers itself, from what it holds (the tokenizer, the
    # adapters); the stage server sends any other utility call to the core's collective_rpc.
    frontend_methods: frozenset[str] = frozenset({"load_adapter"})

    async def frontend_call(self, method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The answer to one of ``frontend_methods``: a result, or ``{"error", "param"}``
        for input the stage refuses (a router answers it with a 400)."""
        if method != "load_adapter":
            raise NotImplementedError(method)
        adapter = StageAdapter(
            str(kwargs.get("name")), str(kwargs.get("source")), float(kwargs.get("scale", 1.0))
        )
        if self.adapters is None:
            error = self.adapter_refusal(StageServerRequest(request_id="", adapter=adapter))
            assert error is not None
            return {"error": error.message, "param": "stage"}
        why = await self.load_adapter(adapter)
        return {} if why is None else {"error": why, "param": "lora_path"}

    async def load_adapter(self, adapter: StageAdapter) -> str | None:
        """Load ``adapter`` now (a load at run time, which refuses what cannot load, as
        vLLM's /v1/load_lora_adapter does); why it cannot be loaded, or None."""
        return f"stage {self.stage.name!r} cannot load adapters"

    def shutdown(self) -> None:
        self.client.shutdown()
