"""The pipeline schema, shared by the runtime and the operator.

Imports only pydantic, PyYAML and the standard library: the operator image has no ML
libraries.
"""

from .errors import PipelineConfigError
from .loader import dump_pipeline, load_pipeline
from .models import (
    MAX_STAGE_ID,
    STAGE_PORT_BASE,
    STEP_CACHE_OFF,
    VIDEO_STORE_PASSWORD_ENV,
    AdapterConfig,
    ConnectorConfig,
    Dtype,
    LLMOutput,
    PipelineConfig,
    RouterConfig,
    RouterPolicy,
    StageConfig,
    StepCacheConfig,
    VideoJobsConfig,
    stage_port,
    stage_port_name,
)
from .topologies import StageType

__all__ = [
    "MAX_STAGE_ID",
    "STAGE_PORT_BASE",
    "STEP_CACHE_OFF",
    "VIDEO_STORE_PASSWORD_ENV",
    "AdapterConfig",
    "ConnectorConfig",
    "Dtype",
    "LLMOutput",
    "PipelineConfig",
    "PipelineConfigError",
    "RouterConfig",
    "RouterPolicy",
    "StageConfig",
    "StageType",
    "StepCacheConfig",
    "VideoJobsConfig",
    "dump_pipeline",
    "load_pipeline",
    "stage_port",
    "stage_port_name",
]
