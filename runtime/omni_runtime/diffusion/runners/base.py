"""The runner interface, and the default runner: how the diffusion engine calls a diffusers
pipeline.

The engine (``omni_runtime.diffusion.engine``) owns what every pipeline shares: admission,
validation against the loaded pipeline, fetching handed-off inputs, batching, step caches,
partial images, progress, adapters. A runner owns the pipeline's call conventions: which
request parameters its ``__call__`` takes, how it takes upstream embeddings, what it
checks beyond the common rules, and the call itself. :class:`PipelineRunner` follows
diffusers' plain conventions (guidance as a call argument, a step callback, input images
as ``image``); a pipeline of no family gets its ``AutoPipelineForImage2Image`` variant for
an input image. A family whose pipeline departs from them names a subclass in its
``DiTRecipe.runner``, as its module of this package.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from omni_runtime.diffusion.params import (
    CALL_PARAMS,
    DiffusionParams,
    InvalidRequestError,
    family_fields,
)
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest
from omni_runtime.families.base import Family


def import_named(path: str) -> Any:
    """The object a "module:name" path names (a family's engine or runner)."""
    module_name, _, name = path.partition(":")
    return getattr(importlib.import_module(module_name), name)


def runner_class(family: Family | None) -> type[PipelineRunner]:
    """The runner of ``family``'s pipeline: its own where it names one, else the default."""
    if family is None or family.dit.runner is None:
        return PipelineRunner
    found = import_named(family.dit.runner)
    if not (isinstance(found, type) and issubclass(found, PipelineRunner)):
        raise TypeError(f"{family.name}: its runner {family.dit.runner} is no PipelineRunner")
    return found


class PipelineRunner:
    """A loaded diffusers pipeline's call conventions, diffusers' plain ones.

    Built once per engine, after the pipeline is on its device (``device``, in ``dtype``).
    """

    # Whether requests may share one pipeline call (a batch), where the engine batches.
    batches = True

    def __init__(self, pipeline: Any, family: Family | None, device: str, dtype: Any) -> None:
        self.pipeline = pipeline
        self.family = family
        self.device = device
        self.dtype = dtype
        # What the pipeline's __call__ takes, so that a parameter it would ignore or choke
        # on is refused by name instead.
        self.call_args = frozenset(inspect.signature(pipeline.__call__).parameters)
        # The request parameters handed to __call__ under their own name when set.
        self.call_params = (*CALL_PARAMS, *(field.name for field in family_fields(family)))
        # A video pipeline (Wan, HunyuanVideo) makes frames, one video per prompt.
        self.makes_video = "num_frames" in self.call_args
        # The rows the pipeline's tokenizer pads prompt embeddings to, where its encoder
        # pads to a length (None: to the longest prompt's): an upstream prompt longer than
        # that is refused.
        self.embeds_rows: int | None = None
        self.img2img: Any = None
        if family is None:
            from diffusers import AutoPipelineForImage2Image

            try:
                self.img2img = AutoPipelineForImage2Image.from_pipe(pipeline)
                self.img2img.set_progress_bar_config(disable=True)
            except ValueError:
                pass  # this pipeline family has no image-to-image variant

    @property
    def takes_image(self) -> bool:
        """Whether a request may bring input images."""
        return self.img2img is not None or (self.family is not None and self.family.dit.takes_image)

    def takes(self, name: str) -> bool:
        """Whether the call takes the request parameter ``name`` (one of ``call_params``)."""
        # strength is the image-to-image variant's.
        return name in self.call_args or (name == "strength" and self.img2img is not None)

    def check_params(self, params: DiffusionParams) -> None:
        """InvalidRequestError naming a parameter the request sets that the call lacks."""
        for name in self.call_params:
            if getattr(params, name) is not None and not self.takes(name):
                raise InvalidRequestError(
                    f"{name}: not a parameter of this pipeline ({type(self.pipeline).__name__})",
                    name,
                )

    def check_embeds(
        self, request: StageDiffusionCoreRequest, shapes: Mapping[str, tuple[int, ...]]
    ) -> None:
        """InvalidRequestError if the pipeline cannot run on the request's upstream
        embeddings (by name, their ``shapes``) beside what else the request carries."""

    def check(self, params: DiffusionParams) -> None:
        """InvalidRequestError for what the pipeline cannot run with the request's effective
        parameters (the step-cache tier resolved), beyond the common rules."""

    def call_kwargs(
        self, params: DiffusionParams, on_step_end: Callable[..., Any]
    ) -> dict[str, Any]:
        """The call arguments a request's params give (left out, a parameter is the
        pipeline's own default: a family's pipeline sizes its output itself, an edit's from
        its input image). A video pipeline counts videos, not images."""
        kwargs: dict[str, Any] = {
            name: value
            for name in (*self.call_params, "height", "width")
            if (value := getattr(params, name)) is not None
        }
        count = "num_videos_per_prompt" if self.makes_video else "num_images_per_prompt"
        kwargs.update(
            {count: params.num_images}, output_type="np", callback_on_step_end=on_step_end
        )
        return kwargs

    def embeds_kwargs(self, positives: list[Any], negatives: list[Any]) -> dict[str, Any]:
        """The call arguments that carry the prompts' upstream embeddings (one request's, or
        a batch's: a family's; ``negatives`` None each where guidance runs without them), as
        the family's pipeline takes them: one [prompts, tokens, width] batch, zero-padded,
        with its mask (Qwen-Image's, HunyuanVideo-1.5's)."""
        import torch

        positive, negative = positives[0], negatives[0]
        if self.family is None:
            # Guidance needs an unconditional branch of the prompt's shape; an LLM has no
            # hidden states for an empty prompt, so zeros stand for it.
            return {
                "prompt_embeds": positive.unsqueeze(0),
                "negative_prompt_embeds": torch.zeros_like(positive).unsqueeze(0),
            }
        names = ("prompt_embeds", "prompt_embeds_mask")
        result = dict(zip(names, padded(positives, self.embeds_rows), strict=True))
        if negative is not None:
            names = ("negative_prompt_embeds", "negative_prompt_embeds_mask")
            result.update(zip(names, padded(negatives, self.embeds_rows), strict=True))
        return result

    def upstream_kwargs(
        self, request: StageDiffusionCoreRequest, params: DiffusionParams, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """Call arguments the pipeline computes itself beside a request's upstream
        embeddings (in ``kwargs``): none here."""
        return {}

    def __call__(self, params: DiffusionParams, kwargs: dict[str, Any], pictures: list[Any]) -> Any:
        """The pipeline's output for the call arguments and input images (PIL), run under the
        engine's inference mode and step cache."""
        from PIL import Image

        if len(pictures) > 1:
            # A pipeline of several input images (Qwen-Image-Edit-Plus) takes them as a list.
            return self.pipeline(image=pictures, **kwargs)
        if pictures and self.img2img is not None:
            image = pictures[0]
            if image.size != (params.width, params.height):
                image = image.resize((params.width, params.height), Image.Resampling.BICUBIC)
            # Image-to-image makes the size of its input, resized above.
            del kwargs["height"], kwargs["width"]
            return self.img2img(image=image, **kwargs)
        if pictures:
            return self.pipeline(image=pictures[0], **kwargs)
        kwargs.pop("strength", None)
        return self.pipeline(**kwargs)

    def size_multiple(self) -> int:
        """Heights and widths must be multiples of this for the pipeline to run."""
        pipeline = self.pipeline
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
            # Transformer pipelines pack latents into patches; their image processor is
            # built with the multiple that makes (VAE scale times patch size).
            return int(processor.config.vae_scale_factor)
        transformer = getattr(pipeline, "transformer", None)
        patch = getattr(getattr(transformer, "config", None), "patch_size", 1) or 1
        if isinstance(patch, list | tuple):
            patch = patch[-1]  # a video DiT's patch: (frames, height, width)
        return vae_scale * int(patch)

    def default_size(self) -> tuple[int, int]:
        """The (height, width) the pipeline makes unless told."""
        pipeline = self.pipeline
        height, width = self.call_default("height"), self.call_default("width")
        if isinstance(height, int) and isinstance(width, int):
            return height, width  # a pipeline that says (Wan's 480x832)
        vae_scale = int(getattr(pipeline, "vae_scale_factor", 8))
        denoiser = getattr(pipeline, "unet", None) or getattr(pipeline, "transformer", None)
        sample = getattr(getattr(denoiser, "config", None), "sample_size", 64) or 64
        if isinstance(sample, int):
            return sample * vae_scale, sample * vae_scale
        return int(sample[0]) * vae_scale, int(sample[1]) * vae_scale

    def conditioning_width(self) -> int:
        """The width of the prompt embeddings the denoiser attends to."""
        unet = getattr(self.pipeline, "unet", None)
        if unet is not None:
            return int(unet.config.cross_attention_dim)
        transformer = getattr(self.pipeline, "transformer", None)
        config = getattr(transformer, "config", None)
        # MMDiTs (Qwen-Image) call it joint_attention_dim, Z-Image's DiT cap_feat_dim,
        # HunyuanVideo-1.5's text_embed_dim (its first text encoder's).
        for name in ("joint_attention_dim", "cap_feat_dim", "text_embed_dim"):
            width = getattr(config, name, None)
            if width:
                return int(width)
        return 0

    def call_default(self, name: str) -> Any:
        """The default of the pipeline's __call__ argument ``name`` (None if it has none)."""
        parameter = inspect.signature(self.pipeline.__call__).parameters.get(name)
        if parameter is None or parameter.default is inspect.Parameter.empty:
            return None
        return parameter.default


def padded(rows: list[Any], length: int | None = None) -> tuple[Any, Any]:
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
