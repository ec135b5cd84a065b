"""Shared memory between the stages of one host: a pool of /dev/shm segments, read in place.

Why a pool: a fresh tmpfs page costs far more than copying into it (measured here: filling a
new segment ran at 1.3-2.7 GB/s, a memcpy into warm memory at 6-13 GB/s), so ``put`` copies
into a segment whose pages an earlier transfer already faulted in, and ``get`` hands out a
tensor over the segment without copying. When the last view of that tensor dies, the
consumer marks the segment free in its header and the producer reuses it; the consumer
keeps its mapping too, so that its page tables are warm for the next transfer.

Names: a segment is created as ``/dev/shm/omni-<producer pid>-<pid namespace>-<token>``
and the consumer that takes it unlinks that name at once, so that nothing stays in /dev/shm
after a get (nor after a release, an expiry or close, which unlink it too). The producer
keeps its descriptor; later transfers through the same, now nameless, segment are opened
by consumers as ``/proc/<producer pid>/fd/<fd>`` (the same user in the same pid namespace,
as in one stage pod). ``pool_bytes: 0`` turns reuse off: every put then makes a named
segment that dies with the consumer's tensor, and consumers never open through /proc.
A producer that dies leaves at most the names of segments nobody fetched;
:func:`sweep_orphaned_segments` removes those.

Each segment starts with a header page (magic, generation, state, consumer); the array
starts at byte 4096, page-aligned. A claim races with a release, so both hold ``flock`` on
the segment while they change its state.

extra: ``ttl_seconds`` (base), ``pool_bytes`` (free segments kept for reuse, default
512 MiB; 0 turns reuse off), ``max_segments`` (segments tracked per side, default 64).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import struct
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from omni_runtime.connectors import _arrays
from omni_runtime.connectors.base import ConnectorError, ConnectorHandle, OmniConnector

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "omni-"
DEFAULT_POOL_BYTES = 512 << 20
DEFAULT_MAX_SEGMENTS = 64

_NAME = re.compile(r"^omni-(\d+)-(\d+)-([0-9a-f]+)$")
_MAGIC = int.from_bytes(b"OMNISHM1", "little")
_DATA_OFFSET = 4096
# A segment's capacity is a power of two of at least this, so that arrays of nearby sizes
# (hidden states of prompts of different lengths) reuse one another's segments. Pages past
# what was ever written are never allocated, so the rounding costs address space only.
_MIN_CAPACITY = 1 << 20
# A free segment is not used for an array this many times smaller than it: its pages stay
# resident and would be wasted.
_MAX_SLACK = 4

# Header words (native uint64; both sides are on one host).
_W_MAGIC = 0
_W_GENERATION = 1
_W_NBYTES = 2
_W_STATE = 3  # state and claimer adjacent: a claim writes them at once
_W_CONSUMER_PID = 4
_W_CONSUMER_NS = 5
_W_RETIRED = 6  # set by the producer when it lets the segment go (cached mappings then go)
_HEADER_WORDS = 8
_FREE, _FILLED, _TAKEN = 0, 1, 2


def _pid_namespace() -> int:
    # A pid means something only within its pid namespace: names and claims carry it, so
    # that nobody judges a segment by a pid it cannot see.
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_orphaned_segments(directory: str = SHM_DIR) -> int:
    """Unlink the segments whose producer process is gone; how many were removed.

    Only segments made in this pid namespace are judged: another's pids say nothing here.
    """
    namespace = _pid_namespace()
    removed = 0
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    for name in names:
        match = _NAME.match(name)
        if match is None or int(match.group(2)) != namespace or _pid_alive(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(os.path.join(directory, name))
            removed += 1
    return removed


def _address(mm: mmap.mmap) -> int:
    view = np.frombuffer(mm, dtype=np.uint8, count=1)
    return int(view.ctypes.data)


# -- producer side ----------------------------------------------------------------------------


class _Segment:
    """The producer's side of one segment: its descriptor, mapping, and what it holds."""

    def __init__(self, name: str, fd: int, capacity: int) -> None:
        self.name = name
        self.fd = fd
        self.inode = os.fstat(fd).st_ino
        self.capacity = capacity
        self.mm = mmap.mmap(fd, _DATA_OFFSET + capacity)
        self.words = memoryview(self.mm)[: 8 * _HEADER_WORDS].cast("Q")
        self.words[_W_MAGIC] = _MAGIC
        # Until a consumer takes it, consumers open it by name; afterwards through /proc.
        self.named = True
        self.generation = 0
        self.allocated = 0  # bytes of the file whose pages are allocated
        self.key: str | None = None
        self.deadline = 0.0
        self.last_used = time.monotonic()
        self.registered = 0  # bytes page-locked for CUDA, from the mapping's start
        self.writing = False

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def taken(self) -> bool:
        """A consumer took what this segment held under ``key`` (and unlinked its name)."""
        return self.words[_W_STATE] != _FILLED or self.words[_W_GENERATION] != self.generation

    def destroy(self) -> None:
        self.words[_W_RETIRED] = 1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))
        if self.registered:
            _cuda_unregister(self)
        self.words.release()
        try:
            self.mm.close()
        except BufferError:
            # A view of it is still alive somewhere; the mapping goes when that view does.
            logger.warning("segment %s still has views; leaving its mapping to them", self.name)
        os.close(self.fd)


