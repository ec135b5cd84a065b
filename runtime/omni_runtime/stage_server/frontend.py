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
from abc import ABC, abstractmethod

from omni_runtime.config import PipelineConfig, StageConfig
from omni_runtime.connectors import StageConnectors
from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase
from omni_runtime.engine.stage.stage_core_types import (
    StageError,
    StageServerOutput,
    StageServerRequest,
)

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


class StageFrontend(ABC):
    """One stage's core client behind the stage server protocol."""

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

    def shutdown(self) -> None:
        self.client.shutdown()
