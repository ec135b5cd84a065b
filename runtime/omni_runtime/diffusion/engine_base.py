"""What every diffusion engine shares (the diffusers pipelines' DiffusionEngine, BAGEL's, and
code2wav's): the config it is built from, the ids of the requests in flight and which of them
are aborted, fetching a request's handed-off inputs, turning a request into exactly one
output whatever happens to it, and the device it computes on.

Inputs an upstream stage handed off (``StageDiffusionCoreRequest.inputs``) are fetched here,
in the core, by the request's turn: straight from the producer onto the engine's device in
the dtype it computes in. A request that ends before it runs (refused, aborted) fetches and
drops them, so that the producer's copy goes at once, not at its connector's expiry.

The engine owns validation: a request is checked against the loaded model before any
compute, and a bad one becomes an error output naming the field (``StageError.param``). It
also owns the ids of the requests in flight and which of them are aborted. Both the
out-of-process core and the inline client admit, abort and run requests through it
(:meth:`DiffusionEngineBase.admit`, :meth:`~DiffusionEngineBase.abort`,
:meth:`~DiffusionEngineBase.execute`), so they answer alike.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import msgspec
import numpy as np

from omni_runtime.config import STEP_CACHE_OFF, ConnectorConfig
from omni_runtime.connectors import ConnectorError, StageConnectors
from omni_runtime.diffusion.adapters import AdapterLoadError
from omni_runtime.diffusion.params import InvalidRequestError
from omni_runtime.diffusion.step_cache import StepCacheTier
from omni_runtime.engine.stage.stage_core_client import request_id_in_flight_error
from omni_runtime.engine.stage.stage_core_types import (
    StageAdapter,
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
    StageError,
    StageErrorCode,
)

logger = logging.getLogger(__name__)

# Where an engine sends a request's partial images (outputs with partial_index set).
PartialEmit = Callable[[StageDiffusionCoreOutput], None]


_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "auto": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}


class DiffusionEngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a diffusion engine is built from (sent to a core proc as JSON)."""

    model: str
    # auto: the engine's choice (float32 for a diffusers pipeline, bf16 for BAGEL).
    dtype: str = "auto"
    # Merged under each request's own params (the pipeline's defaultSamplingParams).
    default_params: dict[str, Any] = {}
    # torch intra-op threads; None keeps torch's default.
    num_threads: int | None = None
    # "auto": the first visible GPU if there is one (the stage's process sees only its
    # `devices`), else the CPU; "cpu" forces the CPU; "cuda" / "cuda:N" insist on a GPU.
    device: str = "auto"
    # The stage's gpuMemoryUtilization: on a GPU, the fraction of its memory this process
    # may allocate (the share the pipeline was admitted with); None: uncapped.
    gpu_memory_utilization: float | None = None
    # The model family (omni_runtime.families) whose pipeline the checkpoint holds; None: any
    # other pipeline, which must then be of no known family.
    family: str | None = None
    # Whether an encoder stage upstream computes the text embeddings: a family's
    # checkpoint is then loaded without its text components (the encoder stage has them).
    text_from_upstream: bool = False
    # The pipeline's connectors (name -> {"name": class, "extra": {...}}), through which
    # the engine fetches what upstream stages handed off.
    connectors: dict[str, dict[str, Any]] = {}
    # The most requests one pipeline call runs together (the stage's maxNumSeqs; 1: each
    # alone, as the seed's DiT runs).
    max_batch: int = 1
    # The stage's stepCache: its tiers by name, and the tier of a request that names none.
    step_cache_tiers: dict[str, StepCacheTier] = {}
    step_cache_default: str = STEP_CACHE_OFF
    # The stage's torchCompile: the transformer's repeated blocks compiled (regionally).
    torch_compile: bool = False
    # The LoRA adapters the engine holds injected at once (the stage's adapter capacity,
    # least recently used evicted); 0: the stage takes none.
    max_loras: int = 0


class UpstreamInputError(Exception):
    """An input an upstream stage left for a request is gone or unreachable: not the
    caller's fault, and not one a resend to this stage fixes. ``name`` is the input's: the
    router, seeing it named, runs the request again from the first stage."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


class RequestAbortedError(Exception):
    """Raised inside the pipeline's step callback to stop an aborted request."""


