"""The diffusion engine a stage runs, by its model family: BAGEL's own engine for a BAGEL
checkpoint, else the diffusers pipeline the checkpoint holds.

Apart from both engines' module so that neither imports the other: BAGEL's engine builds
on ``diffusion.engine``'s base, and this module is the one place that knows both.
"""

from __future__ import annotations

from omni_runtime.config.families import BAGEL_FAMILY
from omni_runtime.diffusion.engine import (
    DiffusionEngine,
    DiffusionEngineBase,
    DiffusionEngineConfig,
)


def load_diffusion_engine(config: DiffusionEngineConfig) -> DiffusionEngineBase:
    """The engine for ``config``'s model."""
    if config.family == BAGEL_FAMILY:
        # BAGEL's modelling code loads only where a BAGEL stage runs.
        from omni_runtime.diffusion.bagel_engine import BagelEngine

        return BagelEngine(config)
    return DiffusionEngine(config)
