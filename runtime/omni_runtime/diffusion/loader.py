"""The diffusion engine a stage runs: its family's own engine where the family has one
(``DiTRecipe.engine``: BAGEL's), else the diffusers pipeline the checkpoint holds (run
through its family's runner, ``DiTRecipe.runner``).

Apart from the engines' modules so that none imports another: a family's engine builds on
``diffusion.engine_base``, and is imported by name only here, in the process that runs it.
"""

from __future__ import annotations

from omni_runtime.diffusion.engine import DiffusionEngine
from omni_runtime.diffusion.engine_base import DiffusionEngineBase, DiffusionEngineConfig
from omni_runtime.diffusion.runners.base import import_named
from omni_runtime.families import FAMILIES


def load_diffusion_engine(config: DiffusionEngineConfig) -> DiffusionEngineBase:
    """The engine for ``config``'s model."""
    family = FAMILIES.get(config.family) if config.family is not None else None
    if family is not None and family.dit.engine is not None:
        engine: DiffusionEngineBase = import_named(family.dit.engine)(config)
        return engine
    return DiffusionEngine(config)