class DiffusionEngineBase(abc.ABC):
    """What every diffusion engine shares: the ids of the requests in flight, which of them
    are aborted, and turning a request into exactly one output whatever happens to it.

    A subclass loads its model and implements :meth:`validate` (the effective params, or
    InvalidRequestError naming the field), :meth:`_run` (the images; RequestAbortedError
    once ``should_abort()`` says so) and :meth:`describe`.
    """

    # Where the engine computes, and in what dtype: fetched inputs land there as that.
    device: str
    compute_dtype: Any
    # What _run returns: images (uint8 [n, height, width, 3], a clip's frames), or sound
    # (float32 mono samples: code2wav's waveform), which outputs carry as their ``audio``.
    makes_audio: bool = False

    def __init__(self, connectors: dict[str, dict[str, Any]]) -> None:
        # Requests admitted and not yet answered, and those of them aborted. Requests
        # arrive on one thread (the core's input thread, the inline client's event loop)
        # while another runs them (the busy loop, the inline client's worker).
        self._lock = threading.Lock()
        self._admitted: set[str] = set()
        self._aborted: set[str] = set()
        self._connectors = StageConnectors(
            {name: ConnectorConfig.model_validate(c) for name, c in connectors.items()}
        )
        # Seconds the running request has spent fetching its inputs (reported with it).
        self._fetch_time = 0.0

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """Plain facts about the loaded model (answered over collective_rpc)."""

    @abc.abstractmethod
    def validate(self, request: StageDiffusionCoreRequest) -> Any:
        """The request's effective parameters; InvalidRequestError naming the field if bad."""

    @abc.abstractmethod
    def _run(
        self,
        request: StageDiffusionCoreRequest,
        params: Any,
        should_abort: Callable[[], bool],
        emit: PartialEmit | None = None,
    ) -> np.ndarray:
        """The request's images, uint8 [num_images, height, width, 3]; its partial images,
        where it asks for them and the engine makes them, to ``emit`` on the way."""

    def fetch(
        self,
        request: StageDiffusionCoreRequest,
        name: str,
        private: bool = False,
        dtype: Any = None,
    ) -> Any:
        """The input ``name`` handed off for ``request``, as a tensor on the engine's device
        in its compute dtype; UpstreamInputError if it cannot be fetched. ``private``: in
        memory of its own, never a view of the connector's (shared memory is read in place
        on a CPU). ``dtype``: the torch dtype to land in instead of the compute dtype, for
        an input that is no activation (code2wav's integer codes, which a float would
        round)."""
        hand_off = request.inputs[name]
        start = time.perf_counter()
        try:
            connector = self._connectors.get(hand_off.handle.connector)
            fetched = connector.get(hand_off.handle, self.device)
            tensor = fetched.to(self.compute_dtype if dtype is None else dtype)
            if private and tensor.data_ptr() == fetched.data_ptr():
                tensor = tensor.clone()
        except (ConnectorError, KeyError) as e:
            self._discard(request)
            raise UpstreamInputError(name, str(e)) from None
        finally:
            self._fetch_time += time.perf_counter() - start
        return tensor

    def _discard(self, request: StageDiffusionCoreRequest) -> None:
        """Free what ``request`` holds upstream: it ends before it ran (refused, aborted,
        an input lost). A get releases the producer's copy; what is fetched goes with it."""
        for hand_off in request.inputs.values():
            # Gone already, or never reachable: nothing left to free here.
            with contextlib.suppress(ConnectorError, KeyError, ValueError):
                self._connectors.get(hand_off.handle.connector).get(hand_off.handle, "cpu")

    def close(self) -> None:
        """Release what the engine holds beyond its model (connections)."""
        self._connectors.close()

    def admit(self, request_id: str) -> StageDiffusionCoreOutput | None:
        """Take ``request_id`` as in flight until :meth:`execute` answers it; or, if an
        unfinished request holds the id, the refusal to send instead (the first goes on)."""
        with self._lock:
            if request_id in self._admitted:
                return StageDiffusionCoreOutput(
                    request_id=request_id, error=request_id_in_flight_error(request_id)
                )
            self._admitted.add(request_id)
        return None

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort the given admitted requests: a running one at its next step, a waiting one
        as soon as it would start. Ids not in flight are ignored."""
        with self._lock:
            self._aborted.update(i for i in request_ids if i in self._admitted)

    def abort_all(self) -> None:
        with self._lock:
            self._aborted.update(self._admitted)

    def execute(
        self, request: StageDiffusionCoreRequest, emit: PartialEmit | None = None
    ) -> StageDiffusionCoreOutput:
        """Run one (admitted) request to completion, and release its id. Never raises for a
        request's own problems: a refused, failed or aborted request becomes an output
        saying so. ``emit`` gets each partial image the request asks for, as an output of
        its own (``partial_index`` set), before the final one returns."""
        request_id = request.request_id
        try:
            return self._execute(request, lambda: request_id in self._aborted, emit)
        finally:
            with self._lock:
                self._admitted.discard(request_id)
                self._aborted.discard(request_id)

    def batch_key(self, request: StageDiffusionCoreRequest) -> Hashable | None:
        """What a request must share with others to run in one pipeline call with them;
        None: it runs alone (this engine batches nothing, or the request cannot be)."""
        return None

    def adapter_ready(self, request: StageDiffusionCoreRequest) -> bool:
        """Whether ``request`` can run now without waiting for its LoRA adapter to be read
        (safe from any thread). Where it must wait, the read starts (if not under way): a
        scheduler runs other requests meanwhile, and is told when a read ends through
        :meth:`notify_adapter_reads`. An engine without adapters has nothing to wait on."""
        return True

    def notify_adapter_reads(self, on_read: Callable[[], None] | None) -> None:
        """Have ``on_read`` called (from another thread) each time an adapter's read ends
        (never, in an engine that reads none)."""
        return None

    def held_adapters(self) -> list[str]:
        """The LoRA adapters the engine holds, least recently used first."""
        return []

    def check_adapter(self, name: str, source: str, scale: float) -> str | None:
        """Why adapter ``name`` from ``source`` cannot load into this engine, or None once
        it is read and checked (kept for its first request): a utility call, for a load at
        run time that refuses what cannot load."""
        return f"this stage ({type(self).__name__}) takes no LoRA adapters"

    def _use_adapter(self, adapter: StageAdapter | None) -> None:
        """Set the model up for the next run's adapter (None: its weights alone), on the
        engine's thread; InvalidRequestError or AdapterLoadError if it cannot be."""
        if adapter is not None:
            raise InvalidRequestError(
                f"model: this stage ({type(self).__name__}) takes no LoRA adapters "
                f"(asked for {adapter.name!r})",
                "model",
            )

    def execute_batch(
        self, requests: Sequence[StageDiffusionCoreRequest], emit: PartialEmit | None = None
    ) -> list[StageDiffusionCoreOutput]:
        """Run (admitted) requests of one batch_key in one pipeline call, each answered as
        :meth:`execute` answers it alone; an aborted one is answered aborted and the others
        go on. One request runs as :meth:`execute` runs it."""
        if len(requests) == 1:
            return [self.execute(requests[0], emit)]
        ids = [request.request_id for request in requests]
        try:
            return self._execute_batch(requests, emit)
        finally:
            with self._lock:
                self._admitted.difference_update(ids)
                self._aborted.difference_update(ids)

    def _execute_batch(
        self, requests: Sequence[StageDiffusionCoreRequest], emit: PartialEmit | None
    ) -> list[StageDiffusionCoreOutput]:
        answers: dict[str, StageDiffusionCoreOutput] = {}
        runnable: list[tuple[StageDiffusionCoreRequest, Any]] = []
        for request in requests:
            request_id = request.request_id
            try:
                params = self.validate(request)
            except InvalidRequestError as e:
                self._discard(request)
                answers[request_id] = StageDiffusionCoreOutput(request_id=request_id, error=e.error)
                continue
            if request_id in self._aborted:
                self._discard(request)
                answers[request_id] = StageDiffusionCoreOutput(request_id=request_id, aborted=True)
                continue
            runnable.append((request, params))
        ids = [request.request_id for request, _ in runnable]
        start = time.perf_counter()
        self._fetch_time = 0.0
        refused = self._adapter_refusal([request for request, _ in runnable])
        if refused is not None:
            for request, _ in runnable:
                self._discard(request)
                answers[request.request_id] = StageDiffusionCoreOutput(
                    request_id=request.request_id, error=refused
                )
            runnable, ids = [], []
        try:
            if runnable:
                outputs = self._run_batch(
                    [request for request, _ in runnable],
                    [params for _, params in runnable],
                    lambda: all(request_id in self._aborted for request_id in ids),
                    emit,
                )
        except Exception as e:
            for request_id in ids:
                answers[request_id] = _failure(request_id, e)
        else:
            elapsed = time.perf_counter() - start
            for index, request_id in enumerate(ids):
                # Aborted while its batch ran: dropped, the others untouched.
                answers[request_id] = (
                    StageDiffusionCoreOutput(request_id=request_id, aborted=True)
                    if request_id in self._aborted
                    else self._made(request_id, outputs[index], elapsed)
                )
        return [answers[request.request_id] for request in requests]

    def _run_batch(
        self,
        requests: list[StageDiffusionCoreRequest],
        params: list[Any],
        all_aborted: Callable[[], bool],
        emit: PartialEmit | None,
    ) -> list[np.ndarray]:
        """The requests' outputs in one pipeline call, in order: each one's image (as an
        array of one), or its clip's frames; partial images (the batch's requests ask for
        as many) and progress through ``emit``."""
        raise NotImplementedError(f"{type(self).__name__} runs no batches")

    def _execute(
        self,
        request: StageDiffusionCoreRequest,
        should_abort: Callable[[], bool],
        emit: PartialEmit | None,
    ) -> StageDiffusionCoreOutput:
        request_id = request.request_id
        try:
            params = self.validate(request)
        except InvalidRequestError as e:
            self._discard(request)
            return StageDiffusionCoreOutput(request_id=request_id, error=e.error)
        if should_abort():
            self._discard(request)
            return StageDiffusionCoreOutput(request_id=request_id, aborted=True)
        start = time.perf_counter()
        self._fetch_time = 0.0
        refused = self._adapter_refusal([request])
        if refused is not None:
            self._discard(request)
            return StageDiffusionCoreOutput(request_id=request_id, error=refused)
        try:
            made = self._run(request, params, should_abort, emit)
        except Exception as e:  # a request that breaks the pipeline must not kill the stage
            return _failure(request_id, e)
        return self._made(request_id, made, time.perf_counter() - start)

    def _adapter_refusal(self, requests: Sequence[StageDiffusionCoreRequest]) -> StageError | None:
        """The model set up for the adapter of ``requests`` (of one batch: one adapter),
        or why they cannot run with it: the error each of them gets."""
        if not requests:
            return None
        try:
            self._use_adapter(requests[0].adapter)
        except (InvalidRequestError, AdapterLoadError) as e:
            return e.error
        return None

    def _made(self, request_id: str, made: np.ndarray, elapsed: float) -> StageDiffusionCoreOutput:
        """The output of a request that ran: its images, or its sound (``makes_audio``)."""
        output = StageDiffusionCoreOutput(
            request_id=request_id, execute_time=elapsed, fetch_time=self._fetch_time
        )
        if self.makes_audio:
            output.audio = made
        else:
            output.images = made
        return output