class _Producer:
    """What a connector holds as a producer; apart from it so that a finalizer can close it
    without keeping the connector alive."""

    def __init__(self, pool_bytes: int, max_segments: int, ttl: float, consumer: _Consumer) -> None:
        self.pool_bytes = pool_bytes
        self.max_segments = max_segments
        self.ttl = ttl
        self.consumer = consumer
        self.lock = threading.Lock()
        self.segments: list[_Segment] = []
        self.keys: dict[str, _Segment] = {}
        self.closed = False
        self._pid = os.getpid()
        self._namespace = _pid_namespace()
        self._token = secrets.token_hex(4)
        self._serial = 0
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    def acquire(self, key: str, nbytes: int) -> _Segment:
        """A free segment of at least ``nbytes``, reserved for ``key``'s writer."""
        with self.lock:
            if self.closed:
                raise ConnectorError(f"cannot put {key!r}: the connector is closed")
            self._start_sweeper_locked()
            if key in self.keys:
                self._release_locked(self.keys[key])
            best = self._find_free_locked(nbytes)
            if best is None:
                # Perhaps a segment whose consumer died, or too many of them: look closer.
                self._reap_locked(time.monotonic())
                best = self._find_free_locked(nbytes) or self._create_locked(nbytes)
            best.writing = True
            return best

    def _find_free_locked(self, nbytes: int) -> _Segment | None:
        """The smallest free segment that fits ``nbytes`` and does not waste much."""
        if not self.pool_bytes:
            return None
        best: _Segment | None = None
        limit = max(_MIN_CAPACITY, nbytes * _MAX_SLACK)
        for seg in self.segments:
            if seg.writing or seg.words[_W_STATE] != _FREE:
                continue
            if seg.key is not None:  # taken, and already given back
                self._forget_key_locked(seg)
                seg.named = False
            if nbytes <= seg.capacity <= limit and (best is None or seg.capacity < best.capacity):
                best = seg
        return best

    def _create_locked(self, nbytes: int) -> _Segment:
        capacity = max(_MIN_CAPACITY, 1 << (nbytes - 1).bit_length())
        self._serial += 1
        name = f"{SEGMENT_PREFIX}{self._pid}-{self._namespace}-{self._token}{self._serial:x}"
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise ConnectorError(f"cannot create shared-memory segment {path}: {e}") from e
        try:
            os.ftruncate(fd, _DATA_OFFSET + capacity)
            seg = _Segment(name, fd, capacity)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self.segments.append(seg)
        return seg

    def fill(self, seg: _Segment, key: str, array: _arrays.Array, nbytes: int) -> None:
        """Copy ``array`` into the reserved ``seg`` (outside the lock: copies are long)."""
        try:
            if _DATA_OFFSET + nbytes > seg.allocated:
                _reserve(seg, nbytes)
            if not _arrays.is_cpu(array):
                _cuda_register(seg)
            _arrays.copy_into(array, seg.mm, _DATA_OFFSET)
        except BaseException:
            with self.lock:
                seg.writing = False
                self._drop_locked(seg)
            raise
        with self.lock:
            seg.writing = False
            if self.closed:
                self._drop_locked(seg)
                raise ConnectorError(f"cannot put {key!r}: the connector is closed")
            seg.generation += 1
            # No consumer reads the header before it has the handle this put returns.
            words = seg.words
            words[_W_GENERATION] = seg.generation
            words[_W_NBYTES] = nbytes
            words[_W_STATE] = _FILLED
            seg.key = key
            seg.last_used = time.monotonic()
            seg.deadline = seg.last_used + self.ttl
            self.keys[key] = seg

    def release(self, key: str) -> None:
        with self.lock:
            seg = self.keys.get(key)
            if seg is not None:
                self._release_locked(seg)
                self._trim_locked()

    def _release_locked(self, seg: _Segment) -> None:
        """Take back a filled segment nobody fetched (unless a consumer just took it)."""
        with seg.locked():
            if not seg.taken():
                seg.words[_W_STATE] = _FREE
        self._forget_key_locked(seg)
        # Freed here, or taken by a consumer (which unlinks the name before it claims):
        # either way nobody opens it by name any more.
        if seg.named:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, seg.name))
            seg.named = False

    def _forget_key_locked(self, seg: _Segment) -> None:
        if seg.key is not None and self.keys.get(seg.key) is seg:
            del self.keys[seg.key]
        seg.key = None

    def _reap_locked(self, now: float) -> None:
        """Notice what consumers did, expire unfetched keys, and keep the pool in bounds."""
        for seg in self.segments:
            if seg.writing:
                continue
            if seg.key is not None:
                if seg.taken():
                    self._forget_key_locked(seg)
                    seg.named = False
                elif now >= seg.deadline:
                    logger.debug("shared-memory key %r expired unfetched", seg.key)
                    self._release_locked(seg)
            if seg.words[_W_STATE] == _TAKEN:
                self._reclaim_if_consumer_died(seg)
        self._trim_locked()

    def _reclaim_if_consumer_died(self, seg: _Segment) -> None:
        # A consumer that died holding a segment never marks it free. Only a consumer in
        # this pid namespace can be judged dead by its pid.
        if seg.words[_W_CONSUMER_NS] != self._namespace:
            return
        if _pid_alive(seg.words[_W_CONSUMER_PID]):
            return
        with seg.locked():
            if seg.words[_W_STATE] == _TAKEN and not _pid_alive(seg.words[_W_CONSUMER_PID]):
                seg.words[_W_STATE] = _FREE

    def _trim_locked(self) -> None:
        kept_bytes = 0
        tracked = 0
        # Newest first: those are the ones most likely to be reused.
        for seg in sorted(self.segments, key=lambda s: s.last_used, reverse=True):
            if seg.writing or seg.key is not None:
                tracked += 1
                continue
            state = seg.words[_W_STATE]
            if tracked < self.max_segments and (
                (state == _FREE and kept_bytes + seg.capacity <= self.pool_bytes)
                # Comes back free when the consumer's tensor dies.
                or (state == _TAKEN and self.pool_bytes > 0)
            ):
                kept_bytes += seg.capacity if state == _FREE else 0
                tracked += 1
                continue
            # Let it go; a taken one lives on in its consumer's mapping and dies with it.
            self._drop_locked(seg)

    def _drop_locked(self, seg: _Segment) -> None:
        self._forget_key_locked(seg)
        if seg in self.segments:
            self.segments.remove(seg)
            seg.destroy()

    def start_sweeper(self) -> None:
        if self._sweeper is None:
            with self.lock:
                self._start_sweeper_locked()

    def _start_sweeper_locked(self) -> None:
        if self._sweeper is None and not self.closed:
            self._sweeper = threading.Thread(
                target=self._sweep, name="omni-shm-sweeper", daemon=True
            )
            self._sweeper.start()

    def _sweep(self) -> None:
        # Unfetched keys must expire, segments come back, and consumers let go of segments
        # their producer dropped, even if no other transfer follows.
        period = min(max(self.ttl / 4, 0.02), 1.0)
        while not self._stop.wait(period):
            with self.lock:
                if self.closed:
                    return
                self._reap_locked(time.monotonic())
            self.consumer.evict()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self._stop.set()
            if os.getpid() != self._pid:
                # A forked child: the segments are its parent's to remove, not its own.
                self.segments.clear()
                self.keys.clear()
                return
            for seg in list(self.segments):
                if not seg.writing:  # a writer drops its own once it sees ``closed``
                    self._drop_locked(seg)
        sweeper = self._sweeper
        if sweeper is not None and sweeper is not threading.current_thread():
            sweeper.join(timeout=5)


