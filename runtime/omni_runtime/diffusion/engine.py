"""DiffusionEngine: one local diffusers text-to-image pipeline, served request by request.

The engine owns validation: a request is checked against the loaded pipeline (sizes it can
make, whether it takes an input image, its conditioning width) before any compute, and a
bad one becomes an error output naming the field (``StageError.param``). It also owns the
ids of the requests in flight and which of them are aborted. Both the out-of-process core
and the inline client admit, abort and run requests through it
(:meth:`DiffusionEngine.admit`, :meth:`~DiffusionEngine.abort`,
:meth:`~DiffusionEngine.execute`), so they answer alike.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Annotated, Any

import msgspec
import numpy as np

from omni_runtime.engine.stage.stage_core_client import request_id_in_flight_error
from omni_runtime.engine.stage.stage_core_types import (
    InvalidStageRequestError,
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
    StageError,
    StageErrorCode,
)

logger = logging.getLogger(__name__)

MAX_SIDE = 4096
MAX_IMAGES = 16
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
    dtype: str = "float32"
    # Merged under each request's own params (the pipeline's defaultSamplingParams).
    default_params: dict[str, Any] = {}
    # torch intra-op threads; None keeps torch's default.
    num_threads: int | None = None
    # "auto": the first visible GPU if there is one (the stage's process sees only its
    # `devices`), else the CPU; "cpu" forces the CPU; "cuda" / "cuda:N" insist on a GPU.
    device: str = "auto"


class DiffusionParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The sampling parameters a diffusion request may carry (``params`` on the wire)."""

    height: Annotated[int, msgspec.Meta(ge=1, le=MAX_SIDE)] | None = None
    width: Annotated[int, msgspec.Meta(ge=1, le=MAX_SIDE)] | None = None
    num_inference_steps: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 20
    guidance_scale: Annotated[float, msgspec.Meta(ge=0.0)] = 7.5
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    negative_prompt: str | None = None
    num_images: Annotated[int, msgspec.Meta(ge=1, le=MAX_IMAGES)] = 1
    # Image-to-image only: how far from the input image to go (1.0 ignores it).
    strength: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.8


PARAM_NAMES = DiffusionParams.__struct_fields__


class InvalidRequestError(InvalidStageRequestError):
    """A request the diffusion engine refuses."""


class RequestAbortedError(Exception):
    """Raised inside the pipeline's step callback to stop an aborted request."""


