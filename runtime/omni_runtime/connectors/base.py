"""The connector contract: how one stage's arrays reach a later stage without the router.

A producer stage ``put``s an array under a key and gets a small :class:`ConnectorHandle`
back; the handle travels through the router (a few hundred bytes, never the payload) to the
consumer stage, which ``get``s the array. Handoff is by pull: the consumer fetches from the
producer. A ``get`` that succeeds releases the producer's copy (one consumer per key);
``release`` drops a key that will never be fetched (an aborted request); entries nobody
fetches expire after ``ttl`` seconds, and ``close`` drops everything a connector holds.

Arrays keep their dtype and shape, bfloat16 included: the handle names the dtype in
torch's spelling (``float32``, ``bfloat16``, ...).
"""

from __future__ import annotations

import hmac
import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import numpy as np
    import torch

# How long a producer keeps an array nobody has fetched.
DEFAULT_TTL_SECONDS = 300.0


class ConnectorError(RuntimeError):
    """A transfer that cannot be done; the message says which key and why."""


class ConnectorUnavailableError(ConnectorError):
    """A connector whose backend is not installed here; the message says what to install."""


class ConnectorHandle(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Where a consumer finds one array: which connector, at which producer, under what key."""

    # The connector's name in the pipeline's ``connectors`` (e.g. shared_memory_connector).
    connector: str
    key: str
    dtype: str
    shape: list[int]
    nbytes: int
    # The producer, as the consumer reaches it (unused by the shared-memory connector).
    host: str = ""
    port: int = 0
    # Backend-specific locators (a segment name, a remote buffer address).
    extra: dict[str, Any] = {}
    # A secret the producer made for this hand-off alone (connectors reached over the
    # network): it answers only a get that presents it. The handle travels from producer to
    # router to consumer on the pipeline's authenticated stage sockets, so no one else has it.
    token: str = ""


def new_token() -> str:
    """An unguessable hand-off token (192 bits)."""
    return secrets.token_urlsafe(24)


def token_matches(expected: str, given: str) -> bool:
    """Whether ``given`` is ``expected``, in time independent of where they differ."""
    return hmac.compare_digest(expected.encode(), given.encode())


class OmniConnector(ABC):
    """One connector of a pipeline, as used in one stage process (producer and consumer)."""

    def __init__(self, name: str, extra: Mapping[str, Any] | None = None) -> None:
        self.name = name
        self.extra = dict(extra or {})
        self.ttl = float(self.extra.get("ttl_seconds", DEFAULT_TTL_SECONDS))

    @abstractmethod
    def put(self, key: str, array: torch.Tensor | np.ndarray) -> ConnectorHandle:
        """Keep ``array`` (any device) under ``key`` until a consumer fetches it."""

    @abstractmethod
    def get(self, handle: ConnectorHandle, device: str = "cpu") -> torch.Tensor:
        """Fetch the array ``handle`` names onto ``device``; the producer's copy is then
        released. ConnectorError (naming the key) if it is gone or never existed."""

    @abstractmethod
    def release(self, key: str) -> None:
        """Drop ``key`` on the producer side; nothing happens if it is already gone."""

    @abstractmethod
    def close(self) -> None:
        """Release everything this connector holds, on both sides. Idempotent."""