def _reserve(seg: _Segment, nbytes: int) -> None:
    # Allocating the pages up front turns a full /dev/shm into an error here, rather than a
    # SIGBUS when the copy touches a page tmpfs cannot provide.
    end = _DATA_OFFSET + nbytes
    if end > seg.allocated:
        try:
            os.posix_fallocate(seg.fd, 0, end)
        except OSError as e:
            raise ConnectorError(
                f"no room for {nbytes} bytes in {SHM_DIR} ({e.strerror}); make it larger "
                "(in a pod: an emptyDir with medium: Memory) or use the TCP connector"
            ) from e
        seg.allocated = end


# -- consumer side ----------------------------------------------------------------------------


class _Mapped:
    """A consumer's mapping of one producer segment, kept for that segment's next transfers.

    Mapping a segment afresh for each get would fault its pages into this process again
    every time; a kept mapping is read at full speed from the second transfer on.
    """

    __slots__ = ("__weakref__", "fd", "last_used", "mm", "pid", "registered", "users")

    def __init__(self, fd: int, pid: int) -> None:
        self.fd = fd  # for flock; closed when the last reference to this object goes
        self.mm = mmap.mmap(fd, os.fstat(fd).st_size)
        weakref.finalize(self, os.close, fd)
        self.pid = pid
        self.users = 0  # tensors over it still alive
        self.last_used = time.monotonic()
        self.registered = False

    def word(self, index: int) -> int:
        value: int = struct.unpack_from("=Q", self.mm, 8 * index)[0]
        return value


