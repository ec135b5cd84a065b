"""Mooncake's transfer engine as a connector: the consumer reads the producer's memory.

Each connector owns one memory pool, registered with the process's TransferEngine once at
start (registration pins and maps memory, far too slow to do per array). A ``put`` copies
the array into a slot of that pool; a ``get`` asks the producer, over a small ZMQ side
channel, where the key's slot is, has the engine read it into a slot of its own pool
(``transfer_sync_read``: over tcp here, RDMA on GPU clusters), copies it out so the slot
can be reused, and tells the producer to free its slot. The side channel carries msgspec
structs only, never pickle.

The side channel asks for the handle's token: a lookup without it is answered as a missing
key (no slot address is given out), and only the reader holding it can free the slot. The
transfer engine's own port has no authentication of its own: a peer that reached it and
guessed a registered address could read the pool, which is why the operator's
NetworkPolicy admits only the pipeline's own pods to stage pods.

Importing this module does not import Mooncake (nor torch): the engine is loaded when a
connector is built, and a missing engine or missing system libraries raise
:class:`ConnectorUnavailableError` saying what to install.
"""

from __future__ import annotations

import bisect
import importlib
import ipaddress
import itertools
import logging
import mmap
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import zmq

from omni_runtime.connectors.base import (
    ConnectorError,
    ConnectorHandle,
    ConnectorUnavailableError,
    OmniConnector,
    new_token,
    token_matches,
)
from omni_runtime.net import advertised_host
from omni_runtime.paths import cache_dir

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MOONCAKE_CPU_PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
MOONCAKE_CUDA_PACKAGE = "mooncake-transfer-engine==0.3.13.post1"
# What the engine's extension links against and its wheel does not bring.
SYSTEM_LIBRARIES = ("libibverbs.so.1", "librdmacm.so.1", "libnl-3.so.200", "libnl-route-3.so.200")
DEBIAN_PACKAGES = ("libibverbs1", "librdmacm1", "libnl-3-200", "libnl-route-3-200")
# Overrides where the libraries are (see mooncake_library_path); empty means "the system's".
LIBRARY_PATH_ENV = "OMNI_MOONCAKE_LIBRARY_PATH"

DEFAULT_MEMORY_POOL_SIZE = 1 << 30
DEFAULT_RPC_TIMEOUT_SECONDS = 10.0
# Slot alignment: keeps every slot on a cache line, whatever the dtypes before it.
_ALIGNMENT = 64
# A get whose array does not fit the free part of the local pool reads in chunks, but not
# in chunks so small that per-read overhead dominates.
_MIN_CHUNK = 1 << 20


def mooncake_library_path() -> str | None:
    """The ``LD_LIBRARY_PATH`` entries a process needs to load Mooncake's engine, or None.

    The dynamic loader reads ``LD_LIBRARY_PATH`` once, at process start, so a parent (the
    stage launcher, a test) puts this in the environment of the child that will import
    Mooncake. Precedence:

    1. ``$OMNI_MOONCAKE_LIBRARY_PATH`` as given; set but empty means None (the system's
       loader finds the libraries, e.g. an image that apt-get installed them).
    2. The copy ``scripts/mooncake_libs.sh`` extracted:
       ``${OMNI_CACHE_DIR:-~/.cache/omni-operator}/mooncake-libs/current``, if all four
       libraries are there.
    3. None: nothing to add.
    """
    explicit = os.environ.get(LIBRARY_PATH_ENV)
    if explicit is not None:
        return explicit or None
    root = cache_dir() / "mooncake-libs" / "current"
    if not (root / ".complete").is_file():
        return None
    # Debian splits these packages between /usr/lib and /lib. Resolved, so that a child
    # keeps the copy it started with even if the script later moves `current`.
    dirs = [
        d.resolve()
        for pattern in ("usr/lib/*-linux-gnu", "lib/*-linux-gnu")
        for d in sorted(root.glob(pattern))
        if d.is_dir()
    ]
    if not all(any((d / lib).exists() for d in dirs) for lib in SYSTEM_LIBRARIES):
        return None
    return os.pathsep.join(str(d) for d in dirs)


