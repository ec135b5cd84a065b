"""HunyuanVideo-1.5's runner (diffusers' HunyuanVideo15Pipeline and
HunyuanVideo15ImageToVideoPipeline, 0.42.1), for the families ``hunyuanvideo-1.5`` and
``hunyuanvideo-1.5-i2v``. Its pipelines depart from diffusers' plain conventions four ways:

- guidance is the pipeline's guider's: ``__call__`` takes no ``guidance_scale``, so a
  request's is set on the guider for its call;
- ``__call__`` takes no step callback: the steps are told by the transformer's calls, for
  aborts and progress;
- its second text encoder, ByT5 (``text_encoder_2``), stays in the DiT stage and reads the
  prompt's quoted text: the DiT takes the prompt's text beside the upstream embeddings,
  which the pipeline's tokenizer pads to a length;
- image-to-video sizes the clip from the input image (``DiTRecipe.sized_by_image``) and
  takes no height or width.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from omni_runtime.diffusion.params import DiffusionParams, InvalidRequestError
from omni_runtime.diffusion.runners.base import PipelineRunner
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest
from omni_runtime.families.base import Family


class HunyuanVideoRunner(PipelineRunner):
    def __init__(self, pipeline: Any, family: Family | None, device: str, dtype: Any) -> None:
        super().__init__(pipeline, family, device, dtype)
        # The glyph encoder runs where the checkpoint has it; its encode_prompt zero-pads
        # the upstream embeddings to its tokenizer's length, and so must the DiT stage.
        rows = getattr(pipeline, "tokenizer_max_length", None)
        self.glyph = (
            "prompt_embeds_2" in self.call_args
            and getattr(pipeline, "text_encoder_2", None) is not None
            and isinstance(rows, int)
        )
        if self.glyph:
            self.embeds_rows = rows
        # Each prompt has glyph embeddings of its own (ByT5's), which the pipeline takes
        # for one prompt only.
        self.batches = not self.glyph

    def takes(self, name: str) -> bool:
        # Set on the pipeline's guider for the call.
        return name == "guidance_scale" or super().takes(name)

    def check_params(self, params: DiffusionParams) -> None:
        if self.family is not None and self.family.dit.sized_by_image:
            for name in ("height", "width"):
                if getattr(params, name) is not None:
                    raise InvalidRequestError(
                        f"{name}: not a parameter of this pipeline "
                        f"({type(self.pipeline).__name__}): it sizes its output from the "
                        "input image's aspect ratio",
                        name,
                    )
        super().check_params(params)

    def check_embeds(
        self, request: StageDiffusionCoreRequest, shapes: Mapping[str, tuple[int, ...]]
    ) -> None:
        if "prompt_embeds" in shapes and self.glyph and request.prompt is None:
            raise InvalidRequestError(
                "prompt: required beside prompt_embeds: this pipeline encodes the prompt's "
                "quoted text itself",
                "prompt",
            )

    def upstream_kwargs(
        self, request: StageDiffusionCoreRequest, params: DiffusionParams, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """ByT5's embeddings of the prompt's quoted text (and, where the request runs
        guidance, the negative prompt's), as the pipeline's own encode_prompt computes
        them beside the upstream embeddings in ``kwargs``."""
        if not self.glyph:
            return {}
        import torch

        texts = {"prompt_embeds": request.prompt}
        if kwargs.get("negative_prompt_embeds") is not None:
            texts["negative_prompt_embeds"] = params.negative_prompt
        result: dict[str, Any] = {}
        # Without autograd, as the pipeline's __call__ runs it: ByT5's output differs in
        # the last bits with it on.
        with torch.inference_mode():
            for name, text in texts.items():
                _, _, glyph, glyph_mask = self.pipeline.encode_prompt(
                    text,
                    device=self.device,
                    dtype=self.dtype,
                    prompt_embeds=kwargs[name],
                    prompt_embeds_mask=kwargs[f"{name}_mask"],
                )
                result[f"{name}_2"], result[f"{name}_mask_2"] = glyph, glyph_mask
        return result

    def __call__(self, params: DiffusionParams, kwargs: dict[str, Any], pictures: list[Any]) -> Any:
        guidance = kwargs.pop("guidance_scale", None)
        on_step_end = kwargs.pop("callback_on_step_end")
        with self._guided(guidance), self._watched_steps(on_step_end):
            return super().__call__(params, kwargs, pictures)

    @contextlib.contextmanager
    def _guided(self, scale: float | None) -> Iterator[None]:
        """The pipeline's guider at the request's guidance scale while it runs (as it is,
        for a request that sets none)."""
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
    def _watched_steps(self, on_step_end: Callable[..., Any]) -> Iterator[None]:
        """``on_step_end`` called as each denoising step ends, as a step callback would be.
        Told by the transformer's calls (a forward pre-hook, PyTorch's own): a call with a
        new timestep means the step before it ended. It cannot change the latents: it
        aborts and reports progress (the last step's end is told once the pipeline
        returns)."""
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
