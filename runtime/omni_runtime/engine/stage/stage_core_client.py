"""StageCoreClientBase: the one contract every stage client meets.

The router, the replica pool and the tests talk to a stage only through this contract,
whatever runs behind it: a vLLM engine core in a child process (the LLM clients), a
diffusers pipeline in a child process (StageDiffusionCoreClient), the same pipeline in the
caller's process (InlineStageDiffusionClient), or a stage replica in another pod.
Method names and signatures follow vLLM's ``EngineCoreClient`` so that the LLM clients get
most of them from vLLM's ``AsyncMPClient``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from omni_runtime.engine.stage.stage_core_types import (
    StageCoreOutputs,
    StageCoreRequest,
    StageError,
    StageErrorCode,
)


class StageCoreDeadError(RuntimeError):
    """The stage core behind a client is gone; no request on it will complete."""


class StageCoreStartupError(RuntimeError):
    """A stage core did not become ready: it failed, died or timed out while starting."""


def request_id_in_flight_error(request_id: str) -> StageError:
    """The error of a request whose id an unfinished request holds."""
    return StageError(
        StageErrorCode.REQUEST_ID_IN_FLIGHT,
        f"request_id: {request_id!r} is in flight already; use an id of its own",
        param="request_id",
    )


class StageCoreClientBase(ABC):
    """What the rest of the system may ask of a stage."""

    @abstractmethod
    async def add_request_async(self, request: StageCoreRequest) -> None:
        """Queue ``request``; its output arrives through :meth:`get_outputs_async`.

        A request id is the caller's to choose, unique among unfinished requests: a request
        reusing one is answered with an error output under that id, and the first goes on.
        """

    @abstractmethod
    async def get_outputs_async(self) -> StageCoreOutputs:
        """Wait for the next outputs message. Raises StageCoreDeadError once the core dies."""

    @abstractmethod
    def get_outputs_nowait(self) -> StageCoreOutputs | None:
        """The next outputs message if one is ready, else None (never blocks)."""

    @abstractmethod
    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Stop the given requests; each still yields an output (marked aborted)."""

    @abstractmethod
    async def collective_rpc_async(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run ``method`` on the stage's engine and return its (plain-data) result."""

    @abstractmethod
    def check_health(self) -> None:
        """Return if the stage core is alive; raise StageCoreDeadError if not."""

    @property
    def draining(self) -> bool:
        """The stage said it takes no new requests (it finishes those it has, then goes
        away). Only a remote stage says so; a pool sends such a replica nothing new."""
        return False

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the stage core and release every socket, thread and process. Idempotent."""