def with_mooncake_library_path(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` whose ``LD_LIBRARY_PATH`` also finds Mooncake's libraries."""
    out = dict(env)
    extra = mooncake_library_path()
    if not extra:
        return out
    current = [p for p in out.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    added = [p for p in extra.split(os.pathsep) if p and p not in current]
    out["LD_LIBRARY_PATH"] = os.pathsep.join(added + current)
    return out


def _unavailable_message(exc: ImportError) -> str:
    # Both remedies always, in the order of the likelier cause: the wheel's own dependencies
    # are found by pip, the system libraries are what a working pip install still lacks.
    install = (
        f"pip install {MOONCAKE_CPU_PACKAGE} (CPU, protocol tcp; the project's `mooncake` "
        f"extra) or its CUDA build, pip install {MOONCAKE_CUDA_PACKAGE} (protocol rdma)"
    )
    libraries = (
        f"its extension also needs {', '.join(SYSTEM_LIBRARIES)}: apt-get install "
        f"{' '.join(DEBIAN_PACKAGES)}, or, without root, run scripts/mooncake_libs.sh and start "
        f"the process with LD_LIBRARY_PATH set to what it prints"
    )
    missing_package = isinstance(exc, ModuleNotFoundError) and (exc.name or "").startswith(
        "mooncake"
    )
    lines = [
        "MooncakeTransferEngineConnector needs Mooncake's transfer engine, which cannot be "
        f"imported here ({exc}).",
        f"Install it: {install}; {libraries}."
        if missing_package
        else f"The Python package is there, but {libraries}. (The package itself: {install}.)",
    ]
    found = mooncake_library_path()
    on_path = set(os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep))
    if found and not set(found.split(os.pathsep)) <= on_path:
        lines.append(
            f"A copy of the libraries is at {found}, but this process's LD_LIBRARY_PATH lacks "
            f"it (the loader reads it at process start: set it before starting the process)."
        )
    return " ".join(lines)


def _load_transfer_engine_class() -> Any:
    # The engine logs every peer it opens at INFO; warnings and errors still show.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        # By name: the package has no type information, and this keeps mypy's view the
        # same whether or not it is installed.
        engine_module = importlib.import_module("mooncake.engine")
    except ImportError as exc:
        raise ConnectorUnavailableError(_unavailable_message(exc)) from None
    return engine_module.TransferEngine


def _bind_address(host: str) -> str:
    # ZMQ binds to addresses and interface names, not DNS names; a host given as a name
    # (a pod's DNS record) is reached through whichever interface it resolves to.
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return "*"
    return host


@dataclass
class _SharedEngine:
    engine: Any
    rpc_port: int
    users: int


# One TransferEngine per process (per address and transport): it owns listening ports and
# worker threads, so connectors of one process share it and the last to close drops it.
_ENGINES: dict[tuple[str, str, str], _SharedEngine] = {}
_ENGINES_LOCK = threading.Lock()


def _acquire_engine(host: str, protocol: str, device_name: str) -> _SharedEngine:
    engine_class = _load_transfer_engine_class()
    key = (host, protocol, device_name)
    with _ENGINES_LOCK:
        shared = _ENGINES.get(key)
        if shared is None:
            engine = engine_class()
            # Port 0: with P2PHANDSHAKE the engine picks its handshake port; peers learn it
            # from the side channel.
            rc = engine.initialize(f"{host}:0", "P2PHANDSHAKE", protocol, device_name)
            if rc != 0:
                raise ConnectorError(
                    f"Mooncake's TransferEngine.initialize({host!r}, P2PHANDSHAKE, "
                    f"{protocol!r}, {device_name!r}) failed with {rc} (see its log above)"
                )
            shared = _SharedEngine(engine, int(engine.get_rpc_port()), 0)
            _ENGINES[key] = shared
        shared.users += 1
        return shared


def _release_engine(host: str, protocol: str, device_name: str) -> None:
    key = (host, protocol, device_name)
    with _ENGINES_LOCK:
        shared = _ENGINES.get(key)
        if shared is None:
            return
        shared.users -= 1
        if shared.users <= 0:
            del _ENGINES[key]


class _Allocator:
    """First-fit over one contiguous pool; frees coalesce with their neighbours."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0]
        self._sizes: list[int] = [size]
        self._used: dict[int, int] = {}

    def alloc(self, nbytes: int) -> int | None:
        need = -(-nbytes // _ALIGNMENT) * _ALIGNMENT
        for i, free in enumerate(self._sizes):
            if free >= need:
                start = self._starts[i]
                if free == need:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += need
                    self._sizes[i] -= need
                self._used[start] = need
                return start
        return None

    def free(self, start: int) -> None:
        size = self._used.pop(start)
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._sizes.insert(i, size)
        # Merge with the next block, then with the previous one.
        if i + 1 < len(self._starts) and start + size == self._starts[i + 1]:
            self._sizes[i] += self._sizes[i + 1]
            del self._starts[i + 1], self._sizes[i + 1]
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:
            self._sizes[i - 1] += self._sizes[i]
            del self._starts[i], self._sizes[i]

    @property
    def in_use(self) -> int:
        return sum(self._used.values())

    @property
    def largest_free(self) -> int:
        return max(self._sizes, default=0)


@dataclass
class _Entry:
    id: int
    key: str
    offset: int | None  # None: an empty array, nothing in the pool
    nbytes: int
    expires: float
    token: str = ""
    readers: int = 0
    gone: bool = False


# The side channel. A consumer asks where a key is (the producer then keeps the slot until
# Done or ttl), reads it with the engine, and says Done; consumed=False ends the read
# without dropping the key (a failed read can be retried).
class _Lookup(msgspec.Struct, tag="lookup"):
    key: str
    token: str


class _Done(msgspec.Struct, tag="done"):
    entry: int
    consumed: bool
    token: str


class _Located(msgspec.Struct, tag="located"):
    entry: int
    buffer: int
    nbytes: int
    segment: str


class _Missing(msgspec.Struct, tag="missing"):
    reason: str


class _Ack(msgspec.Struct, tag="ack"):
    pass


_REQUEST_DECODER: msgspec.msgpack.Decoder[_Lookup | _Done] = msgspec.msgpack.Decoder(
    _Lookup | _Done
)
_REPLY_DECODER: msgspec.msgpack.Decoder[_Located | _Missing | _Ack] = msgspec.msgpack.Decoder(
    _Located | _Missing | _Ack
)
_ENCODER = msgspec.msgpack.Encoder()


class MooncakeTransferEngineConnector(OmniConnector):
    """Pull by Mooncake's transfer engine; see the module docstring.

    ``extra``: ``host`` ("auto": the interface of the default route, else loopback),
    ``zmq_port`` (side channel; 0 picks a free one), ``protocol`` ("tcp", or "rdma" with
    an RDMA NIC), ``device_name`` (RDMA device, "" for tcp), ``memory_pool_size`` (bytes,
    registered once), ``memory_pool_device`` ("cpu": arrays on a GPU are staged through
    it), ``rpc_timeout_seconds`` (how long a get waits for the producer to answer), and
    the base's ``ttl_seconds``.
    """

    def __init__(self, name: str, extra: Mapping[str, Any] | None = None) -> None:
        super().__init__(name, extra)
        self._closed = True  # until everything below exists, close() has nothing to do
        host = str(self.extra.get("host", "auto") or "auto")
        self.host = advertised_host() if host == "auto" else host
        self.protocol = str(self.extra.get("protocol", "tcp"))
        self.device_name = str(self.extra.get("device_name", "") or "")
        self.pool_size = int(self.extra.get("memory_pool_size", DEFAULT_MEMORY_POOL_SIZE))
        self.rpc_timeout = float(self.extra.get("rpc_timeout_seconds", DEFAULT_RPC_TIMEOUT_SECONDS))
        pool_device = str(self.extra.get("memory_pool_device", "cpu"))
        if pool_device != "cpu":
            raise ConnectorError(
                f"connector {name!r}: memory_pool_device {pool_device!r} is not supported; "
                f"use 'cpu' (arrays on a GPU are staged through the CPU pool)"
            )
        if self.pool_size <= 0:
            raise ConnectorError(f"connector {name!r}: memory_pool_size must be > 0")

        self._lock = threading.Lock()
        self._allocator = _Allocator(self.pool_size)
        self._entries: dict[str, _Entry] = {}
        self._by_id: dict[int, _Entry] = {}
        self._ids = itertools.count(1)
        self._clients: dict[tuple[str, int], zmq.Socket[bytes]] = {}
        self._client_lock = threading.Lock()
        self._request_ids = itertools.count(1)

        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            port = int(self.extra.get("zmq_port", 0) or 0)
            try:
                self._router.bind(f"tcp://{_bind_address(self.host)}:{port or '*'}")
            except zmq.ZMQError as exc:
                raise ConnectorError(
                    f"connector {name!r}: cannot listen on {self.host}:{port} for its side "
                    f"channel: {exc}"
                ) from None
            endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT)
            assert isinstance(endpoint, bytes)
            self.zmq_port = int(endpoint.decode().rsplit(":", 1)[1])
            # close() wakes the server thread through this pair, not by a polling timeout.
            wake_address = f"inproc://mooncake-wake-{id(self)}"
            self._wake_rx = self._ctx.socket(zmq.PAIR)
            self._wake_rx.bind(wake_address)
            self._wake_tx = self._ctx.socket(zmq.PAIR)
            self._wake_tx.connect(wake_address)
            self._start_engine()
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._closed = False
        self._server = threading.Thread(
            target=self._serve, name=f"mooncake-{name}-side-channel", daemon=True
        )
        self._server.start()
        logger.info(
            "connector %s: Mooncake engine at %s (%s), side channel %s:%d, pool %d bytes",
            name,
            self.segment,
            self.protocol,
            self.host,
            self.zmq_port,
            self.pool_size,
        )

    def _start_engine(self) -> None:
        import torch

        shared = _acquire_engine(self.host, self.protocol, self.device_name)
        try:
            # An anonymous mapping: page-aligned, and committed only as it is written
            # (over tcp; RDMA registration pins all of it).
            self._mmap = mmap.mmap(-1, self.pool_size)
            self._pool = torch.frombuffer(self._mmap, dtype=torch.uint8)
            self._base = int(self._pool.data_ptr())
            rc = shared.engine.register_memory(self._base, self.pool_size)
            if rc != 0:
                raise ConnectorError(
                    f"connector {self.name!r}: registering a memory pool of {self.pool_size} "
                    f"bytes with Mooncake's engine failed with {rc}"
                )
        except BaseException:
            _release_engine(self.host, self.protocol, self.device_name)
            raise
        self._engine = shared.engine
        self.segment = f"{self.host}:{shared.rpc_port}"

    # -- producer ------------------------------------------------------------------------

    def put(self, key: str, array: torch.Tensor | np.ndarray) -> ConnectorHandle:
        import torch

        if self._closed:
            raise ConnectorError(f"key {key!r}: connector {self.name!r} is closed")
        if isinstance(array, torch.Tensor):
            tensor = array.detach()
            torch_dtype = tensor.dtype
            shape = list(tensor.shape)
            nbytes = tensor.numel() * tensor.element_size()
        else:
            # Copied through numpy, not torch.from_numpy: that refuses negative strides
            # and warns on read-only arrays, both fine to send.
            try:
                torch_dtype = torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype
            except TypeError:
                raise ConnectorError(
                    f"key {key!r}: numpy dtype {array.dtype} has no torch equivalent"
                ) from None
            shape = list(array.shape)
            nbytes = int(array.nbytes)
        dtype = str(torch_dtype).removeprefix("torch.")
        if nbytes > self.pool_size:
            raise ConnectorError(
                f"key {key!r}: the array ({nbytes} bytes, {dtype} {shape}) is larger than "
                f"the memory pool of connector {self.name!r} ({self.pool_size} bytes); "
                f"raise memory_pool_size"
            )
        with self._lock:
            self._expire_locked(time.monotonic())
            if key in self._entries:
                raise ConnectorError(f"key {key!r} is already held by connector {self.name!r}")
            offset = self._allocator.alloc(nbytes) if nbytes else None
            if nbytes and offset is None:
                raise ConnectorError(
                    f"key {key!r}: the array ({nbytes} bytes) does not fit the memory pool "
                    f"of connector {self.name!r} ({self.pool_size} bytes) now: "
                    f"{self._allocator.in_use} bytes are held by {len(self._by_id)} arrays "
                    f"not yet fetched, the largest free block is "
                    f"{self._allocator.largest_free} bytes; fetch or release them, or raise "
                    f"memory_pool_size"
                )
            # Reserved before the copy, so that no other put takes the slot; listed after
            # it, so that no consumer reads a half-written slot.
            entry = _Entry(next(self._ids), key, offset, nbytes, 0.0, new_token())
        try:
            if offset is None:
                pass
            elif isinstance(array, torch.Tensor):
                flat = tensor.reshape(-1).view(torch.uint8)
                self._pool[offset : offset + nbytes].copy_(flat)
            else:
                slot = np.frombuffer(self._mmap, np.uint8, count=nbytes, offset=offset)
                slot[:] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
                del slot  # an export of the mapping would block close()
        except BaseException:
            with self._lock:
                if offset is not None:
                    self._allocator.free(offset)
            raise
        with self._lock:
            entry.expires = time.monotonic() + self.ttl
            self._entries[key] = entry
            self._by_id[entry.id] = entry
        return ConnectorHandle(
            connector=self.name,
            key=key,
            dtype=dtype,
            shape=shape,
            nbytes=nbytes,
            host=self.host,
            port=self.zmq_port,
            token=entry.token,
        )

    def release(self, key: str) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                entry.gone = True
                self._free_if_unread_locked(entry)

    def _free_if_unread_locked(self, entry: _Entry) -> None:
        # A slot someone is reading stays until their Done (or ttl): reusing it would hand
        # them another array's bytes.
        if (
            entry.gone
            and entry.readers <= 0
            and self._by_id.pop(entry.id, None) is not None
            and entry.offset is not None
        ):
            self._allocator.free(entry.offset)

    def _expire_locked(self, now: float) -> None:
        for entry in [e for e in self._by_id.values() if e.expires <= now]:
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
                logger.warning(
                    "connector %s: key %r expired after %.0f s unfetched",
                    self.name,
                    entry.key,
                    self.ttl,
                )
            entry.gone = True
            entry.readers = 0  # a reader that outlived its ttl is taken as gone
            self._free_if_unread_locked(entry)

    def _answer(self, request: _Lookup | _Done) -> _Located | _Missing | _Ack:
        with self._lock:
            now = time.monotonic()
            self._expire_locked(now)
            if isinstance(request, _Done):
                entry = self._by_id.get(request.entry)
                # Only the reader that located the entry (it has the token) may end it.
                if entry is not None and token_matches(entry.token, request.token):
                    entry.readers -= 1
                    if request.consumed:
                        entry.gone = True
                        if self._entries.get(entry.key) is entry:
                            del self._entries[entry.key]
                    self._free_if_unread_locked(entry)
                return _Ack()
            entry = self._entries.get(request.key)
            # A wrong token is answered as a missing key: a peer without the handle learns
            # neither that the key exists nor where its bytes are.
            if entry is None or not token_matches(entry.token, request.token):
                return _Missing(
                    f"key {request.key!r} is not held by connector {self.name!r} at "
                    f"{self.host}:{self.zmq_port}: never put, already fetched, released, or "
                    f"expired after {self.ttl:.0f} s"
                )
            entry.readers += 1
            # The reader gets a full ttl to finish, so a slow read is not expired under it.
            entry.expires = now + self.ttl
            buffer = self._base + (entry.offset or 0)
            return _Located(entry.id, buffer, entry.nbytes, self.segment)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        # Expiry also runs on every put and lookup; this bound only matters when idle.
        period_ms = max(1, min(1000, int(self.ttl * 1000)))
        while True:
            events = dict(poller.poll(period_ms))
            if self._wake_rx in events:
                break
            if self._router not in events:
                with self._lock:
                    self._expire_locked(time.monotonic())
                continue
            frames = self._router.recv_multipart()
            if len(frames) != 3:
                continue  # not our protocol; nothing sensible to answer
            identity, request_id, payload = frames
            reply: _Located | _Missing | _Ack
            try:
                reply = self._answer(_REQUEST_DECODER.decode(payload))
            except msgspec.DecodeError as exc:
                reply = _Missing(f"malformed side-channel request: {exc}")
            except Exception as exc:
                # The thread must outlive one bad request: every later get depends on it.
                logger.exception("connector %s: side-channel request failed", self.name)
                reply = _Missing(f"connector {self.name!r} failed to answer: {exc!r}")
            self._router.send_multipart([identity, request_id, _ENCODER.encode(reply)])
        self._router.close(linger=0)
        self._wake_rx.close(linger=0)

    # -- consumer ------------------------------------------------------------------------

    def get(self, handle: ConnectorHandle, device: str = "cpu") -> torch.Tensor:
        import torch

        key = handle.key
        if self._closed:
            raise ConnectorError(f"key {key!r}: connector {self.name!r} is closed")
        dtype = getattr(torch, handle.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ConnectorError(f"key {key!r}: unknown dtype {handle.dtype!r} in its handle")
        if not handle.host or not handle.port:
            raise ConnectorError(f"key {key!r}: its handle names no producer (host, port)")
        producer = (handle.host, handle.port)
        located = self._call(producer, _Lookup(key, handle.token), key)
        if isinstance(located, _Missing):
            raise ConnectorError(located.reason)
        if not isinstance(located, _Located):
            raise ConnectorError(f"key {key!r}: unexpected answer {located!r} from the producer")
        try:
            if located.nbytes != handle.nbytes:
                raise ConnectorError(
                    f"key {key!r}: the producer holds {located.nbytes} bytes, the handle "
                    f"says {handle.nbytes}"
                )
            data = self._read(key, located)
        except BaseException:
            # The slot stays the producer's (a retry may succeed), but no longer pinned.
            self._done_quietly(producer, located.entry, handle, consumed=False)
            raise
        # Waited for, so that the producer's pool has room again when get returns.
        self._done_quietly(producer, located.entry, handle, consumed=True)
        if data.numel():
            tensor = data.view(dtype).reshape(handle.shape)
        else:
            tensor = torch.empty(handle.shape, dtype=dtype)
        return tensor if device == "cpu" else tensor.to(device)

    def _done_quietly(
        self, producer: tuple[str, int], entry: int, handle: ConnectorHandle, *, consumed: bool
    ) -> None:
        # The array is fetched (or the read already failed); a producer that does not hear
        # of it frees the slot after ttl, so this is worth a warning, not an error.
        try:
            self._call(producer, _Done(entry, consumed, handle.token), handle.key)
        except ConnectorError as exc:
            logger.warning("connector %s: %s (telling it the read is done)", self.name, exc)

    def _read(self, key: str, located: _Located) -> torch.Tensor:
        import torch

        out = torch.empty(located.nbytes, dtype=torch.uint8)
        done = 0
        while done < located.nbytes:
            remaining = located.nbytes - done
            with self._lock:
                size = remaining
                offset = self._allocator.alloc(size)
                if offset is None:
                    # Read through what is free instead of failing: the pool is a staging
                    # area here, the result lives in `out`.
                    size = min(remaining, self._allocator.largest_free)
                    if size >= min(remaining, _MIN_CHUNK):
                        offset = self._allocator.alloc(size)
            if offset is None:
                raise ConnectorError(
                    f"key {key!r}: the memory pool of connector {self.name!r} "
                    f"({self.pool_size} bytes) has no room to receive it; raise "
                    f"memory_pool_size"
                )
            try:
                rc = self._engine.transfer_sync_read(
                    located.segment, self._base + offset, located.buffer + done, size
                )
                if rc != 0:
                    raise ConnectorError(
                        f"key {key!r}: Mooncake's transfer_sync_read of {size} bytes from "
                        f"{located.segment} failed with {rc}"
                    )
                out[done : done + size].copy_(self._pool[offset : offset + size])
            finally:
                with self._lock:
                    self._allocator.free(offset)
            done += size
        return out

    def _call(
        self, producer: tuple[str, int], request: _Lookup | _Done, key: str
    ) -> _Located | _Missing | _Ack:
        with self._client_lock:
            sock = self._clients.get(producer)
            if sock is None:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(f"tcp://{producer[0]}:{producer[1]}")
                self._clients[producer] = sock
            request_id = next(self._request_ids).to_bytes(8, "little")
            sock.send_multipart([request_id, _ENCODER.encode(request)])
            deadline = time.monotonic() + self.rpc_timeout
            while True:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not sock.poll(remaining_ms):
                    # A late answer must not be taken for the next request's.
                    del self._clients[producer]
                    sock.close(linger=0)
                    raise ConnectorError(
                        f"key {key!r}: the producer at {producer[0]}:{producer[1]} did not "
                        f"answer within {self.rpc_timeout:g} s"
                    )
                frames = sock.recv_multipart()
                if len(frames) == 2 and frames[0] == request_id:
                    try:
                        return _REPLY_DECODER.decode(frames[1])
                    except msgspec.DecodeError as exc:
                        raise ConnectorError(
                            f"key {key!r}: malformed answer from {producer[0]}:{producer[1]}: {exc}"
                        ) from None

    # -- both ----------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake_tx.send(b"")
        self._server.join()
        self._wake_tx.close(linger=0)
        with self._client_lock:
            for sock in self._clients.values():
                sock.close(linger=0)
            self._clients.clear()
        self._ctx.term()
        with self._lock:
            self._entries.clear()
            self._by_id.clear()
            self._allocator = _Allocator(self.pool_size)
        self._engine.unregister_memory(self._base)
        # The engine goes when its last connector lets go of it.
        del self._engine
        _release_engine(self.host, self.protocol, self.device_name)
        del self._pool
        self._mmap.close()
