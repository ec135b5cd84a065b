"""What every object of one pipeline's rendering shares."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..api import OmniPipelineSpec
from ..placement import PlacementGroup
from .names import COMPONENT_ROUTER, COMPONENT_STAGES, child_labels, child_metadata


@dataclass(frozen=True)
class RenderContext:
    """What every object of one pipeline shares."""

    name: str
    namespace: str
    uid: str
    spec: OmniPipelineSpec
    default_image: str
    default_gpu_image: str
    config_hash: str
    config_generation: int = 0
    operator_namespace: str | None = None

    def labels(self, component: str, group: PlacementGroup | None = None) -> dict[str, str]:
        return child_labels(self.name, component, group)

    def metadata(self, name: str, labels: Mapping[str, str]) -> dict[str, Any]:
        return child_metadata(self.name, self.namespace, self.uid, name, labels)

    def group_labels(self, group: PlacementGroup) -> dict[str, str]:
        return self.labels(COMPONENT_STAGES, group)

    def router_labels(self) -> dict[str, str]:
        return self.labels(COMPONENT_ROUTER)
