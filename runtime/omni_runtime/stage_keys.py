"""The pipeline's stage keys: ZMQ CURVE on every stage-server socket, so that only the
pipeline's own routers can submit work to a stage or read its outputs.

Two key pairs per pipeline:

- the *server* pair: every stage server of the pipeline listens with it; a router knows
  the public half, so it talks to the pipeline's stages and to nothing posing as one;
- the *client* pair: the pipeline's routers connect with it; a stage server admits a peer
  only when its CURVE handshake proves the client secret (a ZAP handler compares the
  public key it presents), so a peer without it, or with another pipeline's, is refused
  before any message reaches the stage.

Keys are Z85 text (40 characters) in files of one directory, named as the operator's
Secret names its data, and found through ``OMNI_STAGE_KEYS_DIR``
(``omni_runtime.config.credentials``). A process
gets only the files its role needs: a stage server reads the server pair and the client's
public key; a router the client pair and the server's public key. ``serve`` generates
ephemeral keys for its stages and router; the operator keeps a pipeline's in a Secret it
owns.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils import z85

from omni_runtime.config.credentials import (
    CLIENT_FILES,
    CLIENT_PUBLIC,
    CLIENT_SECRET,
    KEYS_DIR_ENV,
    SERVER_FILES,
    SERVER_PUBLIC,
    SERVER_SECRET,
)

logger = logging.getLogger(__name__)

# The ZAP domain of stage sockets. With ZAP_ENFORCE_DOMAIN, libzmq refuses every handshake
# when no handler answers for it, instead of admitting everyone: it fails closed.
ZAP_DOMAIN = b"omni-stage"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_VERSION = b"1.0"
# Refused peers are logged at most this often (with a count), so that a scanner cannot
# fill the log.
_REFUSAL_LOG_INTERVAL = 10.0


class StageKeysError(ValueError):
    """Keys that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True, repr=False)
class StageServerKeys:
    """What a stage server needs: its key pair and the one client key it admits."""

    public: bytes
    secret: bytes
    client_public: bytes

    def secure(self, socket: zmq.Socket[Any]) -> None:
        """Make ``socket`` (before it binds) a CURVE server that needs a ZAP answer."""
        socket.curve_server = True
        socket.curve_publickey = self.public
        socket.curve_secretkey = self.secret
        socket.zap_domain = ZAP_DOMAIN
        socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


@dataclass(frozen=True, repr=False)
class StageClientKeys:
    """What a router needs: its key pair and the public key stage servers prove."""

    public: bytes
    secret: bytes
    server_public: bytes

    def secure(self, socket: zmq.Socket[Any]) -> None:
        """Make ``socket`` (before it connects) a CURVE client of the pipeline's stages."""
        socket.curve_publickey = self.public
        socket.curve_secretkey = self.secret
        socket.curve_serverkey = self.server_public


def generate_keys(directory: Path) -> Path:
    """A fresh pair of key pairs written to ``directory`` (created, owner-only); returns it."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    values = {
        SERVER_SECRET: server_secret,
        SERVER_PUBLIC: server_public,
        CLIENT_SECRET: client_secret,
        CLIENT_PUBLIC: client_public,
    }
    for name, value in values.items():
        path = directory / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(value)
    return directory


def keys_directory(environ: Mapping[str, str]) -> Path | None:
    """The directory ``OMNI_STAGE_KEYS_DIR`` names, or None when stage sockets run open."""
    value = environ.get(KEYS_DIR_ENV, "").strip()
    return Path(value) if value else None


def load_server_keys(directory: Path) -> StageServerKeys:
    """A stage server's keys from ``directory``; StageKeysError naming what is wrong."""
    keys = _read(directory, SERVER_FILES)
    _check_pair(directory, keys[SERVER_PUBLIC], keys[SERVER_SECRET], SERVER_PUBLIC)
    return StageServerKeys(keys[SERVER_PUBLIC], keys[SERVER_SECRET], keys[CLIENT_PUBLIC])


