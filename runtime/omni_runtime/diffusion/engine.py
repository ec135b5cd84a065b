"""DiffusionEngine: one local diffusers pipeline, served request by request.

A pipeline of a known family (``omni_runtime.families``) fed by an encoder stage is loaded
without its text encoder, tokenizer and processor, and takes the encoder's embeddings (and
the negative prompt's, for guidance) the way the family's pipeline takes its own: padded
with a mask, or as rows (the family's DiTRecipe). Any other pipeline takes upstream hidden
states as ``prompt_embeds`` as they are.

The engine knows no pipeline's quirks: how a pipeline is called (which parameters its
``__call__`` takes, a guider, a missing step callback, a second text encoder, another
pipeline class for input images) is its runner's (``omni_runtime.diffusion.runners``),
the family's own where its DiTRecipe names one. The request parameters are the common ones
and the family's declared fields (``omni_runtime.diffusion.params``).

A request is checked against the loaded pipeline (sizes it can make, whether it takes an
input image, its conditioning width) before any compute; admission, aborts, fetching
inputs and answering are :class:`~omni_runtime.diffusion.engine_base.DiffusionEngineBase`'s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import msgspec
import numpy as np

from omni_runtime.config import STEP_CACHE_OFF
from omni_runtime.diffusion.adapters import AdapterLoadError, DiTAdapters
from omni_runtime.diffusion.engine_base import (
    DiffusionEngineBase,
    DiffusionEngineConfig,
    PartialEmit,
    RequestAbortedError,
    engine_device,
    torch_dtype,
)
from omni_runtime.diffusion.params import (
    DiffusionParams,
    InvalidRequestError,
    check_input_names,
    check_sizes,
    diffusers_params,
    parse_params,
)
from omni_runtime.diffusion.previews import PartialImages, partial_steps
from omni_runtime.diffusion.runners.base import runner_class
from omni_runtime.diffusion.step_cache import step_cache
from omni_runtime.engine.stage.stage_core_types import (
    StageAdapter,
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
)
from omni_runtime.families import FAMILIES, Family, family_of_pipeline_class
from omni_runtime.images import to_uint8

# What a diffusers engine is built from, beside the engine (the stage processes build one).
__all__ = ["DiffusionEngine", "DiffusionEngineConfig", "DiffusionParams", "InvalidRequestError"]

# The inputs a diffusers pipeline takes from upstream (its own argument names).
_EMBEDS = ("prompt_embeds", "negative_prompt_embeds")


class DiffusionEngine(DiffusionEngineBase):
    """A diffusers pipeline loaded from a local directory, run one request at a time."""

    def __init__(self, config: DiffusionEngineConfig) -> None:
        import torch
        from diffusers import DiffusionPipeline

        self._torch_dtype = self.compute_dtype = torch_dtype(config.dtype)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        super().__init__(config.connectors)
        self.config = config
        self.family = _family(config.family)
        # The common parameters and the family's own (every family's, for a pipeline of none).
        self.params_type = diffusers_params(self.family)
        parse_params(config.default_params, "defaultSamplingParams", self.params_type)
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
        self.runner = runner_class(self.family)(
            self.pipeline, self.family, self.device, self._torch_dtype
        )
        self.takes_image = self.runner.takes_image
        self.size_multiple = self.runner.size_multiple()
        self.default_size = self.runner.default_size()
        self.conditioning_width = self.runner.conditioning_width()
        self.default_steps = self.runner.call_default("num_inference_steps")
        self.makes_video = self.runner.makes_video
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
            "image_to_image": self.runner.img2img is not None,
            "family": self.family.name if self.family is not None else None,
            "takes_image": self.takes_image,
            "video": self.makes_video,
        }

    def validate(self, request: StageDiffusionCoreRequest) -> DiffusionParams:
        """The request's effective parameters; InvalidRequestError naming the field if bad."""
        # The request's own params alone first, so an error names what the caller sent.
        parse_params(request.params, "params", self.params_type)
        params = parse_params(
            {**self.config.default_params, **request.params}, "params", self.params_type
        )
        steps = params.num_inference_steps
        if self.max_steps is not None and steps is not None and steps > self.max_steps:
            raise InvalidRequestError(
                f"num_inference_steps: at most {self.max_steps} for this pipeline's scheduler "
                f"(got {steps})",
                "num_inference_steps",
            )
        self.runner.check_params(params)
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
        self.runner.check_embeds(request, shapes)
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
            rows = self.runner.embeds_rows
            if rows is not None and shape[0] > rows:
                raise InvalidRequestError(
                    f"{name}: at most {rows} tokens for this pipeline (got {shape[0]})", name
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
        self.runner.check(params)
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

        kwargs = self.runner.call_kwargs(params, on_step_end)
        if params.seed is not None:
            kwargs["generator"] = torch.Generator("cpu").manual_seed(params.seed)
        if _upstream(request):
            kwargs.update(self._embeds_kwargs([request]))
            kwargs.update(self.runner.upstream_kwargs(request, params, kwargs))
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
        maxNumSeqs above 1, where the pipeline's runner batches."""
        if self.config.max_batch <= 1 or self.family is None or request.images:
            return None
        if not self.runner.batches:
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

        kwargs = self.runner.call_kwargs(first, on_step_end)
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

        with torch.inference_mode(), self._step_cache(params):
            return self.runner(params, kwargs, pictures)

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

    def _embeds_kwargs(self, requests: list[StageDiffusionCoreRequest]) -> dict[str, Any]:
        """The pipeline arguments that carry the requests' upstream embeddings (one
        request's, or a batch's: a family's), as the runner says the pipeline takes them."""
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
        return self.runner.embeds_kwargs(positives, negatives)


def _takes_loras(pipeline: Any) -> bool:
    """Whether LoRA adapters can go into the pipeline's transformer (a DiT pipeline with
    diffusers' LoRA loader)."""
    return (
        getattr(pipeline, "transformer", None) is not None
        and callable(getattr(pipeline, "load_lora_into_transformer", None))
        and "transformer" in getattr(pipeline, "_lora_loadable_modules", ())
    )


def _upstream(request: StageDiffusionCoreRequest) -> bool:
    """Whether the request's text embeddings come from upstream (else its prompt's text is
    encoded by the pipeline's own text encoder)."""
    return request.prompt_embeds is not None or "prompt_embeds" in request.inputs


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
