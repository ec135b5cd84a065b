"""DiffusionEngine: one local diffusers pipeline, served request by request.

A pipeline of a known family (``omni_runtime.families``) fed by an encoder stage is loaded
without its text encoder, tokenizer and processor, and takes the encoder's embeddings (and
the negative prompt's, for guidance) the way the family's pipeline takes its own: padded
with a mask, or as rows (the family's DiTRecipe). Any other pipeline takes upstream hidden
states as ``prompt_embeds`` as they are.

Inputs an upstream stage handed off (``StageDiffusionCoreRequest.inputs``) are fetched here,
in the core, by the request's turn: straight from the producer onto the engine's device in
the dtype it computes in. A request that ends before it runs (refused, aborted) fetches and
drops them, so that the producer's copy goes at once, not at its connector's expiry.

The engine owns validation: a request is checked against the loaded pipeline (sizes it can
make, whether it takes an input image, its conditioning width) before any compute, and a
bad one becomes an error output naming the field (``StageError.param``). It also owns the
ids of the requests in flight and which of them are aborted. Both the out-of-process core
and the inline client admit, abort and run requests through it
(:meth:`DiffusionEngine.admit`, :meth:`~DiffusionEngine.abort`,
:meth:`~DiffusionEngine.execute`), so they answer alike.
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Annotated, Any, TypeVar

import msgspec
import numpy as np

from omni_runtime.config import STEP_CACHE_OFF, ConnectorConfig
from omni_runtime.connectors import ConnectorError, StageConnectors
from omni_runtime.diffusion.adapters import AdapterLoadError, DiTAdapters
from omni_runtime.diffusion.previews import PartialImages, partial_steps
from omni_runtime.diffusion.step_cache import StepCacheTier, step_cache
from omni_runtime.engine.stage.stage_core_client import request_id_in_flight_error
from omni_runtime.engine.stage.stage_core_types import (
    MAX_PARTIAL_IMAGES,
    InvalidStageRequestError,
    StageAdapter,
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
    StageError,
    StageErrorCode,
)
from omni_runtime.families import FAMILIES, Family, family_of_pipeline_class
from omni_runtime.images import to_uint8

logger = logging.getLogger(__name__)

# Where an engine sends a request's partial images (outputs with partial_index set).
PartialEmit = Callable[[StageDiffusionCoreOutput], None]

MAX_SIDE = 4096
MAX_IMAGES = 16
# A video's frames: Wan2.2's and HunyuanVideo-1.5's pipelines make 121 (5 s at 24 fps); a
# bound keeps one request from asking the DiT for hours of work.
MAX_FRAMES = 1024
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


class DiffusionParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The sampling parameters a diffusion request may carry (``params`` on the wire).

    None (or left out) is the loaded pipeline's own default, as its ``__call__`` has it;
    a parameter the pipeline does not take is refused by name."""

    height: Annotated[int, msgspec.Meta(ge=1, le=MAX_SIDE)] | None = None
    width: Annotated[int, msgspec.Meta(ge=1, le=MAX_SIDE)] | None = None
    num_inference_steps: Annotated[int, msgspec.Meta(ge=1, le=1000)] | None = None
    guidance_scale: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    # Qwen-Image's classifier-free guidance (> 1 with a negative prompt).
    true_cfg_scale: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    negative_prompt: str | None = None
    num_images: Annotated[int, msgspec.Meta(ge=1, le=MAX_IMAGES)] = 1
    # Image-to-image only: how far from the input image to go (1.0 ignores it).
    strength: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    # Z-Image's guidance knobs: renormalise the guided prediction to the conditional one's
    # norm, and stop guiding once this fraction of the steps is done.
    cfg_normalization: bool | None = None
    cfg_truncation: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    # The stage's step-cache tier to run with ("off": every step computed).
    step_cache: str | None = None
    # Partial images to send while the request runs (its stream's).
    partial_images: Annotated[int, msgspec.Meta(ge=0, le=MAX_PARTIAL_IMAGES)] | None = None
    # A video pipeline's frames.
    num_frames: Annotated[int, msgspec.Meta(ge=1, le=MAX_FRAMES)] | None = None
    # Send the share of steps done as the request runs (outputs with ``progress``): what a
    # video job's status reports.
    report_progress: bool | None = None


# The inputs a diffusers pipeline takes from upstream (its own argument names).
_EMBEDS = ("prompt_embeds", "negative_prompt_embeds")
# Parameters passed to the pipeline's __call__ under their own name when set.
_CALL_PARAMS = (
    "num_inference_steps",
    "guidance_scale",
    "true_cfg_scale",
    "strength",
    "cfg_normalization",
    "cfg_truncation",
    "num_frames",
)


class InvalidRequestError(InvalidStageRequestError):
    """A request the diffusion engine refuses."""


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


