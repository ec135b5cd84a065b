"""The diffusion engine a stage runs: its family's own engine where the family has one
(``DiTRecipe.engine``: BAGEL's), else the diffusers pipeline the checkpoint holds.

Apart from the engines' modules so that none imports another: a family's engine builds on
``diffusion.engine``'s base, and is imported by name only here, in the process that runs it.
"""

from __future__ import annotations

import importlib

from omni_runtime.diffusion.engine import (
    DiffusionEngine,
    DiffusionEngineBase,
    DiffusionEngineConfig,
)
from omni_runtime.families import FAMILIES


def load_diffusion_engine(config: DiffusionEngineConfig) -> DiffusionEngineBase:
    """The engine for ``config``'s model."""
    family = FAMILIES.get(config.family) if config.family is not None else None
    if family is not None and family.dit.engine is not None:
        module_name, _, class_name = family.dit.engine.partition(":")
        engine_class = getattr(importlib.import_module(module_name), class_name)
        engine: DiffusionEngineBase = engine_class(config)
        return engine
    return DiffusionEngine(config)