class DiffusionEngine:
    """A diffusers pipeline loaded from a local directory, run one request at a time."""

    def __init__(self, config: DiffusionEngineConfig) -> None:
        import torch
        from diffusers import AutoPipelineForImage2Image, DiffusionPipeline

        if config.dtype not in _DTYPES:
            raise InvalidRequestError(
                f"dtype: {config.dtype!r} is not one of {sorted(_DTYPES)}", "dtype"
            )
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        _parse_params(config.default_params, "defaultSamplingParams")
        self._torch_dtype = getattr(torch, _DTYPES[config.dtype])
        self.pipeline = DiffusionPipeline.from_pretrained(
            config.model, local_files_only=True, dtype=self._torch_dtype
        )
        self.device = _choose_device(config.device)
        self.pipeline.to(self.device)
        self.pipeline.set_progress_bar_config(disable=True)
        try:
            self._img2img = AutoPipelineForImage2Image.from_pipe(self.pipeline)
            self._img2img.set_progress_bar_config(disable=True)
        except ValueError:
            self._img2img = None  # this pipeline family has no image-to-image variant
        self.size_multiple = _size_multiple(self.pipeline)
        self.default_size = _default_size(self.pipeline)
        self.conditioning_width = _conditioning_width(self.pipeline)
        # Schedulers index a table of their training timesteps: more steps than that fail
        # deep inside the pipeline.
        train_steps = getattr(self.pipeline.scheduler.config, "num_train_timesteps", None)
        self.max_steps = int(train_steps) - 1 if train_steps else None
        # Requests admitted and not yet answered, and those of them aborted. Requests
        # arrive on one thread (the core's input thread, the inline client's event loop)
        # while another runs them (the busy loop, the inline client's worker).
        self._lock = threading.Lock()
        self._admitted: set[str] = set()
        self._aborted: set[str] = set()

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
        }

    def validate(self, request: StageDiffusionCoreRequest) -> DiffusionParams:
        """The request's effective parameters; InvalidRequestError naming the field if bad."""
        # The request's own params alone first, so an error names what the caller sent.
        _parse_params(request.params, "params")
        params = _parse_params({**self.config.default_params, **request.params}, "params")
        if self.max_steps is not None and params.num_inference_steps > self.max_steps:
            raise InvalidRequestError(
                f"num_inference_steps: at most {self.max_steps} for this pipeline's scheduler "
                f"(got {params.num_inference_steps})",
                "num_inference_steps",
            )
        if request.prompt is None and request.prompt_embeds is None:
            raise InvalidRequestError(
                "prompt: required (or prompt_embeds from an upstream stage)", "prompt"
            )
        if request.prompt_embeds is not None:
            shape = tuple(request.prompt_embeds.shape)
            if len(shape) != 2 or shape[0] < 1 or shape[1] != self.conditioning_width:
                raise InvalidRequestError(
                    f"prompt_embeds: expected shape [tokens, {self.conditioning_width}], "
                    f"got {list(shape)}",
                    "prompt_embeds",
                )
        if request.image is not None:
            if self._img2img is None:
                raise InvalidRequestError(
                    "image: this pipeline does not take an input image", "image"
                )
            image = request.image
            if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
                raise InvalidRequestError(
                    f"image: expected uint8 RGB [height, width, 3], got {image.dtype} "
                    f"{list(image.shape)}",
                    "image",
                )
            if params.height is None:
                params.height = int(image.shape[0])
            if params.width is None:
                params.width = int(image.shape[1])
        if params.height is None:
            params.height = self.default_size[0]
        if params.width is None:
            params.width = self.default_size[1]
        for name in ("height", "width"):
            value = getattr(params, name)
            if value % self.size_multiple:
                raise InvalidRequestError(
                    f"{name}: must be a multiple of {self.size_multiple} for this pipeline "
                    f"(got {value})",
                    name,
                )
        return params

    def execute(self, request: StageDiffusionCoreRequest) -> StageDiffusionCoreOutput:
        """Run one (admitted) request to completion, and release its id. Never raises for a
        request's own problems: a refused, failed or aborted request becomes an output
        saying so."""
        request_id = request.request_id
        try:
            return self._execute(request, lambda: request_id in self._aborted)
        finally:
            with self._lock:
                self._admitted.discard(request_id)
                self._aborted.discard(request_id)

    def _execute(
        self, request: StageDiffusionCoreRequest, should_abort: Callable[[], bool]
    ) -> StageDiffusionCoreOutput:
        request_id = request.request_id
        try:
            params = self.validate(request)
        except InvalidRequestError as e:
            return StageDiffusionCoreOutput(request_id=request_id, error=e.error)
        if should_abort():
            return StageDiffusionCoreOutput(request_id=request_id, aborted=True)
        start = time.perf_counter()
        try:
            images = self._run(request, params, should_abort)
        except RequestAbortedError:
            return StageDiffusionCoreOutput(request_id=request_id, aborted=True)
        except ValueError as e:
            # diffusers' own input checks (check_inputs) raise ValueError.
            return StageDiffusionCoreOutput(
                request_id=request_id, error=StageError.bad_request(f"pipeline: {e}")
            )
        except Exception as e:  # a request that breaks the pipeline must not kill the stage
            logger.exception("request %s failed", request_id)
            failure = f"the pipeline failed: {type(e).__name__}: {e}"
            return StageDiffusionCoreOutput(
                request_id=request_id, error=StageError(StageErrorCode.STAGE_FAILED, failure)
            )
        return StageDiffusionCoreOutput(
            request_id=request_id, images=images, execute_time=time.perf_counter() - start
        )

    def _run(
        self,
        request: StageDiffusionCoreRequest,
        params: DiffusionParams,
        should_abort: Callable[[], bool],
    ) -> np.ndarray:
        import torch
        from PIL import Image

        def on_step_end(
            pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]
        ) -> dict[str, Any]:
            if should_abort():
                raise RequestAbortedError
            return tensors

        kwargs: dict[str, Any] = {
            "num_inference_steps": params.num_inference_steps,
            "guidance_scale": params.guidance_scale,
            "num_images_per_prompt": params.num_images,
            "output_type": "np",
            "callback_on_step_end": on_step_end,
        }
        if params.seed is not None:
            kwargs["generator"] = torch.Generator("cpu").manual_seed(params.seed)
        if request.prompt_embeds is not None:
            embeds = torch.as_tensor(
                np.array(request.prompt_embeds), dtype=self._torch_dtype, device=self.device
            )
            kwargs["prompt_embeds"] = embeds.unsqueeze(0)
            # Classifier-free guidance needs an unconditional branch of the same shape.
            kwargs["negative_prompt_embeds"] = torch.zeros_like(kwargs["prompt_embeds"])
        else:
            kwargs["prompt"] = request.prompt
            kwargs["negative_prompt"] = params.negative_prompt
        with torch.inference_mode():
            if request.image is not None:
                assert self._img2img is not None
                image = Image.fromarray(np.asarray(request.image), mode="RGB")
                if image.size != (params.width, params.height):
                    image = image.resize((params.width, params.height), Image.Resampling.BICUBIC)
                result = self._img2img(image=image, strength=params.strength, **kwargs)
            else:
                result = self.pipeline(height=params.height, width=params.width, **kwargs)
        images = np.asarray(result.images)
        return np.clip(np.round(images * 255.0), 0, 255).astype(np.uint8)


def _choose_device(device: str) -> str:
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


def _parse_params(params: dict[str, Any], where: str) -> DiffusionParams:
    try:
        return msgspec.convert(params, DiffusionParams)
    except msgspec.ValidationError as e:
        raise _invalid_params(e, where) from None


def _invalid_params(error: msgspec.ValidationError, where: str) -> InvalidRequestError:
    # An unknown field is named in the text alone ("Object contains unknown field `foo`");
    # the list of allowed ones is what the caller needs to fix it.
    message = str(error)
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", message)
    if unknown:
        name = unknown.group(1)
        allowed = ", ".join(PARAM_NAMES)
        return InvalidRequestError(f"{where}.{name}: unknown parameter (allowed: {allowed})", name)
    return InvalidRequestError.from_validation(error, where)


def _size_multiple(pipeline: Any) -> int:
    """Heights and widths must be multiples of this for the pipeline to run."""
    vae_scale = int(getattr(pipeline, "vae_scale_factor", 8))
    unet = getattr(pipeline, "unet", None)
    if unet is not None:
        # Each down block but the last halves the latent.
        downsamples: int = len(unet.config.block_out_channels) - 1
        return int(vae_scale * 2**downsamples)
    transformer = getattr(pipeline, "transformer", None)
    patch = int(getattr(getattr(transformer, "config", None), "patch_size", 1) or 1)
    return vae_scale * patch


def _default_size(pipeline: Any) -> tuple[int, int]:
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
    return int(getattr(config, "joint_attention_dim", 0) or 0)
