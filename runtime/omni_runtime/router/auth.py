"""API keys on the router, as vLLM's OpenAI server has them: ``Authorization: Bearer <key>``.

Keys come from a file (``--api-key-file``: one key per line, blank lines and ``#`` comments
ignored), from ``OMNI_API_KEY``, or both. The file is read again at most every
``recheck_interval`` seconds, so that a rotated Kubernetes Secret mounted there takes
effect without a restart: a key removed from it is refused from the next read on. A file
that cannot be read or holds no key at that point keeps the keys last read (a Secret
being rewritten must not open the router, nor lock everyone out).

Only SHA-256 digests of the keys are held, and a presented key's digest is compared with
every one of them in constant time, so neither the time taken nor the length of a
guess tells anything about the keys. No key is ever logged.

Without keys nothing is checked. With keys, every path needs one except the probes
(``/health``, ``/livez``) and, unless ``metrics_need_api_key``, ``/metrics``. A request
without a right key gets 401 with an OpenAI-shaped error and ``WWW-Authenticate: Bearer``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

DEFAULT_RECHECK_INTERVAL = 1.0
PROBE_PATHS = frozenset({"/health", "/livez"})
METRICS_PATH = "/metrics"

_UNAUTHORIZED = orjson.dumps(
    {
        "error": {
            "message": "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
            "type": "invalid_request_error",
            "param": None,
            "code": 401,
        }
    }
)


class ApiKeyError(ValueError):
    """Keys that cannot be used at start; the message says where and why."""


def parse_keys(text: str) -> list[str]:
    """The keys in a key file's ``text``: one per line, blanks and ``#`` comments skipped."""
    keys = []
    for line in text.splitlines():
        key = line.strip()
        if key and not key.startswith("#"):
            keys.append(key)
    return keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The keys the router accepts (see the module docstring)."""

    def __init__(
        self,
        *,
        file: Path | None = None,
        key: str | None = None,
        recheck_interval: float = DEFAULT_RECHECK_INTERVAL,
    ) -> None:
        self.file = file
        self.recheck_interval = recheck_interval
        self._fixed = [_digest(key)] if key else []
        self._from_file: list[bytes] = []
        self._file_text: str | None = None
        # When the file was last read (time.monotonic()).
        self.checked_at = float("-inf")
        if file is not None:
            try:
                text = file.read_text()
            except OSError as e:
                raise ApiKeyError(
                    f"--api-key-file: cannot read {file}: {e.strerror or e}"
                ) from None
            if not parse_keys(text):
                raise ApiKeyError(
                    f"--api-key-file: {file} holds no key (one key per line; blank lines "
                    "and # comments are skipped)"
                )
            self._take(text)
        if not self._fixed and not self._from_file:
            raise ApiKeyError("no API key given: pass --api-key-file or set OMNI_API_KEY")
        self._next_check = time.monotonic() + recheck_interval

    @classmethod
    def from_settings(cls, file: Path | None, key: str | None) -> ApiKeys | None:
        """The keys of ``--api-key-file`` and ``OMNI_API_KEY``; None when neither is set."""
        if file is None and not key:
            return None
        return cls(file=file, key=key)

    def accepts(self, presented: str) -> bool:
        """Whether ``presented`` is one of the keys, in time independent of the keys."""
        self._refresh_if_due()
        digest = _digest(presented)
        accepted = False
        for known in self._digests():
            accepted |= hmac.compare_digest(known, digest)
        return accepted

    def _digests(self) -> Iterable[bytes]:
        return [*self._fixed, *self._from_file]

    def _refresh_if_due(self) -> None:
        if self.file is None:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.recheck_interval
        self.checked_at = now
        try:
            text = self.file.read_text()
        except OSError as e:
            logger.warning(
                "cannot read the API key file %s (%s); keeping the keys read before",
                self.file,
                e.strerror or e,
            )
            return
        if text == self._file_text:
            return
        if not parse_keys(text):
            logger.warning(
                "the API key file %s holds no key now; keeping the keys read before", self.file
            )
            return
        self._take(text)
        logger.info("API keys reloaded from %s (%d key(s))", self.file, len(self._from_file))

    def _take(self, text: str) -> None:
        self._file_text = text
        self._from_file = [_digest(key) for key in parse_keys(text)]


class RequireApiKey:
    """ASGI middleware: 401 for a request without one of ``keys`` on a guarded path.

    Plain ASGI, like the router's other middleware, so that it does not wrap ``receive``.
    """

    def __init__(self, app: ASGIApp, keys: ApiKeys, open_paths: frozenset[str]) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "") in self.open_paths:
            await self.app(scope, receive, send)
            return
        if self.keys.accepts(_bearer_token(scope)):
            await self.app(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})


def open_paths(metrics_need_api_key: bool) -> frozenset[str]:
    """The paths served without a key."""
    return PROBE_PATHS if metrics_need_api_key else PROBE_PATHS | {METRICS_PATH}


def _bearer_token(scope: Scope) -> str:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""
