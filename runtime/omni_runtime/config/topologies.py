"""The stage types a pipeline's stages may have.

What stages a known model's pipeline has (so that a deploy YAML for it may leave out their
types and names) is its family's topology (``omni_runtime.families``).
"""

from __future__ import annotations

from typing import Literal, get_args

StageType = Literal["llm", "diffusion"]
STAGE_TYPES: tuple[str, ...] = get_args(StageType)
