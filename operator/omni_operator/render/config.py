"""The pipeline's configuration as its pods read it: the ConfigMap, its hash (which rolls
the pods when it changes) and the revision the stage pods advertise."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from omni_runtime.config import dump_pipeline

from ..api import OmniPipelineSpec, runtime_config
from ..placement import CONFIG_DIR
from .context import RenderContext
from .names import COMPONENT_CONFIG, config_map_name, video_store_url

CONFIG_KEY = "pipeline.json"
CONFIG_FILE = f"{CONFIG_DIR}/{CONFIG_KEY}"


def config_data(spec: OmniPipelineSpec, name: str) -> dict[str, str]:
    """The ConfigMap's data: the runtime pipeline of pipeline ``name``, as the stage and
    router processes load it (a managed video store's address is named after the pipeline).

    Replica counts are left out: in a cluster they live in the Deployments (a pod runs one
    replica; the router discovers them all), and with them in the config, scaling a stage
    would change the config hash and roll every pod of the pipeline.
    """
    pipeline = dump_pipeline(runtime_config(spec, video_store_url(name)))
    for stage in pipeline["stages"]:
        stage.pop("replicas", None)
    text = json.dumps(pipeline, indent=2, sort_keys=True)
    return {CONFIG_KEY: text + "\n"}


def config_hash(data: Mapping[str, str]) -> str:
    """The pod templates' config-hash annotation for ConfigMap ``data``."""
    canonical = json.dumps(dict(data), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def pipeline_revision(config_generation: int, hash_: str) -> str:
    """What a stage pod advertises as its revision (see the module docstring)."""
    return f"{max(0, config_generation)}-{hash_}"


def config_map(ctx: RenderContext, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": ctx.metadata(
            config_map_name(ctx.name, ctx.config_hash), ctx.labels(COMPONENT_CONFIG)
        ),
        # One configuration per ConfigMap, never changed: the kubelet need not watch it.
        "immutable": True,
        "data": data,
    }