def load_client_keys(directory: Path) -> StageClientKeys:
    """A router's keys from ``directory``; StageKeysError naming what is wrong."""
    keys = _read(directory, CLIENT_FILES)
    _check_pair(directory, keys[CLIENT_PUBLIC], keys[CLIENT_SECRET], CLIENT_PUBLIC)
    return StageClientKeys(keys[CLIENT_PUBLIC], keys[CLIENT_SECRET], keys[SERVER_PUBLIC])


def _read(directory: Path, names: tuple[str, ...]) -> dict[str, bytes]:
    keys: dict[str, bytes] = {}
    for name in names:
        path = directory / name
        try:
            value = path.read_bytes().strip()
        except OSError as e:
            raise StageKeysError(
                f"{KEYS_DIR_ENV}: cannot read {path}: {e.strerror or e}; the directory must "
                f"hold {', '.join(names)} (Z85 CURVE keys, as the operator's stage-keys "
                "Secret has them)"
            ) from None
        try:
            raw = z85.decode(value)
        except (ValueError, TypeError, KeyError):
            raw = b""
        if len(value) != 40 or len(raw) != 32:
            raise StageKeysError(
                f"{KEYS_DIR_ENV}: {path} is not a CURVE key: expected 40 Z85 characters "
                f"(a 32-byte key), found {len(value)} bytes"
            )
        keys[name] = value
    return keys


def _check_pair(directory: Path, public: bytes, secret: bytes, public_name: str) -> None:
    if zmq.curve_public(secret) != public:
        raise StageKeysError(
            f"{KEYS_DIR_ENV}: {directory / public_name} is not the public half of the secret "
            "key beside it; regenerate both (the operator does when its Secret is deleted)"
        )


class ZapHandler:
    """Answers libzmq's ZAP requests for one context's stage sockets: a CURVE peer is
    admitted when the key it proved is the pipeline's client key, and refused otherwise,
    before any message of it reaches the stage."""

    def __init__(self, ctx: zmq.asyncio.Context, client_public: bytes, what: str) -> None:
        self._allowed = z85.decode(client_public)
        self._what = what
        self._socket = ctx.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Bound before the stage socket listens, so that no handshake finds it missing.
        self._socket.bind(_ZAP_ENDPOINT)
        self.admitted = 0
        self.refused = 0
        self._unlogged: dict[str, int] = {}
        self._last_log = 0.0

    async def run(self) -> None:
        """Answer until cancelled."""
        while True:
            request = await self._socket.recv_multipart()
            await self._socket.send_multipart(self._answer(request))

    def close(self) -> None:
        self._socket.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6 or request[0] != _ZAP_VERSION:
            request_id = request[1] if len(request) > 1 else b""
            return [_ZAP_VERSION, request_id, b"400", b"malformed ZAP request", b"", b""]
        _, request_id, domain, address, _, mechanism, *credentials = request
        admitted = (
            domain == ZAP_DOMAIN
            and mechanism == b"CURVE"
            and len(credentials) == 1
            and hmac.compare_digest(credentials[0], self._allowed)
        )
        if admitted:
            self.admitted += 1
            return [_ZAP_VERSION, request_id, b"200", b"OK", b"router", b""]
        self.refused += 1
        self._note_refusal(address.decode(errors="replace"))
        return [_ZAP_VERSION, request_id, b"400", b"not this pipeline's key", b"", b""]

    def _note_refusal(self, address: str) -> None:
        self._unlogged[address] = self._unlogged.get(address, 0) + 1
        now = time.monotonic()
        if now - self._last_log < _REFUSAL_LOG_INTERVAL:
            return
        self._last_log = now
        peers = ", ".join(f"{peer} ({n})" for peer, n in sorted(self._unlogged.items()))
        self._unlogged.clear()
        logger.warning("%s: refused peers without this pipeline's stage key: %s", self._what, peers)
