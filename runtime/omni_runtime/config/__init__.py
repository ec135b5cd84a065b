"""The pipeline schema, shared by the runtime and the operator.

Imports only pydantic, PyYAML and the standard library: the operator image has no ML
libraries.
"""

from .errors import PipelineConfigError
from .loader import dump_pipeline, load_pipeline
from .models import (
    ConnectorConfig,
    Dtype,
    LLMOutput,
    PipelineConfig,
    RouterConfig,
    RouterPolicy,
    StageConfig,
)
from .topologies import StageType

__all__ = [
    "ConnectorConfig",
    "Dtype",
    "LLMOutput",
    "PipelineConfig",
    "PipelineConfigError",
    "RouterConfig",
    "RouterPolicy",
    "StageConfig",
    "StageType",
    "dump_pipeline",
    "load_pipeline",
]
