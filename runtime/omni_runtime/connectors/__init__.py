"""Connectors: how one stage's arrays reach a later stage (see :mod:`.base` for the contract).

Importing this package loads neither torch nor any connector's backend: each connector
module is imported when a connector of its kind is made.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from omni_runtime.config import ConnectorConfig
from omni_runtime.config.connectors import KNOWN_CONNECTORS
from omni_runtime.connectors.base import (
    ConnectorError,
    ConnectorHandle,
    ConnectorUnavailableError,
    OmniConnector,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_HANDOFF_CONNECTOR",
    "KNOWN_CONNECTORS",
    "ConnectorError",
    "ConnectorHandle",
    "ConnectorUnavailableError",
    "OmniConnector",
    "StageConnectors",
    "make_connector",
]

# The connector a hand-off uses when the pipeline declares none for its edge: pull over
# TCP works between any two stages, on one host or across pods.
DEFAULT_HANDOFF_CONNECTOR = "default-tcp"
_DEFAULT_HANDOFF_CONFIG = ConnectorConfig(name="TCPConnector")


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


class StageConnectors:
    """The pipeline's connectors as one stage process uses them, each made on first use."""

    def __init__(self, configs: Mapping[str, ConnectorConfig]) -> None:
        self._configs = dict(configs)
        self._connectors: dict[str, OmniConnector] = {}

    def get(self, name: str) -> OmniConnector:
        """The connector ``name``; KeyError naming the defined ones if there is none."""
        connector = self._connectors.get(name)
        if connector is None:
            config = self._configs.get(name)
            if config is None and name == DEFAULT_HANDOFF_CONNECTOR:
                config = _DEFAULT_HANDOFF_CONFIG
            if config is None:
                defined = ", ".join(self._configs) or "none"
                raise KeyError(f"unknown connector {name!r} (defined: {defined})")
            connector = self._connectors[name] = make_connector(name, config)
        return connector

    def close(self) -> None:
        for connector in self._connectors.values():
            try:
                connector.close()
            except Exception:  # closing the others matters more than this one's failure
                logger.exception("closing connector %s failed", connector.name)
        self._connectors.clear()
