"""Partial images: what a request's image looks like part way through its denoising.

OpenAI's Images API streams up to three partial images before the final one
(``partial_images``); here a partial is the image the step's predicted clean latent
decodes to, through the family's own VAE, at evenly spaced steps.

A flow-matching Euler step moves the latent along the model's velocity v:
x[i+1] = x[i] + (sigma[i+1] - sigma[i]) * v, and x = (1 - sigma) * x0 + sigma * noise with
v = noise - x0, so the clean latent it points at is x0 = x[i+1] - sigma[i+1] * v, where v
follows from the two latents the step went between. That needs the latent before the step
(the one after the previous step), so step 0 has no partial; and the last step's is the
final image itself. A request may so get fewer partials than it asked for, as OpenAI's API
allows.

How a family's latents become pixels differs (``families.PreviewLayout``): Qwen-Image's
are packed 2x2 and decoded by a video VAE normalised per channel; Z-Image's are plain
[batch, channels, height, width] with the VAE's scaling and shift.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from omni_runtime.images import to_uint8


def partial_steps(steps: int, count: int) -> list[int]:
    """The steps (0-based) after which a request of ``steps`` steps sends its partials:
    ``count`` of them evenly spaced, none at step 0 (no latent before it) nor at the last
    (the final image), and none twice."""
    if count <= 0:
        return []
    chosen = {round((j + 1) * (steps - 1) / (count + 1)) for j in range(count)}
    return sorted(step for step in chosen if 1 <= step <= steps - 2)


class PartialImages:
    """One run's partials: ``emit(images, index)`` gets each, uint8 [n, height, width, 3].

    Call :meth:`after_step` from the pipeline's ``callback_on_step_end`` with every step's
    latents. ``watch`` hooks the transformer to learn the latent grid where the layout
    needs it (packed latents do not say their height); the caller removes what it returns.
    """

    def __init__(
        self,
        pipeline: Any,
        layout: str,
        steps: list[int],
        emit: Callable[[np.ndarray, int], None],
    ) -> None:
        self.pipeline = pipeline
        self.layout = layout
        self.steps = set(steps)
        self.emit = emit
        self.sent = 0
        self._before: Any = None
        # Packed latents: (rows, columns) of 2x2 patches of the image being made.
        self._grid: tuple[int, int] | None = None

    def watch(self) -> Any:
        """A hook on the transformer that reads the packed latents' grid; None if the
        layout needs none. Remove the returned handle after the run."""
        if self.layout != "packed-3d":
            return None

        def grid(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
            shapes = kwargs.get("img_shapes")
            if shapes:
                # The image being made first, then an edit's input images.
                _, rows, columns = shapes[0][0]
                self._grid = (int(rows), int(columns))

        return self.pipeline.transformer.register_forward_pre_hook(grid, with_kwargs=True)

    def after_step(self, step: int, latents: Any) -> None:
        before, self._before = self._before, latents.detach().clone()
        if step not in self.steps or before is None:
            return
        scheduler = self.pipeline.scheduler
        sigmas = getattr(scheduler, "sigmas", None)
        if sigmas is None or len(sigmas) <= step + 1:
            return
        sigma, sigma_next = float(sigmas[step]), float(sigmas[step + 1])
        if sigma_next == sigma:
            return
        velocity = (latents - before) / (sigma_next - sigma)
        clean = latents - sigma_next * velocity
        images = self._decode(clean)
        if images is not None:
            self.emit(images, self.sent)
            self.sent += 1

    def _decode(self, latents: Any) -> np.ndarray | None:
        import torch

        pipeline = self.pipeline
        vae = pipeline.vae
        with torch.inference_mode():
            if self.layout == "packed-3d":
                if self._grid is None:
                    return None
                rows, columns = self._grid
                batch, _, channels = latents.shape
                latents = latents.view(batch, rows, columns, channels // 4, 2, 2)
                latents = latents.permute(0, 3, 1, 4, 2, 5)
                latents = latents.reshape(batch, channels // 4, 1, rows * 2, columns * 2)
                latents = latents.to(vae.dtype)
                shape = (1, vae.config.z_dim, 1, 1, 1)
                mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
                std = torch.tensor(vae.config.latents_std).view(shape).to(latents)
                pixels = vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
            else:
                latents = latents.to(vae.dtype)
                latents = latents / vae.config.scaling_factor + vae.config.shift_factor
                pixels = vae.decode(latents, return_dict=False)[0]
            images = pipeline.image_processor.postprocess(pixels, output_type="np")
        return to_uint8(images)
