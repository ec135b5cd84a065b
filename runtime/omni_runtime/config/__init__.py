"""The pipeline schema, shared by the runtime and the operator.

Imports only pydantic, PyYAML and the standard library: the operator image has no ML
libraries.
"""

from .adapters import AdapterConfig
from .connectors import ConnectorConfig
from .errors import PipelineConfigError
from .loader import dump_pipeline, load_pipeline
from .models import PipelineConfig
from .router import VIDEO_STORE_PASSWORD_ENV, RouterConfig, RouterPolicy, VideoJobsConfig
from .stages import (
    MAX_STAGE_ID,
    STAGE_PORT_BASE,
    Dtype,
    LLMOutput,
    StageConfig,
    stage_port,
    stage_port_name,
)
from .step_cache import STEP_CACHE_OFF, StepCacheConfig
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