class DiffusionEngine(DiffusionEngineBase):
    """A diffusers pipeline loaded from a local directory, run one request at a time."""

    def __init__(self, config: DiffusionEngineConfig) -> None:
        import torch
        from diffusers import AutoPipelineForImage2Image, DiffusionPipeline

        self._torch_dtype = self.compute_dtype = torch_dtype(config.dtype)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        super().__init__(config.connectors)
        self.config = config
        parse_params(config.default_params, "defaultSamplingParams", DiffusionParams)
        self.family = _family(config.family)
        left_out: dict[str, None] = {}
        if self.family is not None and config.text_from_upstream:
            left_out = dict.fromkeys(self.family.dit.text_components)
        # A hub id is fetched into HF_HOME (without the left-out components' files).
        self.pipeline = DiffusionPipeline.from_pretrained(
            config.model,
            local_files_only=os.path.isdir(config.model),
            dtype=self._torch_dtype,
            **left_out,
        )
        _check_family(type(self.pipeline).__name__, self.family)
        self.device = engine_device(config)
        self.pipeline.to(self.device)
        self.pipeline.set_progress_bar_config(disable=True)
        self._img2img = None
        if self.family is None:
            try:
                self._img2img = AutoPipelineForImage2Image.from_pipe(self.pipeline)
                self._img2img.set_progress_bar_config(disable=True)
            except ValueError:
                pass  # this pipeline family has no image-to-image variant
        # A family whose input image needs another pipeline on the same weights.
        self._image_pipeline = None
        image_class = self.family.dit.image_pipeline_class if self.family is not None else None
        if image_class is not None:
            import diffusers

            self._image_pipeline = getattr(diffusers, image_class).from_pipe(self.pipeline)
            self._image_pipeline.set_progress_bar_config(disable=True)
        # What the pipeline's __call__ takes, so a parameter it would ignore or choke on
        # is refused by name instead.
        self._call_params = frozenset(inspect.signature(self.pipeline.__call__).parameters)
        # A pipeline whose guidance is its guider's (HunyuanVideo-1.5's): a request's
        # guidance_scale is set on the guider for its call instead of passed to __call__.
        self._guider_scale = "guidance_scale" not in self._call_params and hasattr(
            getattr(self.pipeline, "guider", None), "guidance_scale"
        )
        # A pipeline with no step callback (HunyuanVideo-1.5's): its steps are told by its
        # transformer's calls instead (_watched_steps), for aborts and progress.
        self._step_callback = "callback_on_step_end" in self._call_params
        # A pipeline that encodes the prompt's quoted text itself beside the upstream
        # embeddings (HunyuanVideo-1.5's ByT5, text_encoder_2): it takes the prompt's text
        # too, and the embeddings zero-padded to its tokenizer's length, as its own
        # encode_prompt pads them.
        rows = getattr(self.pipeline, "tokenizer_max_length", None)
        self._glyph_rows: int | None = None
        if (
            "prompt_embeds_2" in self._call_params
            and getattr(self.pipeline, "text_encoder_2", None) is not None
            and isinstance(rows, int)
        ):
            self._glyph_rows = rows
        self.takes_image = self._img2img is not None or (
            self.family is not None and self.family.dit.takes_image
        )
        self.size_multiple = _size_multiple(self.pipeline)
        self.default_size = _default_size(self.pipeline)
        self.conditioning_width = _conditioning_width(self.pipeline)
        self.default_steps = _call_default(self.pipeline, "num_inference_steps")
        # A video pipeline (Wan, HunyuanVideo) makes frames, one video per prompt.
        self.makes_video = "num_frames" in self._call_params
        modules = self.family.dit.step_cache if self.family is not None else None
        if config.step_cache_tiers and modules is None:
            raise ValueError(
                f"stepCache: this stage's pipeline ({type(self.pipeline).__name__}) takes no "
                "step cache"
            )
        self._step_cache_modules = modules
        if config.torch_compile:
            _compile_blocks(self.pipeline, self.device)
        # Schedulers index a table of their training timesteps: more steps than that fail
        # deep inside the pipeline.
        train_steps = getattr(self.pipeline.scheduler.config, "num_train_timesteps", None)
        self.max_steps = int(train_steps) - 1 if train_steps else None
        # LoRA adapters go into a DiT's transformer (a pipeline with diffusers' transformer
        # LoRA loader); any other pipeline refuses them by name when asked.
        self._adapters: DiTAdapters | None = None
        if config.max_loras > 0 and _takes_loras(self.pipeline):
            self._adapters = DiTAdapters(self.pipeline, config.max_loras)

    def adapter_ready(self, request: StageDiffusionCoreRequest) -> bool:
        return self._adapters is None or self._adapters.ready(request.adapter)

    def notify_adapter_reads(self, on_read: Callable[[], None] | None) -> None:
        if self._adapters is not None:
            self._adapters.notify_reads(on_read)

    def held_adapters(self) -> list[str]:
        return self._adapters.held if self._adapters is not None else []

    def check_adapter(self, name: str, source: str, scale: float) -> str | None:
        if self._adapters is None:
            return super().check_adapter(name, source, scale)
        try:
            self._adapters.check(StageAdapter(name, source, scale))
        except AdapterLoadError as e:
            return str(e)
        return None

    def _use_adapter(self, adapter: StageAdapter | None) -> None:
        if self._adapters is None:
            if adapter is not None and self.config.max_loras > 0:
                raise InvalidRequestError(
                    f"model: this stage's pipeline ({type(self.pipeline).__name__}) takes no "
                    f"LoRA adapters: they go into a DiT's transformer (asked for "
                    f"{adapter.name!r})",
                    "model",
                )
            super()._use_adapter(adapter)
            return
        self._adapters.activate(adapter)

    def close(self) -> None:
        if self._adapters is not None:
            self._adapters.close()
        super().close()

    def describe(self) -> dict[str, Any]:
        """Plain facts about the loaded pipeline (answered over collective_rpc)."""
        return {
            "model": self.config.model,
            "device": self.device,
            "pipeline": type(self.pipeline).__name__,
            "size_multiple": self.size_multiple,
            "default_size": list(self.default_size),
            "conditioning_width": self.conditioning_width,
            "image_to_image": self._img2img is not None,
            "family": self.family.name if self.family is not None else None,
            "takes_image": self.takes_image,
            "video": self.makes_video,
        }

    def validate(self, request: StageDiffusionCoreRequest) -> DiffusionParams:
        """The request's effective parameters; InvalidRequestError naming the field if bad."""
        # The request's own params alone first, so an error names what the caller sent.
        parse_params(request.params, "params", DiffusionParams)
        params = parse_params(
            {**self.config.default_params, **request.params}, "params", DiffusionParams
        )
        steps = params.num_inference_steps
        if self.max_steps is not None and steps is not None and steps > self.max_steps:
            raise InvalidRequestError(
                f"num_inference_steps: at most {self.max_steps} for this pipeline's scheduler "
                f"(got {steps})",
                "num_inference_steps",
            )
        self._check_call_params(params)
        if self.makes_video and params.num_images != 1:
            raise InvalidRequestError(
                f"num_images: a video pipeline makes one video per request "
                f"(got {params.num_images})",
                "num_images",
            )
        shapes = self._embeds_shapes(request)
        if request.prompt is None and "prompt_embeds" not in shapes:
            raise InvalidRequestError(
                "prompt: required (or prompt_embeds from an upstream stage)", "prompt"
            )
        if "prompt_embeds" in shapes and self._glyph_rows is not None and request.prompt is None:
            raise InvalidRequestError(
                "prompt: required beside prompt_embeds: this pipeline encodes the prompt's "
                "quoted text itself",
                "prompt",
            )
        if "prompt_embeds" not in shapes and self.family and self.config.text_from_upstream:
            raise InvalidRequestError(
                "prompt_embeds: this stage's text encoder is the encoder stage; its "
                "embeddings are required",
                "prompt_embeds",
            )
        if self.family is not None and "prompt_embeds" in shapes:
            negative = self.family.negative_prompt(msgspec.structs.asdict(params))
            if negative is not None and "negative_prompt_embeds" not in shapes:
                guidance = self.family.dit.guidance
                raise InvalidRequestError(
                    f"negative_prompt_embeds: required: this request runs guidance "
                    f"({guidance}), and with prompt_embeds the negative prompt's embeddings "
                    f"come from the encoder too (or set {guidance} to turn guidance off)",
                    "negative_prompt_embeds",
                )
        for name, shape in shapes.items():
            if len(shape) != 2 or shape[0] < 1 or shape[1] != self.conditioning_width:
                raise InvalidRequestError(
                    f"{name}: expected shape [tokens, {self.conditioning_width}], "
                    f"got {list(shape)}",
                    name,
                )
            if self._glyph_rows is not None and shape[0] > self._glyph_rows:
                raise InvalidRequestError(
                    f"{name}: at most {self._glyph_rows} tokens for this pipeline (got {shape[0]})",
                    name,
                )
        if request.images:
            if not self.takes_image:
                raise InvalidRequestError(
                    "image: this pipeline does not take an input image", "image"
                )
            most = self.family.max_input_images if self.family is not None else 1
            if len(request.images) > most:
                raise InvalidRequestError(
                    f"image: at most {most} input image{'s' if most > 1 else ''} per "
                    f"request (got {len(request.images)})",
                    "image",
                )
            for image in request.images:
                if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
                    raise InvalidRequestError(
                        f"image: expected uint8 RGB [height, width, 3], got {image.dtype} "
                        f"{list(image.shape)}",
                        "image",
                    )
            if self.family is None:
                image = request.images[0]
                # Image-to-image makes an image the size of its input unless told.
                if params.height is None:
                    params.height = int(image.shape[0])
                if params.width is None:
                    params.width = int(image.shape[1])
        elif self.family is not None and self.family.dit.requires_image:
            does = "starts its clip from" if self.makes_video else "edits"
            raise InvalidRequestError(
                f"image: required: a {self.family.name} pipeline {does} an input image", "image"
            )
        if self.family is None:
            # A family's pipeline sizes its output itself (an edit: from its input image).
            if params.height is None:
                params.height = self.default_size[0]
            if params.width is None:
                params.width = self.default_size[1]
        check_sizes(params, self.size_multiple)
        params.step_cache = self._step_cache_tier(params)
        return params

    def _step_cache_tier(self, params: DiffusionParams) -> str:
        """The request's tier (the stage's default where it names none)."""
        tiers = self.config.step_cache_tiers
        tier = params.step_cache or self.config.step_cache_default
        if tier != STEP_CACHE_OFF and tier not in tiers:
            known = ", ".join([STEP_CACHE_OFF, *tiers])
            raise InvalidRequestError(
                f"step_cache: {tier!r} is not a tier of this stage; tiers: {known}",
                "step_cache",
            )
        truncation = params.cfg_truncation
        if tier != STEP_CACHE_OFF and truncation is not None and truncation < 1:
            # Z-Image stops guiding part way, which halves the DiT's batch from that step:
            # a prediction made from the guided steps would be of the wrong batch.
            raise InvalidRequestError(
                f"step_cache: tier {tier!r} cannot run with cfg_truncation below 1 (guidance "
                f"that stops part way); use step_cache {STEP_CACHE_OFF!r} or cfg_truncation 1",
                "step_cache",
            )
        return tier

    def _embeds_shapes(self, request: StageDiffusionCoreRequest) -> dict[str, tuple[int, ...]]:
        """The shapes of the request's embeddings, given as arrays or handed off (whose
        handles say their shape: checked before anything is fetched), by name."""
        check_input_names(request, _EMBEDS)
        shapes: dict[str, tuple[int, ...]] = {}
        for name in _EMBEDS:
            array, hand_off = getattr(request, name), request.inputs.get(name)
            if array is not None and hand_off is not None:
                raise InvalidRequestError(
                    f"{name}: given as an array and as a hand-off; give one", name
                )
            if array is not None:
                shapes[name] = tuple(array.shape)
            elif hand_off is not None:
                shapes[name] = tuple(hand_off.handle.shape)
        return shapes

    def _check_call_params(self, params: DiffusionParams) -> None:
        pipeline = type(self.pipeline).__name__
        if self.family is not None and self.family.dit.sized_by_image:
            for name in ("height", "width"):
                if getattr(params, name) is not None:
                    raise InvalidRequestError(
                        f"{name}: not a parameter of this pipeline ({pipeline}): it sizes its "
                        "output from the input image's aspect ratio",
                        name,
                    )
        for name in _CALL_PARAMS:
            if getattr(params, name) is not None and name not in self._call_params:
                if name == "strength" and self._img2img is not None:
                    continue  # taken by the image-to-image variant
                if name == "guidance_scale" and self._guider_scale:
                    continue  # set on the pipeline's guider
                raise InvalidRequestError(
                    f"{name}: not a parameter of this pipeline ({pipeline})", name
                )

    def _run(
        self,
        request: StageDiffusionCoreRequest,
        params: DiffusionParams,
        should_abort: Callable[[], bool],
        emit: PartialEmit | None = None,
    ) -> np.ndarray:
        import torch
        from PIL import Image

        partials = self._partials([request.request_id], params, emit)
        progress = self._progress(request.request_id, params, emit)

        def on_step_end(
            pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]
        ) -> dict[str, Any]:
            if should_abort():
                raise RequestAbortedError
            if partials is not None:
                partials.after_step(step, tensors["latents"])
            if progress is not None:
                progress(step + 1, getattr(pipe, "num_timesteps", None))
            return tensors

        kwargs = _call_kwargs(params, on_step_end, video=self.makes_video)
        if params.seed is not None:
            kwargs["generator"] = torch.Generator("cpu").manual_seed(params.seed)
        if _upstream(request):
            kwargs.update(self._embeds_kwargs([request]))
            if self._glyph_rows is not None:
                kwargs.update(self._glyph_kwargs(request, params, kwargs))
        else:
            kwargs["prompt"] = request.prompt
            kwargs["negative_prompt"] = params.negative_prompt
        pictures = [Image.fromarray(np.asarray(image), mode="RGB") for image in request.images]
        watch = partials.watch() if partials is not None else None
        try:
            result = self._call(params, kwargs, pictures)
        finally:
            if watch is not None:
                watch.remove()
        # A video pipeline's frames: [videos, frames, height, width, 3], one video here.
        return to_uint8(result.frames[0] if self.makes_video else result.images)

    def _progress(
        self, request_id: str, params: DiffusionParams, emit: PartialEmit | None
    ) -> Callable[[int, int | None], None] | None:
        """What reports a request's progress (the percent of its steps done, each time it
        moves), if it asks for it; None otherwise."""
        if not params.report_progress or emit is None:
            return None
        planned = params.num_inference_steps or self.default_steps or 1
        sent = [-1]

        def report(done: int, steps: int | None) -> None:
            # The pipeline's own count where it has one (a strength of an image-to-image
            # run leaves out the first steps); the last step's 100 is the final output's.
            percent = min(99, 100 * done // max(1, steps or planned))
            if percent != sent[0]:
                sent[0] = percent
                emit(StageDiffusionCoreOutput(request_id=request_id, progress=percent))

        return report

    def batch_key(self, request: StageDiffusionCoreRequest) -> Hashable | None:
        """A family's text-to-image (or text-to-video) requests batch with those of the same
        call arguments but seed and prompt (size, frames, steps, guidance on or off and its
        scales, step-cache tier, partial images), one image (or clip) each; the stage's
        maxNumSeqs above 1. Not HunyuanVideo-1.5's: each of its prompts has glyph
        embeddings of its own (ByT5's), which the pipeline takes for one prompt only."""
        if self.config.max_batch <= 1 or self.family is None or request.images:
            return None
        if self._glyph_rows is not None:
            return None
        try:
            params = self.validate(request)
        except InvalidRequestError:
            return None  # refused when it runs
        if params.num_images != 1:
            return None
        upstream = _upstream(request)
        negative = (
            request.negative_prompt_embeds is not None or "negative_prompt_embeds" in request.inputs
            if upstream
            else params.negative_prompt is not None
        )
        shared = msgspec.structs.asdict(params)
        for own in ("seed", "negative_prompt"):
            del shared[own]
        # One adapter at one scale per pipeline call: LoRA scales are the transformer's.
        adapter = request.adapter
        lora = (adapter.name, adapter.source, adapter.scale) if adapter is not None else None
        return (upstream, negative, tuple(sorted(shared.items())), lora)

    def _run_batch(
        self,
        requests: list[StageDiffusionCoreRequest],
        params: list[Any],
        all_aborted: Callable[[], bool],
        emit: PartialEmit | None,
    ) -> list[np.ndarray]:
        import torch

        first: DiffusionParams = params[0]
        partials = self._partials([request.request_id for request in requests], first, emit)
        progress = [
            report
            for request, own in zip(requests, params, strict=True)
            if (report := self._progress(request.request_id, own, emit)) is not None
        ]

        def on_step_end(
            pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]
        ) -> dict[str, Any]:
            if all_aborted():
                raise RequestAbortedError
            if partials is not None:
                partials.after_step(step, tensors["latents"])
            for report in progress:
                report(step + 1, getattr(pipe, "num_timesteps", None))
            return tensors

        kwargs = _call_kwargs(first, on_step_end, video=self.makes_video)
        # One generator per request: each draws its own noise, as it would alone.
        kwargs["generator"] = [
            torch.Generator("cpu").manual_seed(p.seed)
            if p.seed is not None
            else torch.Generator("cpu")
            for p in params
        ]
        if _upstream(requests[0]):
            kwargs.update(self._embeds_kwargs(requests))
        else:
            kwargs["prompt"] = [request.prompt for request in requests]
            negatives = [p.negative_prompt for p in params]
            kwargs["negative_prompt"] = negatives if negatives[0] is not None else None
        watch = partials.watch() if partials is not None else None
        try:
            result = self._call(first, kwargs, [])
        finally:
            if watch is not None:
                watch.remove()
        if self.makes_video:
            # [videos, frames, height, width, 3]: one clip a request.
            return list(to_uint8(result.frames))
        images = to_uint8(result.images)
        return [images[index : index + 1] for index in range(len(requests))]

    def _call(self, params: DiffusionParams, kwargs: dict[str, Any], pictures: list[Any]) -> Any:
        """The pipeline's output for the request's call arguments and input images."""
        import torch
        from PIL import Image

        image = pictures[0] if pictures else None
        guidance = kwargs.pop("guidance_scale", None) if self._guider_scale else None
        watched = None if self._step_callback else kwargs.pop("callback_on_step_end")
        with (
            torch.inference_mode(),
            self._step_cache(params),
            self._guided(guidance),
            self._watched_steps(watched),
        ):
            if len(pictures) > 1:
                # A pipeline of several input images (Qwen-Image-Edit-Plus) takes them as a list.
                result = self.pipeline(image=pictures, **kwargs)
            elif image is not None and self._image_pipeline is not None:
                result = self._image_pipeline(image=image, **kwargs)
            elif image is not None and self._img2img is not None:
                if image.size != (params.width, params.height):
                    image = image.resize((params.width, params.height), Image.Resampling.BICUBIC)
                # Image-to-image makes the size of its input, resized above.
                del kwargs["height"], kwargs["width"]
                result = self._img2img(image=image, **kwargs)
            elif image is not None:
                result = self.pipeline(image=image, **kwargs)
            else:
                kwargs.pop("strength", None)
                result = self.pipeline(**kwargs)
        return result

    def _partials(
        self, request_ids: Sequence[str], params: DiffusionParams, emit: PartialEmit | None
    ) -> PartialImages | None:
        """What sends the partial images of the requests of one pipeline call (one, or a
        batch's, which ask for as many), if they ask for any and the pipeline makes them (a
        family's, on a flow-matching scheduler); None otherwise (a request may get fewer
        partials than it asked for, as OpenAI's API allows). Each request gets its own
        images' rows; one aborted while its batch runs gets none."""
        layout = self.family.dit.preview if self.family is not None else None
        if not params.partial_images or emit is None or layout is None:
            return None
        steps = partial_steps(
            params.num_inference_steps or self.default_steps, params.partial_images
        )
        if not steps:
            return None

        def send(images: np.ndarray, index: int) -> None:
            rows = len(images) // len(request_ids)
            for at, request_id in enumerate(request_ids):
                if request_id not in self._aborted:
                    own = images[at * rows : (at + 1) * rows]
                    emit(
                        StageDiffusionCoreOutput(
                            request_id=request_id, images=own, partial_index=index
                        )
                    )

        return PartialImages(self.pipeline, layout, steps, send)

    def _step_cache(self, params: DiffusionParams) -> contextlib.AbstractContextManager[None]:
        """The request's step cache on the transformer while the pipeline runs (nothing for
        the off tier)."""
        modules = self._step_cache_modules
        if params.step_cache in (None, STEP_CACHE_OFF) or modules is None:
            return contextlib.nullcontext()
        steps = params.num_inference_steps or self.default_steps
        return step_cache(
            self.pipeline.transformer,
            self.config.step_cache_tiers[params.step_cache],
            steps,
            modules.skip,
            modules.predict,
            self._torch_dtype,
        )

    @contextlib.contextmanager
    def _guided(self, scale: float | None) -> Iterator[None]:
        """The pipeline's guider at the request's guidance scale while it runs (as it is,
        for a request that sets none, or a pipeline whose guidance is no guider's)."""
        if scale is None:
            yield
            return
        guider = self.pipeline.guider
        before = guider.guidance_scale
        guider.guidance_scale = scale
        try:
            yield
        finally:
            guider.guidance_scale = before

    @contextlib.contextmanager
    def _watched_steps(self, on_step_end: Callable[..., Any] | None) -> Iterator[None]:
        """``on_step_end`` called as each denoising step ends, as a step callback would be,
        for a pipeline that takes none (None: nothing watched). Told by the transformer's
        calls (a forward pre-hook, PyTorch's own): a call with a new timestep means the step
        before it ended. It cannot change the latents: it aborts and reports progress (the
        last step's end is told once the pipeline returns)."""
        if on_step_end is None:
            yield
            return
        timesteps: list[float] = []

        def before_forward(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
            timestep = kwargs.get("timestep")
            if timestep is None:
                return
            now = float(timestep.flatten()[0])
            if timesteps and now == timesteps[-1]:
                return  # another guidance branch of the same step
            if timesteps:
                on_step_end(self.pipeline, len(timesteps) - 1, timesteps[-1], {"latents": None})
            timesteps.append(now)

        hook = self.pipeline.transformer.register_forward_pre_hook(before_forward, with_kwargs=True)
        try:
            yield
        finally:
            hook.remove()
        if timesteps:  # the last step, which no later call tells of
            on_step_end(self.pipeline, len(timesteps) - 1, timesteps[-1], {"latents": None})

    def _glyph_kwargs(
        self, request: StageDiffusionCoreRequest, params: DiffusionParams, embeds: dict[str, Any]
    ) -> dict[str, Any]:
        """The second text encoder's embeddings of the prompt's quoted text (and, where the
        request runs guidance, the negative prompt's), as the pipeline's own encode_prompt
        computes them beside the upstream embeddings ``embeds`` (HunyuanVideo-1.5's ByT5)."""
        import torch

        texts = {"prompt_embeds": request.prompt}
        if embeds.get("negative_prompt_embeds") is not None:
            texts["negative_prompt_embeds"] = params.negative_prompt
        result: dict[str, Any] = {}
        # Without autograd, as the pipeline's __call__ runs it: ByT5's output differs in
        # the last bits with it on.
        with torch.inference_mode():
            for name, text in texts.items():
                _, _, glyph, glyph_mask = self.pipeline.encode_prompt(
                    text,
                    device=self.device,
                    dtype=self._torch_dtype,
                    prompt_embeds=embeds[name],
                    prompt_embeds_mask=embeds[f"{name}_mask"],
                )
                result[f"{name}_2"], result[f"{name}_mask_2"] = glyph, glyph_mask
        return result

    def _embeds_kwargs(self, requests: list[StageDiffusionCoreRequest]) -> dict[str, Any]:
        """The pipeline arguments that carry the requests' upstream embeddings (one
        request's, or a batch's: a family's), as the family's pipeline takes them."""
        import torch

        def tensor(request: StageDiffusionCoreRequest, name: str) -> Any:
            array = getattr(request, name)
            if array is not None:
                return torch.as_tensor(np.array(array), dtype=self._torch_dtype, device=self.device)
            # A private copy: the tiny Qwen-Image DiT ran 1.4-2.5x slower per image on
            # embeddings read in place from a shared-memory mapping than on a copy of them
            # (measured here, 64x64, 4 steps, guidance on); a copy of embeddings is cheap.
            return self.fetch(request, name, private=True) if name in request.inputs else None

        positives = [tensor(request, "prompt_embeds") for request in requests]
        negatives = [tensor(request, "negative_prompt_embeds") for request in requests]
        positive, negative = positives[0], negatives[0]
        if self.family is None:
            # Guidance needs an unconditional branch of the prompt's shape; an LLM has no
            # hidden states for an empty prompt, so zeros stand for it.
            return {
                "prompt_embeds": positive.unsqueeze(0),
                "negative_prompt_embeds": torch.zeros_like(positive).unsqueeze(0),
            }
        if self.family.dit.embeds == "rows":
            return {
                "prompt_embeds": positives,
                "negative_prompt_embeds": negatives if negative is not None else None,
            }
        rows = self._glyph_rows
        result = dict(
            zip(("prompt_embeds", "prompt_embeds_mask"), _padded(positives, rows), strict=True)
        )
        if negative is not None:
            names = ("negative_prompt_embeds", "negative_prompt_embeds_mask")
            result.update(zip(names, _padded(negatives, rows), strict=True))
        return result


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


def _takes_loras(pipeline: Any) -> bool:
    """Whether LoRA adapters can go into the pipeline's transformer (a DiT pipeline with
    diffusers' LoRA loader)."""
    return (
        getattr(pipeline, "transformer", None) is not None
        and callable(getattr(pipeline, "load_lora_into_transformer", None))
        and "transformer" in getattr(pipeline, "_lora_loadable_modules", ())
    )


def _call_default(pipeline: Any, name: str) -> Any:
    """The default of the pipeline's __call__ argument ``name`` (None if it has none)."""
    parameter = inspect.signature(pipeline.__call__).parameters.get(name)
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return None
    return parameter.default


def _padded(rows: list[Any], length: int | None = None) -> tuple[Any, Any]:
    """Prompts' embeddings ([tokens, width] each) as one [prompts, most tokens, width]
    batch (or [prompts, length, width], where the family's tokenizer pads to a length),
    padded at the end with zeros as the family's own tokenizer pads, and its mask (1: a
    token; one prompt alone has no padding unless to a length)."""
    import torch

    longest = max(row.shape[0] for row in rows) if length is None else length
    batch = rows[0].new_zeros((len(rows), longest, rows[0].shape[1]))
    mask = torch.zeros((len(rows), longest), dtype=torch.long, device=rows[0].device)
    for index, row in enumerate(rows):
        batch[index, : row.shape[0]] = row
        mask[index, : row.shape[0]] = 1
    return batch, mask


def _upstream(request: StageDiffusionCoreRequest) -> bool:
    """Whether the request's text embeddings come from upstream (else its prompt's text is
    encoded by the pipeline's own text encoder)."""
    return request.prompt_embeds is not None or "prompt_embeds" in request.inputs


def _call_kwargs(
    params: DiffusionParams, on_step_end: Callable[..., Any], *, video: bool
) -> dict[str, Any]:
    """The pipeline's call arguments a request's params give (left out, a parameter is the
    pipeline's own default: a family's pipeline sizes its output itself, an edit's from its
    input image). A video pipeline counts videos, not images."""
    kwargs: dict[str, Any] = {
        name: value
        for name in (*_CALL_PARAMS, "height", "width")
        if (value := getattr(params, name)) is not None
    }
    kwargs.update(
        {"num_videos_per_prompt" if video else "num_images_per_prompt": params.num_images},
        output_type="np",
        callback_on_step_end=on_step_end,
    )
    return kwargs


def _family(name: str | None) -> Family | None:
    if name is None:
        return None
    if name not in FAMILIES:
        raise InvalidRequestError(f"family: {name!r} is not one of {', '.join(FAMILIES)}", "family")
    return FAMILIES[name]


def _compile_blocks(pipeline: Any, device: str) -> None:
    """torchCompile: the pipeline's transformer's repeated blocks compiled in place
    (diffusers' regional compilation), each shape on its first call. Not as one graph: a
    step cache's hooks on the blocks break it, and their state stays Python's (the images
    are the same)."""
    transformer = getattr(pipeline, "transformer", None)
    if transformer is None or not getattr(transformer, "_repeated_blocks", None):
        raise ValueError(
            f"torchCompile: this pipeline ({type(pipeline).__name__}) has no transformer "
            "with repeated blocks to compile; remove torchCompile"
        )
    # Inductor builds C++ kernels on a CPU, and Triton its C launchers on a GPU, at run time.
    on_cpu = device.startswith("cpu")
    compilers = ("g++", "c++", "clang++") if on_cpu else ("gcc", "cc", "clang")
    if not os.environ.get("CXX" if on_cpu else "CC") and not any(map(shutil.which, compilers)):
        raise ValueError(
            f"torchCompile: compiling for {device} needs a {'C++' if on_cpu else 'C'} compiler "
            f"({', '.join(compilers)}) and this image has none; remove torchCompile"
        )
    transformer.compile_repeated_blocks(fullgraph=False)


def _check_family(pipeline_class: str, family: Family | None) -> None:
    """A checkpoint's pipeline must be the family's; one of a known family must be named,
    since without its recipe upstream embeddings would enter it wrongly."""
    if family is not None and pipeline_class != family.dit.pipeline_class:
        raise InvalidRequestError(
            f"family: {family.name} runs {family.dit.pipeline_class}, but the checkpoint "
            f"holds a {pipeline_class}",
            "family",
        )
    if family is None and (found := family_of_pipeline_class(pipeline_class)) is not None:
        raise InvalidRequestError(
            f"family: the checkpoint holds a {pipeline_class}: set family: {found.name} "
            "in the pipeline",
            "family",
        )


def check_input_names(request: StageDiffusionCoreRequest, takes: tuple[str, ...]) -> None:
    """InvalidRequestError naming an input of ``request`` that the engine does not take."""
    unknown = set(request.inputs) - set(takes)
    if unknown:
        name = min(unknown)
        raise InvalidRequestError(
            f"inputs.{name}: not an input of this stage (it takes {', '.join(takes)})", name
        )


def check_sizes(params: Any, multiple: int, max_side: int | None = None) -> None:
    """InvalidRequestError naming ``params``' height or width if it is no multiple of
    ``multiple`` or over ``max_side``."""
    for name in ("height", "width"):
        value = getattr(params, name)
        if value is None or (value % multiple == 0 and (max_side is None or value <= max_side)):
            continue
        at_most = f" and at most {max_side}" if max_side is not None else ""
        raise InvalidRequestError(
            f"{name}: must be a multiple of {multiple}{at_most} for this model (got {value})",
            name,
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


_S = TypeVar("_S", bound=msgspec.Struct)


def parse_params(params: dict[str, Any], where: str, struct: type[_S]) -> _S:
    """``params`` as ``struct`` (an engine's parameter set); InvalidRequestError naming
    the field that is wrong, and for an unknown one, the names allowed."""
    try:
        return msgspec.convert(params, struct)
    except msgspec.ValidationError as e:
        # An unknown field is named in the text alone ("Object contains unknown field
        # `foo`"); the list of allowed ones is what the caller needs to fix it.
        unknown = re.fullmatch(r"Object contains unknown field `(.+)`", str(e))
        if unknown:
            name = unknown.group(1)
            allowed = ", ".join(struct.__struct_fields__)
            raise InvalidRequestError(
                f"{where}.{name}: unknown parameter (allowed: {allowed})", name
            ) from None
        raise InvalidRequestError.from_validation(e, where) from None


def _size_multiple(pipeline: Any) -> int:
    """Heights and widths must be multiples of this for the pipeline to run."""
    # A video pipeline's VAE scales space and time apart (Wan: 16 and 4).
    spatial: Any = getattr(pipeline, "vae_scale_factor_spatial", None)
    vae_scale = int(spatial or getattr(pipeline, "vae_scale_factor", 8))
    unet = getattr(pipeline, "unet", None)
    if unet is not None:
        # Each down block but the last halves the latent.
        downsamples: int = len(unet.config.block_out_channels) - 1
        return int(vae_scale * 2**downsamples)
    processor = getattr(pipeline, "image_processor", None)
    if processor is not None:
        # Transformer pipelines pack latents into patches; their image processor is built
        # with the multiple that makes (VAE scale times patch size).
        return int(processor.config.vae_scale_factor)
    transformer = getattr(pipeline, "transformer", None)
    patch = getattr(getattr(transformer, "config", None), "patch_size", 1) or 1
    if isinstance(patch, list | tuple):
        patch = patch[-1]  # a video DiT's patch: (frames, height, width)
    return vae_scale * int(patch)


def _default_size(pipeline: Any) -> tuple[int, int]:
    height, width = _call_default(pipeline, "height"), _call_default(pipeline, "width")
    if isinstance(height, int) and isinstance(width, int):
        return height, width  # a pipeline that says (Wan's 480x832)
    vae_scale = int(getattr(pipeline, "vae_scale_factor", 8))
    denoiser = getattr(pipeline, "unet", None) or getattr(pipeline, "transformer", None)
    sample = getattr(getattr(denoiser, "config", None), "sample_size", 64) or 64
    if isinstance(sample, int):
        return sample * vae_scale, sample * vae_scale
    return int(sample[0]) * vae_scale, int(sample[1]) * vae_scale


def _conditioning_width(pipeline: Any) -> int:
    """The width of the prompt embeddings the denoiser attends to."""
    unet = getattr(pipeline, "unet", None)
    if unet is not None:
        return int(unet.config.cross_attention_dim)
    transformer = getattr(pipeline, "transformer", None)
    config = getattr(transformer, "config", None)
    # MMDiTs (Qwen-Image) call it joint_attention_dim, Z-Image's DiT cap_feat_dim,
    # HunyuanVideo-1.5's text_embed_dim (its first text encoder's).
    for name in ("joint_attention_dim", "cap_feat_dim", "text_embed_dim"):
        width = getattr(config, name, None)
        if width:
            return int(width)
    return 0