class _Consumer:
    """What a connector holds as a consumer: its kept segment mappings."""

    def __init__(self, max_cached: int) -> None:
        self.max_cached = max_cached
        # Re-entrant: a tensor's finalizer may run, from the garbage collector, in a thread
        # that already holds it.
        self.lock = threading.RLock()
        self.cache: dict[tuple[int, int], _Mapped] = {}
        # Keyed by id: a weak reference hashes as its referent, and arrays do not hash.
        self._watched: dict[int, tuple[weakref.ref[np.ndarray], _Mapped]] = {}
        self.namespace = _pid_namespace()
        self.pid = os.getpid()
        self._next_liveness_check = 0.0

    def take(self, handle: ConnectorHandle) -> _Mapped:
        """The handle's segment, mapped and claimed by this process; ConnectorError if its
        key is gone."""
        extra = handle.extra
        try:
            pid = int(extra["pid"])
            inode = int(extra["inode"])
            generation = int(extra["generation"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConnectorError(f"key {handle.key!r}: not a shared-memory handle ({e})") from e
        with self.lock:
            mapped = self.cache.get((pid, inode))
            if mapped is None:
                mapped = self.cache[(pid, inode)] = _open(handle)
            mm = mapped.mm
            fcntl.flock(mapped.fd, fcntl.LOCK_EX)
            try:
                magic, current, nbytes, state = struct.unpack_from("=4Q", mm, 0)
                if (
                    magic != _MAGIC
                    or current != generation
                    or state != _FILLED
                    or nbytes != handle.nbytes
                    or len(mm) < _DATA_OFFSET + nbytes
                ):
                    raise ConnectorError(f"{_where(handle)} is gone: fetched, released or expired")
                struct.pack_into("=3Q", mm, 8 * _W_STATE, _TAKEN, self.pid, self.namespace)
            finally:
                fcntl.flock(mapped.fd, fcntl.LOCK_UN)
            mapped.users += 1
            mapped.last_used = time.monotonic()
            if len(self.cache) > self.max_cached:
                self._evict_locked()
        return mapped

    def watch(self, data: np.ndarray, mapped: _Mapped) -> None:
        """Hand ``mapped`` back once ``data`` (what the tensor is over) is gone."""
        # A weak reference with a callback: far cheaper than weakref.finalize, and nothing
        # needs doing at exit (a producer takes back what a dead consumer held).
        ref = weakref.ref(data, self._gone)
        self._watched[id(ref)] = (ref, mapped)

    def _gone(self, ref: weakref.ref[np.ndarray]) -> None:
        watched = self._watched.pop(id(ref), None)
        if watched is not None:
            self.done(watched[1])

    def done(self, mapped: _Mapped) -> None:
        """Nothing of this process reads ``mapped``'s transfer any more: its producer may
        reuse the segment."""
        with self.lock:
            mapped.users -= 1
            struct.pack_into("=Q", mapped.mm, 8 * _W_STATE, _FREE)

    def evict(self) -> None:
        with self.lock:
            self._evict_locked()

    def _evict_locked(self, everything: bool = False) -> None:
        """Forget idle mappings of segments their producer dropped (or beyond the limit).

        Forgetting unmaps nothing a tensor still uses: such a tensor keeps the mapping, and
        with it the pages, until it dies.
        """
        now = time.monotonic()
        check_liveness = now >= self._next_liveness_check
        if check_liveness:
            self._next_liveness_check = now + 1.0
        idle = sorted(
            ((key, m) for key, m in self.cache.items() if m.users == 0),
            key=lambda item: item[1].last_used,
        )
        excess = len(self.cache) - self.max_cached
        for key, mapped in idle:
            if (
                everything
                or excess > 0
                or mapped.word(_W_RETIRED)
                or (check_liveness and not _pid_alive(mapped.pid))
            ):
                del self.cache[key]
                excess -= 1
                if mapped.registered:
                    _cuda_unregister_mapping(mapped)

    def close(self) -> None:
        with self.lock:
            self._evict_locked(everything=True)
            self.cache.clear()


def _where(handle: ConnectorHandle) -> str:
    extra = handle.extra
    return f"key {handle.key!r} (segment {extra.get('segment')} of pid {extra.get('pid')})"


def _open(handle: ConnectorHandle) -> _Mapped:
    extra = handle.extra
    where = _where(handle)
    try:
        name = str(extra["segment"])
        named = bool(extra["named"])
        pid, fd, inode = int(extra["pid"]), int(extra["fd"]), int(extra["inode"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConnectorError(f"{where}: not a shared-memory handle ({e})") from e
    if _NAME.match(name) is None:
        raise ConnectorError(f"{where}: not a segment name: {name!r}")
    path = os.path.join(SHM_DIR, name) if named else f"/proc/{pid}/fd/{fd}"
    try:
        seg_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConnectorError(
            f"{where} is gone: fetched, released or expired, or its producer exited"
        ) from None
    except PermissionError as e:
        raise ConnectorError(
            f"{where}: cannot open {path} ({e.strerror}); consumers that cannot reach the "
            "producer's /proc need the connector's extra pool_bytes: 0"
        ) from None
    try:
        info = os.fstat(seg_fd)
        if info.st_ino != inode or info.st_size <= _DATA_OFFSET:
            raise ConnectorError(f"{where} is gone (its producer exited or reused the fd)")
        if named:
            # This consumer takes it: the name goes now, whatever follows.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return _Mapped(seg_fd, pid)
    except BaseException:
        os.close(seg_fd)
        raise


def _close(producer: _Producer, consumer: _Consumer) -> None:
    producer.close()
    consumer.close()


class SharedMemoryConnector(OmniConnector):
    """Arrays between processes of one host through /dev/shm segments, read in place."""

    def __init__(self, name: str, extra: Mapping[str, Any] | None = None) -> None:
        super().__init__(name, extra)
        pool_bytes = int(self.extra.get("pool_bytes", DEFAULT_POOL_BYTES))
        max_segments = int(self.extra.get("max_segments", DEFAULT_MAX_SEGMENTS))
        self._pid = os.getpid()
        self._consumer = _Consumer(max_segments)
        self._producer = _Producer(pool_bytes, max_segments, self.ttl, self._consumer)
        # At exit too: segments nobody fetched lose their names.
        self._finalizer = weakref.finalize(self, _close, self._producer, self._consumer)

    def put(self, key: str, array: torch.Tensor | np.ndarray) -> ConnectorHandle:
        dtype, shape, nbytes = _arrays.describe(array)
        if nbytes == 0:
            # Nothing to carry: the handle is the whole array.
            self._producer.release(key)
            return ConnectorHandle(self.name, key, dtype, shape, 0, extra={"empty": True})
        seg = self._producer.acquire(key, nbytes)
        self._producer.fill(seg, key, array, nbytes)
        return ConnectorHandle(
            connector=self.name,
            key=key,
            dtype=dtype,
            shape=shape,
            nbytes=nbytes,
            extra={
                "segment": seg.name,
                "named": seg.named,
                "pid": self._pid,
                "fd": seg.fd,
                "inode": seg.inode,
                "generation": seg.generation,
            },
        )

    def get(self, handle: ConnectorHandle, device: str = "cpu") -> torch.Tensor:
        # Few and cheap steps: right after a large copy every call runs on cold caches
        # (measured here: ~20 us for any call into torch), a cost the plain memcpy has not.
        if handle.dtype not in _arrays.DTYPES:
            raise ConnectorError(f"key {handle.key!r}: unsupported dtype {handle.dtype!r}")
        if device != "cpu":
            _arrays.check_device(device)
        if handle.extra.get("empty"):
            _arrays.check_layout(handle.dtype, handle.shape, 0, f"key {handle.key!r}")
            return _arrays.empty_tensor(handle.dtype, handle.shape, device)
        self._producer.start_sweeper()
        mapped = self._consumer.take(handle)
        try:
            data = np.ndarray(
                handle.shape, _arrays.numpy_dtype(handle.dtype), mapped.mm, _DATA_OFFSET
            )
            if data.nbytes != handle.nbytes:
                raise ValueError(f"shape {handle.shape} does not make {handle.nbytes} bytes")
        except (TypeError, ValueError) as e:
            self._consumer.done(mapped)
            raise ConnectorError(f"{_where(handle)}: {e}") from None
        if device == "cpu":
            # Whatever views the tensor spawns keep ``data`` alive; when the last one dies,
            # the producer may reuse the segment.
            self._consumer.watch(data, mapped)
            return _arrays.tensor_over_array(data, handle.dtype)
        try:
            return _to_device(mapped, data, handle.dtype, device)
        finally:
            del data
            self._consumer.done(mapped)

    def release(self, key: str) -> None:
        self._producer.release(key)

    def close(self) -> None:
        self._finalizer()


# -- CUDA: kept apart, and reached only for tensors on a GPU ----------------------------------


def _cuda_register(seg: _Segment) -> None:
    """Page-lock the producer's segment once, so that the GPU copies into it by DMA.

    A /dev/shm page is pageable: a device-to-host copy into it runs at a quarter of the
    pinned rate. Registering costs milliseconds, hence once per (reused) segment.
    """
    import torch

    size = _DATA_OFFSET + seg.capacity
    if seg.registered >= size:
        return
    _reserve(seg, seg.capacity)
    error = torch.cuda.cudart().cudaHostRegister(_address(seg.mm), size, 0)
    if int(error) != 0:
        logger.warning("cudaHostRegister of %s failed (%s); copying unpinned", seg.name, error)
        return
    seg.registered = size


def _cuda_unregister(seg: _Segment) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(_address(seg.mm))
    seg.registered = 0


def _to_device(mapped: _Mapped, data: np.ndarray, dtype: str, device: str) -> torch.Tensor:
    """Copy to ``device`` from the consumer's mapping, page-locked on its first use (the
    mapping is kept for the segment's next transfers, so that is paid once)."""
    import torch

    if not mapped.registered and torch.device(device).type == "cuda":
        error = torch.cuda.cudart().cudaHostRegister(_address(mapped.mm), len(mapped.mm), 0)
        mapped.registered = int(error) == 0
        if not mapped.registered:
            logger.warning("cudaHostRegister failed (%s); copying unpinned", error)
    return _arrays.tensor_over_array(data, dtype).to(device)


def _cuda_unregister_mapping(mapped: _Mapped) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(_address(mapped.mm))
    mapped.registered = False
