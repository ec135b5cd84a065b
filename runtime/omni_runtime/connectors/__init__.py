"""Connectors: how one stage's arrays reach a later stage (see :mod:`.base` for the contract).

Importing this package loads neither torch nor any connector's backend: each connector
module is imported when a connector of its kind is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_runtime.config.models import KNOWN_CONNECTORS
from omni_runtime.connectors.base import (
    ConnectorError,
    ConnectorHandle,
    ConnectorUnavailableError,
    OmniConnector,
)

if TYPE_CHECKING:
    from omni_runtime.config import ConnectorConfig

__all__ = [
    "KNOWN_CONNECTORS",
    "ConnectorError",
    "ConnectorHandle",
    "ConnectorUnavailableError",
    "OmniConnector",
    "make_connector",
]


def make_connector(name: str, config: ConnectorConfig) -> OmniConnector:
    """The connector ``name`` of a pipeline, of the class ``config.name`` names."""
    kind = config.name
    if kind == "SharedMemoryConnector":
        from omni_runtime.connectors.shared_memory import SharedMemoryConnector

        return SharedMemoryConnector(name, config.extra)
    if kind in ("TCPConnector", "TcpConnector"):
        from omni_runtime.connectors.tcp import TCPConnector

        return TCPConnector(name, config.extra)
    if kind == "MooncakeTransferEngineConnector":
        from omni_runtime.connectors.mooncake import MooncakeTransferEngineConnector

        return MooncakeTransferEngineConnector(name, config.extra)
    raise ValueError(
        f"connector {name!r}: unknown connector class {kind!r}; "
        f"known: {', '.join(KNOWN_CONNECTORS)}"
    )
