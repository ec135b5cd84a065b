"""Known pipeline topologies, so a deploy YAML for a known model may leave out stage types.

A topology gives, per stage id, the stage's type and default name. It is looked up by model:
the last component of the model path or hub id (``ByteDance-Seed/BAGEL-7B-MoT`` ->
``bagel-7b-mot``, ``/models/bagel-7b-mot/`` -> ``bagel-7b-mot``) is lower-cased, and a
topology matches when its key is a substring of it. Where several keys match, the longest
wins, so a more specific key (say ``bagel-lite``) can sit beside a general one (``bagel``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, get_args

StageType = Literal["llm", "diffusion"]
STAGE_TYPES: tuple[str, ...] = get_args(StageType)


@dataclass(frozen=True)
class TopologyStage:
    """What a topology says about one stage."""

    stage_id: int
    name: str
    type: StageType
    # LLM stages: what they output (text unless the topology says otherwise).
    output: Literal["text", "hidden_states"] | None = None


@dataclass(frozen=True)
class Topology:
    """The stages of one model family's pipeline, in stage id order."""

    key: str
    stages: tuple[TopologyStage, ...]

    def stage(self, stage_id: int) -> TopologyStage | None:
        """The topology's entry for ``stage_id``, or None if it has no such stage."""
        for stage in self.stages:
            if stage.stage_id == stage_id:
                return stage
        return None


TOPOLOGIES: Mapping[str, Topology] = MappingProxyType(
    {
        "bagel": Topology(
            key="bagel",
            stages=(
                TopologyStage(stage_id=0, name="thinker", type="llm"),
                TopologyStage(stage_id=1, name="dit", type="diffusion"),
            ),
        ),
        # An LLM encodes the prompt (and the input image, for an edit) into the hidden
        # states a DiT denoises with (config.families has what each computes).
        **{
            key: Topology(
                key=key,
                stages=(
                    TopologyStage(stage_id=0, name="encoder", type="llm", output="hidden_states"),
                    TopologyStage(stage_id=1, name="dit", type="diffusion"),
                ),
            )
            for key in ("qwen-image", "qwen-image-edit", "z-image")
        },
    }
)


def model_basename(model: str) -> str:
    """The lower-cased last component of a model path or hub id."""
    parts = [part for part in re.split(r"[/\\]", model.strip()) if part]
    return parts[-1].lower() if parts else ""


def find_topology(model: str) -> Topology | None:
    """The known topology for ``model`` (a path or hub id), or None if none matches."""
    basename = model_basename(model)
    if not basename:
        return None
    matches = [key for key in TOPOLOGIES if key in basename]
    if not matches:
        return None
    return TOPOLOGIES[max(matches, key=len)]