def _failure(request_id: str, error: Exception) -> StageDiffusionCoreOutput:
    """The output of a request whose run raised ``error``."""
    if isinstance(error, RequestAbortedError):
        return StageDiffusionCoreOutput(request_id=request_id, aborted=True)
    if isinstance(error, UpstreamInputError):
        failed = StageError(StageErrorCode.STAGE_FAILED, str(error), error.name)
        return StageDiffusionCoreOutput(request_id=request_id, error=failed)
    if isinstance(error, ValueError):
        # diffusers' own input checks (check_inputs) raise ValueError.
        return StageDiffusionCoreOutput(
            request_id=request_id, error=StageError.bad_request(f"pipeline: {error}")
        )
    logger.error("request %s failed", request_id, exc_info=error)
    failure = f"the pipeline failed: {type(error).__name__}: {error}"
    return StageDiffusionCoreOutput(
        request_id=request_id, error=StageError(StageErrorCode.STAGE_FAILED, failure)
    )


def torch_dtype(name: str) -> Any:
    """The torch dtype a config's ``dtype`` names; InvalidRequestError if none."""
    import torch

    if name not in _DTYPES:
        raise InvalidRequestError(f"dtype: {name!r} is not one of {sorted(_DTYPES)}", "dtype")
    return getattr(torch, _DTYPES[name])


def engine_device(config: DiffusionEngineConfig) -> str:
    """The device an engine of ``config`` runs on, chosen before it moves its model there:
    on a GPU, the process is first capped at the stage's share of its memory, so that the
    weights count against the share too."""
    device = choose_device(config.device)
    cap_gpu_memory(device, config.gpu_memory_utilization)
    return device


def cap_gpu_memory(device: str, fraction: float | None) -> None:
    """Cap this process's allocations on ``device`` at ``fraction`` of the GPU's memory:
    the stages sharing the GPU were admitted on the shares they declared, and an uncapped
    DiT would take the room an LLM stage's KV cache was promised. A no-op on the CPU and
    without a fraction."""
    if fraction is None or not device.startswith("cuda"):
        return
    import torch

    index = torch.device(device).index
    # "cuda" names no index: the current device, the first the process sees.
    torch.cuda.set_per_process_memory_fraction(
        fraction, index if index is not None else torch.cuda.current_device()
    )
    logger.info("capped this process at %g of the memory of %s", fraction, device)


def choose_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError(
            f"device: {device!r} asked for, but no GPU is visible to this process "
            "(check CUDA_VISIBLE_DEVICES and the stage's devices)",
            "device",
        )
    return device
