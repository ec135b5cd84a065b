"""BagelEngine: BAGEL's DiT stage, request by request.

BAGEL generates with the same model its thinker runs: the generation expert denoises
latent tokens against the request's context KV (``omni_runtime.modeling.bagel``). The
contexts come one of two ways:

- as KV caches in a connector (the inputs ``context_kv``: the full context, whose prefix is
  the text-dropped one; ``no_image_context_kv``: the image-dropped one), as the thinker
  stage hands them on, fetched here, in the core process: from shared memory the KV is read
  in place, bf16 as it was put, never copied. Each is ``[2, layers, tokens, kv_heads,
  head_dim]`` (keys first); its hand-off's ``meta`` gives the RoPE position the next token
  takes (``rope``) and, for the full context, where the text-dropped context inside it
  ends (``prefix_length`` tokens, ``prefix_rope``);
- or built here from the prompt text and the input image, for a request that comes with
  those alone (a DiT stage used by itself).

Parameters (``params``): height, width (the output's size, multiples of the VAE's
latent stride up to the checkpoint's largest side; an edit given none makes its input
image's size after BAGEL's transform, whose context holds the image at that size either
way, as vllm-omni's BAGEL does), num_inference_steps (BAGEL's
num_timesteps: that many points from noise to image, one step fewer), seed (the
reference's ``torch.manual_seed``), num_images, and BAGEL's guidance: cfg_text_scale
(guidance_scale is taken for it), cfg_img_scale, cfg_interval, cfg_renorm_type,
cfg_renorm_min, timestep_shift. Left out, each is BAGEL's default for an edit or for
text-to-image.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import numpy as np

from omni_runtime.diffusion.engine_base import (
    DiffusionEngineBase,
    DiffusionEngineConfig,
    PartialEmit,
    RequestAbortedError,
    engine_device,
    torch_dtype,
)
from omni_runtime.diffusion.params import (
    MAX_IMAGES,
    MAX_SIDE,
    InvalidRequestError,
    check_input_names,
    check_sizes,
    parse_params,
    with_fields,
)
from omni_runtime.engine.stage.stage_core_types import HandOff, StageDiffusionCoreRequest
from omni_runtime.families import FAMILIES

# The inputs BAGEL's DiT takes from its thinker.
_CONTEXTS = ("context_kv", "no_image_context_kv")


class BagelParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The sampling parameters every BAGEL request may carry; None is BAGEL's default.
    Its guidance knobs are the family's request fields (``families/bagel.py``), added with
    the bounds declared there (:data:`_PARAMS`)."""

    height: Annotated[int, msgspec.Meta(ge=1, le=MAX_SIDE)] | None = None
    width: Annotated[int, msgspec.Meta(ge=1, le=MAX_SIDE)] | None = None
    # Points on the schedule, noise and image included: at least 2 (one step).
    num_inference_steps: Annotated[int, msgspec.Meta(ge=2, le=1000)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    num_images: Annotated[int, msgspec.Meta(ge=1, le=MAX_IMAGES)] = 1
    # The OpenAI-style name for the text guidance scale (cfg_text_scale).
    guidance_scale: Annotated[float, msgspec.Meta(ge=0.0)] | None = None


# BAGEL's guidance knobs, by name: each is the field of its inferencer's guidance that
# bears the same name (cfg_text_scale, cfg_img_scale, cfg_interval, ...).
_GUIDANCE = tuple(field.name for field in FAMILIES["bagel"].request_fields)
_PARAMS = with_fields(BagelParams, FAMILIES["bagel"].request_fields)


class BagelEngine(DiffusionEngineBase):
    """A BAGEL checkpoint loaded for generation in this process."""

    def __init__(self, config: DiffusionEngineConfig) -> None:
        import torch

        from omni_runtime.modeling.bagel.config import BagelCheckpointError
        from omni_runtime.modeling.bagel.generation import BagelGenerator

        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        super().__init__(config.connectors)
        self.config = config
        parse_params(config.default_params, "defaultSamplingParams", _PARAMS)
        self.device = engine_device(config)
        # auto: bf16, as the released weights are and the reference's attention runs.
        dtype = torch_dtype("bfloat16" if config.dtype == "auto" else config.dtype)
        try:
            self.generator = BagelGenerator.load(
                _local_checkpoint(config.model), dtype=dtype, device=self.device
            )
        except BagelCheckpointError as e:
            raise InvalidRequestError(f"model: {e}", "model") from None
        self.shape = self.generator.shape
        self.compute_dtype = self.generator.model.dtype
        self.size_multiple = self.shape.latent_downsample
        self.max_side = self.generator.max_side()
        transform = self.shape.vae_transform
        self.default_size = (transform.max_size, transform.max_size)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.config.model,
            "device": self.device,
            "pipeline": "BAGEL",
            "family": "bagel",
            "takes_image": True,
            "size_multiple": self.size_multiple,
            "max_side": self.max_side,
            "default_size": list(self.default_size),
        }

    def validate(self, request: StageDiffusionCoreRequest) -> BagelParams:
        parse_params(request.params, "params", _PARAMS)
        params = parse_params({**self.config.default_params, **request.params}, "params", _PARAMS)
        check_input_names(request, _CONTEXTS)
        context, no_image = (request.inputs.get(name) for name in _CONTEXTS)
        if context is not None:
            self._check_context(context, "context_kv")
            if no_image is not None:
                self._check_context(no_image, "no_image_context_kv")
        elif no_image is not None:
            raise InvalidRequestError(
                "no_image_context_kv: given without context_kv", "no_image_context_kv"
            )
        elif request.prompt is None:
            raise InvalidRequestError("prompt: required (the text BAGEL generates from)", "prompt")
        for name in ("prompt_embeds", "negative_prompt_embeds"):
            if getattr(request, name) is not None:
                raise InvalidRequestError(
                    f"{name}: BAGEL's DiT reads its context from the prompt and image, not "
                    "embeddings",
                    name,
                )
        if params.guidance_scale is not None:
            if getattr(params, "cfg_text_scale", None) is not None:
                raise InvalidRequestError(
                    "guidance_scale: give cfg_text_scale or guidance_scale (the same scale), "
                    "not both",
                    "guidance_scale",
                )
            params = msgspec.structs.replace(
                params, cfg_text_scale=params.guidance_scale, guidance_scale=None
            )
        interval = getattr(params, "cfg_interval", None)
        if interval is not None and interval[0] >= interval[1]:
            raise InvalidRequestError(
                f"cfg_interval: expected [low, high] with low < high in [0, 1], got "
                f"{list(interval)}",
                "cfg_interval",
            )
        check_sizes(params, self.size_multiple, self.max_side)
        if (params.height is None) != (params.width is None):
            raise InvalidRequestError("height: give height and width together", "height")
        if len(request.images) > 1:
            raise InvalidRequestError(
                f"image: BAGEL edits one input image (got {len(request.images)})", "image"
            )
        if request.images:
            image = request.images[0]
            if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
                raise InvalidRequestError(
                    f"image: expected uint8 RGB [height, width, 3], got {image.dtype} "
                    f"{list(image.shape)}",
                    "image",
                )
        elif params.height is None:
            params.height, params.width = self.default_size
        if context is not None and request.images and no_image is None:
            raise InvalidRequestError(
                "no_image_context_kv: required with context_kv for an edit (the image-dropped "
                "context its image guidance runs against)",
                "no_image_context_kv",
            )
        return params

    def _check_context(self, hand_off: HandOff, name: str) -> None:
        llm = self.shape.llm
        expected = [2, llm.num_layers, -1, llm.num_kv_heads, llm.head_dim]
        shape = list(hand_off.handle.shape)
        fits = len(shape) == 5 and all(
            e in (-1, got) for e, got in zip(expected, shape, strict=True)
        )
        if not fits or shape[2] < 1:
            raise InvalidRequestError(
                f"{name}: expected keys and values of shape [2, {llm.num_layers}, tokens, "
                f"{llm.num_kv_heads}, {llm.head_dim}], got {shape}",
                name,
            )
        dtype = hand_off.handle.dtype
        if dtype not in ("bfloat16", "float16", "float32"):
            raise InvalidRequestError(f"{name}: a {dtype} KV cache is not supported", name)
        if "rope" not in hand_off.meta:
            raise InvalidRequestError(f"{name}: its meta has no rope (the next position)", name)
        rope, prefix_length, prefix_rope = _positions(hand_off)
        if not 0 <= prefix_length <= shape[2] or rope < 0 or prefix_rope < 0:
            raise InvalidRequestError(
                f"{name}: prefix_length {prefix_length}, rope {rope} and prefix_rope "
                f"{prefix_rope} do not fit a context of {shape[2]} tokens",
                name,
            )

    def _context(self, request: StageDiffusionCoreRequest, name: str) -> Any:
        """The context KV handed off as ``name``, fetched onto this engine's device."""
        from omni_runtime.modeling.bagel.model import ContextKV

        kv = self.fetch(request, name)
        return ContextKV(kv[0], kv[1], _positions(request.inputs[name])[0])

    def _run(
        self,
        request: StageDiffusionCoreRequest,
        params: BagelParams,
        should_abort: Callable[[], bool],
        emit: PartialEmit | None = None,
    ) -> np.ndarray:
        # BAGEL's DiT makes no partial images: the router asks it for none.
        import torch
        from PIL import Image

        from omni_runtime.modeling.bagel.generation import default_guidance

        def on_step(step: int) -> None:
            if should_abort():
                raise RequestAbortedError

        edit = bool(request.images)
        guidance = default_guidance(edit)
        overrides: dict[str, Any] = {
            "num_timesteps": params.num_inference_steps,
            **{name: getattr(params, name) for name in _GUIDANCE},
        }
        guidance = dataclasses.replace(
            guidance, **{k: v for k, v in overrides.items() if v is not None}
        )
        generator = torch.Generator()
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        image = None
        if edit:
            picture = Image.fromarray(np.asarray(request.images[0]), mode="RGB")
            image = self.generator.prepare_image(picture)
        if "context_kv" in request.inputs:
            contexts = self._fetched_contexts(request, image, params)
            if image is not None:
                # The thinker drew the VAE's sample of the image with this seed; the
                # initial noise is the draw after it.
                self.generator.skip_vae_sample(image, generator)
        else:
            assert request.prompt is not None
            contexts = self.generator.contexts(
                request.prompt, image, params.height or 0, params.width or 0, generator
            )
        return np.stack(
            [
                self.generator.generate(contexts, guidance, generator, on_step)
                for _ in range(params.num_images)
            ]
        )

    def _fetched_contexts(
        self, request: StageDiffusionCoreRequest, image: Any, params: BagelParams
    ) -> Any:
        from omni_runtime.modeling.bagel.generation import Contexts

        full = self._context(request, "context_kv")
        no_image = full
        if "no_image_context_kv" in request.inputs:
            no_image = self._context(request, "no_image_context_kv")
        _, prefix_length, prefix_rope = _positions(request.inputs["context_kv"])
        size = (params.height or 0, params.width or 0)
        if image is not None and not all(size):
            size = (image.height, image.width)
        return Contexts(full, full.prefix(prefix_length, prefix_rope), no_image, size)


def _positions(hand_off: HandOff) -> tuple[int, int, int]:
    """A context hand-off's RoPE position, its text-dropped prefix's length and position."""
    meta = hand_off.meta
    return meta.get("rope", 0), meta.get("prefix_length", 0), meta.get("prefix_rope", 0)


def _local_checkpoint(model: str) -> str:
    """``model`` if it is a directory; else the hub id's snapshot, fetched into HF_HOME
    if not there (the thinker beside this stage fetches the same files)."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    path: str = snapshot_download(model)
    return path
