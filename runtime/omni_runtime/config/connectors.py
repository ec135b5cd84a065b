"""A pipeline's connectors: what carries one stage's output to a later stage."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from .base import SchemaModel

# Connector classes a pipeline's ``connectors.<name>.name`` may give (omni_runtime.connectors
# implements them; the schema lists them so that a typo is refused before anything starts).
KNOWN_CONNECTORS = (
    "SharedMemoryConnector",
    "TCPConnector",
    "TcpConnector",
    "MooncakeTransferEngineConnector",
)
SHARED_MEMORY_CONNECTOR = "SharedMemoryConnector"


class ConnectorConfig(SchemaModel):
    """A connector that carries one stage's output to a later stage."""

    name: str = Field(
        min_length=1,
        description="Connector class: SharedMemoryConnector (stages in one pod), "
        "TCPConnector, or MooncakeTransferEngineConnector (RDMA).",
        json_schema_extra={"enum": list(KNOWN_CONNECTORS)},
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="Connector-specific options.")

    missing_hints = {"name": "the connector class, e.g. SharedMemoryConnector"}

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if value not in KNOWN_CONNECTORS:
            raise ValueError(
                f"unknown connector class {value!r}; known: {', '.join(KNOWN_CONNECTORS)}"
            )
        return value
