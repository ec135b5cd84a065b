"""The shared-memory and TCP connectors within one process, and make_connector.

Producer and consumer are two connectors in this process: the same code paths as across
processes (the consumer opens the segment by name or through /proc, or connects over
loopback), without the process start-up. tests/integration/test_connector_processes.py does
the same across real processes, with the deaths a single process cannot show.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest
import torch

from omni_runtime.config import ConnectorConfig
from omni_runtime.connectors import (
    KNOWN_CONNECTORS,
    ConnectorError,
    ConnectorHandle,
    ConnectorUnavailableError,
    OmniConnector,
    make_connector,
)
from omni_runtime.connectors.shared_memory import (
    SHM_DIR,
    SharedMemoryConnector,
    sweep_orphaned_segments,
)
from omni_runtime.connectors.tcp import TCPConnector

MiB = 1 << 20


def our_segments() -> list[str]:
    """This process's segments in /dev/shm (other processes may have their own)."""
    prefix = f"omni-{os.getpid()}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture
def shm() -> Iterator[tuple[SharedMemoryConnector, SharedMemoryConnector]]:
    """A producer and a consumer; nothing of theirs may stay in /dev/shm."""
    before = our_segments()
    producer = SharedMemoryConnector("shm", {"ttl_seconds": 60})
    consumer = SharedMemoryConnector("shm")
    yield producer, consumer
    producer.close()
    consumer.close()
    assert our_segments() == before


@pytest.fixture
def tcp() -> Iterator[tuple[TCPConnector, TCPConnector]]:
    producer = TCPConnector("tcp", {"bind_host": "127.0.0.1", "timeout_seconds": 10})
    consumer = TCPConnector("tcp", {"timeout_seconds": 10})
    yield producer, consumer
    producer.close()
    consumer.close()


def arrays() -> list[tuple[str, torch.Tensor | np.ndarray]]:
    g = torch.Generator().manual_seed(0)
    ints = torch.randint(-(2**62), 2**62, (5, 7), generator=g, dtype=torch.int64)
    ints.view(-1)[:2] = torch.tensor([torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max])
    return [
        ("float32", torch.randn(3, 5, 7, generator=g)),
        ("bfloat16", torch.randn(4, 33, generator=g).to(torch.bfloat16)),
        ("float16", torch.randn(17, generator=g).to(torch.float16)),
        ("int64", ints),
        ("bool", torch.rand(9, generator=g) > 0.5),
        ("uint8", torch.randint(0, 256, (2, 3, 4), generator=g, dtype=torch.uint8)),
        ("complex64", torch.randn(6, generator=g, dtype=torch.complex64)),
        ("scalar", torch.tensor(3.25)),
        ("empty", torch.empty(0, 16, dtype=torch.bfloat16)),
        ("numpy", np.arange(24, dtype=np.float64).reshape(4, 6)),
        ("numpy-strided", np.arange(60, dtype=np.int32).reshape(6, 10)[::-2, 1::3]),
        ("numpy-big-endian", np.arange(10, dtype=">f4")),
        ("tensor-transposed", torch.arange(12, dtype=torch.int16).reshape(3, 4).t()),
    ]


def as_tensor(array: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(array, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(array.astype(array.dtype.newbyteorder("="))))
    return array


def assert_same(got: torch.Tensor, want: torch.Tensor | np.ndarray) -> None:
    expected = as_tensor(want)
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    assert got.device.type == "cpu"
    # Bitwise: bfloat16 NaNs or signed zeros must not slip through a float comparison.
    assert got.contiguous().view(-1).view(torch.uint8).tolist() == (
        expected.contiguous().view(-1).view(torch.uint8).tolist()
    )


# -- make_connector and the package surface -------------------------------------------------


@pytest.mark.parametrize(
    ("class_name", "cls"),
    [
        ("SharedMemoryConnector", SharedMemoryConnector),
        ("TCPConnector", TCPConnector),
        ("TcpConnector", TCPConnector),
    ],
)
def test_make_connector_picks_the_class(class_name: str, cls: type[OmniConnector]) -> None:
    connector = make_connector("edge", ConnectorConfig(name=class_name, extra={"ttl_seconds": 7}))
    try:
        assert type(connector) is cls
        assert connector.name == "edge"
        assert connector.ttl == 7.0
    finally:
        connector.close()


def test_make_connector_builds_mooncake_from_its_module() -> None:
    config = ConnectorConfig(
        name="MooncakeTransferEngineConnector",
        extra={"host": "127.0.0.1", "protocol": "tcp", "memory_pool_size": MiB},
    )
    try:
        connector = make_connector("rdma", config)
    except ConnectorUnavailableError as e:
        unavailable = str(e)
    else:
        unavailable = ""
    if unavailable:
        # Not installed here (or its libraries are not on this process's path): the
        # module's own error, which says what to install.
        assert "pip install mooncake-transfer-engine" in unavailable
        return
    from omni_runtime.connectors.mooncake import MooncakeTransferEngineConnector

    try:
        assert isinstance(connector, MooncakeTransferEngineConnector)
    finally:
        connector.close()


def test_an_unknown_connector_class_is_refused_naming_the_known_ones() -> None:
    # The schema refuses it at load; make_connector refuses it too for a config built
    # without validation.
    with pytest.raises(ValueError, match="NoSuchConnector") as info:
        ConnectorConfig(name="NoSuchConnector")
    for known in KNOWN_CONNECTORS:
        assert known in str(info.value)
    with pytest.raises(ValueError, match="unknown connector class 'NoSuchConnector'"):
        make_connector("edge", ConnectorConfig.model_construct(name="NoSuchConnector", extra={}))


def test_importing_the_connectors_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import omni_runtime.connectors\n"
        "import omni_runtime.connectors.shared_memory\n"
        "import omni_runtime.connectors.tcp\n"
        "from omni_runtime.connectors.shared_memory import sweep_orphaned_segments\n"
        "sweep_orphaned_segments()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False", out.stderr


# -- shared memory ----------------------------------------------------------------------------


@pytest.mark.parametrize(("label", "array"), arrays(), ids=[label for label, _ in arrays()])
def test_shared_memory_round_trip_is_exact(
    shm: tuple[SharedMemoryConnector, SharedMemoryConnector],
    label: str,
    array: torch.Tensor | np.ndarray,
) -> None:
    producer, consumer = shm
    handle = producer.put(f"rt-{label}", array)
    assert handle.dtype == str(as_tensor(array).dtype).removeprefix("torch.")
    assert handle.shape == list(array.shape)
    got = consumer.get(handle)
    assert_same(got, array)


def test_shared_memory_put_is_a_snapshot(
    shm: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    producer, consumer = shm
    array = np.arange(1000, dtype=np.float32)
    handle = producer.put("snap", array)
    array[:] = -1  # the caller reuses its buffer
    assert consumer.get(handle)[:3].tolist() == [0.0, 1.0, 2.0]


def test_shared_memory_get_unlinks_the_segment(
    shm: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    producer, consumer = shm
    handle = producer.put("k", np.ones(4096, np.float32))
    assert our_segments() == [handle.extra["segment"]]
    tensor = consumer.get(handle)
    assert our_segments() == []
    assert tensor.sum().item() == 4096


def test_shared_memory_key_is_fetched_once(
    shm: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    producer, consumer = shm
    handle = producer.put("once", np.ones(8, np.float32))
    tensor = consumer.get(handle)
    with pytest.raises(ConnectorError, match="'once'"):
        consumer.get(handle)
    assert tensor.tolist() == [1.0] * 8


def test_shared_memory_release_unlinks_and_get_then_fails(
    shm: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    producer, consumer = shm
    handle = producer.put("aborted", np.ones(16, np.float32))
    assert our_segments() == [handle.extra["segment"]]
    producer.release("aborted")
    assert our_segments() == []
    with pytest.raises(ConnectorError, match=r"'aborted'.*gone"):
        consumer.get(handle)
    producer.release("aborted")  # already gone: nothing happens
    producer.release("never-put")


def test_shared_memory_unfetched_key_expires() -> None:
    producer = SharedMemoryConnector("shm", {"ttl_seconds": 0.2})
    consumer = SharedMemoryConnector("shm")
    try:
        start = time.monotonic()
        handle = producer.put("stale", np.ones(16, np.float32))
        assert our_segments() == [handle.extra["segment"]]
        wait_for(lambda: not our_segments())
        assert time.monotonic() - start >= 0.2
        with pytest.raises(ConnectorError, match="'stale'"):
            consumer.get(handle)
    finally:
        producer.close()
        consumer.close()


def test_shared_memory_close_unlinks_unfetched_segments() -> None:
    producer = SharedMemoryConnector("shm")
    handles = [producer.put(f"k{i}", np.full(1000 * (i + 1), i, np.int64)) for i in range(3)]
    assert len(our_segments()) == 3
    producer.close()
    assert our_segments() == []
    producer.close()  # idempotent
    with pytest.raises(ConnectorError, match="closed"):
        producer.put("late", np.ones(3))
    consumer = SharedMemoryConnector("shm")
    try:
        with pytest.raises(ConnectorError, match="'k0'"):
            consumer.get(handles[0])
    finally:
        consumer.close()


def test_shared_memory_reuses_a_segment_once_the_tensor_is_gone(
    shm: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    producer, consumer = shm
    first = producer.put("a", np.ones(MiB // 4, np.float32))
    tensor = consumer.get(first)
    view = tensor[10:20]  # a view keeps the segment as much as the tensor does
    del tensor
    second = producer.put("b", np.full(MiB // 4, 2, np.float32))
    assert second.extra["inode"] != first.extra["inode"], "reused while a view was alive"
    assert view.tolist() == [1.0] * 10  # and its data was not overwritten
    del view
    third = producer.put("c", np.full(MiB // 8, 3, np.float32))
    assert third.extra["inode"] == first.extra["inode"]
    # A reused segment has no name: the consumer opens it through the producer's /proc.
    assert third.extra["named"] is False
    assert our_segments() == [second.extra["segment"]]
    assert consumer.get(third).tolist() == [3.0] * (MiB // 8)
    assert consumer.get(second)[0].item() == 2.0
    assert our_segments() == []


def test_shared_memory_without_pool_makes_a_named_segment_each_time() -> None:
    producer = SharedMemoryConnector("shm", {"pool_bytes": 0})
    consumer = SharedMemoryConnector("shm")
    try:
        inodes = set()
        for i in range(3):
            handle = producer.put(f"k{i}", np.full(100, i, np.int32))
            assert handle.extra["named"] is True
            assert consumer.get(handle).tolist() == [i] * 100
            inodes.add(handle.extra["inode"])
            assert our_segments() == []
        assert len(inodes) == 3
    finally:
        producer.close()
        consumer.close()


def test_shared_memory_refuses_forged_handles(
    shm: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    producer, consumer = shm
    handle = producer.put("real", np.ones(8, np.float32))
    outside = ConnectorHandle(
        "shm", "evil", "float32", [8], 32, extra={**handle.extra, "segment": "../etc/passwd"}
    )
    with pytest.raises(ConnectorError, match="not a segment name"):
        consumer.get(outside)
    wrong_dtype = ConnectorHandle("shm", "odd", "object", [8], 32, extra=handle.extra)
    with pytest.raises(ConnectorError, match="dtype"):
        consumer.get(wrong_dtype)
    wrong_size = ConnectorHandle("shm", "real", "float32", [9], 36, extra=handle.extra)
    with pytest.raises(ConnectorError, match="'real'"):
        consumer.get(wrong_size)
    assert consumer.get(handle).tolist() == [1.0] * 8


def test_shared_memory_refuses_what_it_cannot_send(
    shm: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    producer, _ = shm
    with pytest.raises(ConnectorError, match="dtype object"):
        producer.put("objects", np.array([object()]))
    with pytest.raises(ConnectorError, match="list"):
        producer.put("list", [1, 2, 3])  # type: ignore[arg-type]
    assert our_segments() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_get_onto_a_missing_gpu_is_a_connector_error_and_keeps_the_key(
    shm: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    producer, consumer = shm
    handle = producer.put("gpu", np.ones(4, np.float32))
    with pytest.raises(ConnectorError, match="no CUDA device"):
        consumer.get(handle, device="cuda")
    assert consumer.get(handle).tolist() == [1.0] * 4  # checked before anything was taken


def test_sweep_removes_only_segments_of_dead_producers() -> None:
    namespace = os.stat("/proc/self/ns/pid").st_ino
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process now
    names = {
        "dead": f"omni-{dead.pid}-{namespace}-abc1",
        "alive": f"omni-{os.getpid()}-{namespace}-abc2",
        "other-namespace": f"omni-{dead.pid}-{namespace + 1}-abc3",
        "not-ours": f"omni-{dead.pid}-notasegment",
    }
    try:
        for name in names.values():
            with open(os.path.join(SHM_DIR, name), "wb") as f:
                f.write(b"x")
        removed = sweep_orphaned_segments()
        left = set(os.listdir(SHM_DIR))
        assert names["dead"] not in left
        assert {names["alive"], names["other-namespace"], names["not-ours"]} <= left
        assert removed >= 1
    finally:
        for name in names.values():
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))


# -- TCP --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("label", "array"), arrays(), ids=[label for label, _ in arrays()])
def test_tcp_round_trip_is_exact(
    tcp: tuple[TCPConnector, TCPConnector], label: str, array: torch.Tensor | np.ndarray
) -> None:
    producer, consumer = tcp
    handle = producer.put(f"rt-{label}", array)
    assert (handle.host, handle.port) != ("", 0)
    assert_same(consumer.get(handle), array)


def test_tcp_keeps_only_what_it_must_copy(tcp: tuple[TCPConnector, TCPConnector]) -> None:
    producer, consumer = tcp
    # Contiguous: kept by reference (documented), so a write before the get shows.
    kept = np.arange(100, dtype=np.float32)
    kept_handle = producer.put("kept", kept)
    kept[0] = -1
    # Strided: copied at put, so the same write does not.
    strided = np.arange(200, dtype=np.float32)
    copied_handle = producer.put("copied", strided[::2])
    strided[0] = -1
    assert consumer.get(kept_handle)[0].item() == -1.0
    assert consumer.get(copied_handle)[:2].tolist() == [0.0, 2.0]


def test_tcp_unknown_and_fetched_keys_name_key_and_producer(
    tcp: tuple[TCPConnector, TCPConnector],
) -> None:
    producer, consumer = tcp
    handle = producer.put("once", np.ones(8, np.float32))
    assert consumer.get(handle).tolist() == [1.0] * 8
    where = f"{handle.host}:{handle.port}"
    with pytest.raises(ConnectorError, match=f"'once'.*{where}"):
        consumer.get(handle)
    forged = ConnectorHandle("tcp", "no-such-key", "float32", [8], 32, handle.host, handle.port)
    with pytest.raises(ConnectorError, match=f"'no-such-key'.*{where}"):
        consumer.get(forged)
    # The connection that carried the errors still serves.
    assert consumer.get(producer.put("after", np.zeros(2, np.int8))).tolist() == [0, 0]


def test_tcp_get_without_the_handles_token_is_refused_and_the_array_stays(
    tcp: tuple[TCPConnector, TCPConnector],
) -> None:
    producer, consumer = tcp
    array = np.arange(64, dtype=np.float32)
    handle = producer.put("guarded", array)
    assert len(handle.token) >= 32
    for token in ("", handle.token[:-1] + ("A" if handle.token[-1] != "A" else "B")):
        forged = msgspec.structs.replace(handle, token=token)
        # Answered as an unknown key: a peer without the handle learns nothing.
        with pytest.raises(ConnectorError, match="unknown key 'guarded'"):
            consumer.get(forged)
    assert_same(consumer.get(handle), array)
    # Each hand-off has its own token: one handle's does not open another's key.
    other = producer.put("other", array)
    assert other.token != handle.token
    with pytest.raises(ConnectorError, match="unknown key 'other'"):
        consumer.get(msgspec.structs.replace(other, token=handle.token))
    assert_same(consumer.get(other), array)


def test_tcp_release_and_expiry_drop_the_key() -> None:
    producer = TCPConnector("tcp", {"bind_host": "127.0.0.1", "ttl_seconds": 0.2})
    consumer = TCPConnector("tcp")
    try:
        released = producer.put("aborted", np.ones(4, np.float32))
        producer.release("aborted")
        with pytest.raises(ConnectorError, match="'aborted'"):
            consumer.get(released)
        stale = producer.put("stale", np.ones(4, np.float32))
        put_at = time.monotonic()
        server = producer._state.server
        assert server is not None
        wait_for(lambda: "stale" not in server.entries)
        assert time.monotonic() - put_at >= 0.2
        with pytest.raises(ConnectorError, match=r"'stale'.*expired"):
            consumer.get(stale)
    finally:
        producer.close()
        consumer.close()


def test_tcp_get_from_a_closed_producer_fails_at_once() -> None:
    producer = TCPConnector("tcp", {"bind_host": "127.0.0.1"})
    consumer = TCPConnector("tcp", {"timeout_seconds": 30})
    try:
        handle = producer.put("orphan", np.ones(4, np.float32))
        producer.close()
        start = time.monotonic()
        with pytest.raises(ConnectorError, match=f"'orphan'.*127.0.0.1:{handle.port}"):
            consumer.get(handle)
        assert time.monotonic() - start < 5
    finally:
        consumer.close()


def test_tcp_get_times_out_on_a_producer_that_never_answers() -> None:
    # A socket that listens but never accepts: the kernel completes the connection, and
    # nothing ever replies (a producer that hangs).
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        consumer = TCPConnector("tcp", {"timeout_seconds": 0.5})
        try:
            handle = ConnectorHandle("tcp", "hung", "float32", [4], 16, "127.0.0.1", port)
            start = time.monotonic()
            with pytest.raises(ConnectorError, match=r"timed out after 0.5 s.*'hung'"):
                consumer.get(handle)
            assert 0.5 <= time.monotonic() - start < 5
        finally:
            consumer.close()


def test_tcp_advertised_host() -> None:
    explicit = TCPConnector("tcp", {"host": "10.1.2.3"})
    overridden = TCPConnector("tcp", {"host": "10.1.2.3"}, advertise_host="stage-0.svc")
    bound = TCPConnector("tcp", {"bind_host": "127.0.0.1"})
    auto = TCPConnector("tcp", {"host": "auto"})
    try:
        assert explicit.advertise_host == "10.1.2.3"
        assert overridden.advertise_host == "stage-0.svc"
        assert bound.advertise_host == "127.0.0.1"
        assert auto.advertise_host  # this machine's address, or 127.0.0.1
        assert bound.put("k", np.ones(1)).host == "127.0.0.1"
    finally:
        for connector in (explicit, overridden, bound, auto):
            connector.close()


def test_tcp_close_stops_the_server_thread() -> None:
    import threading

    producer = TCPConnector("tcp", {"bind_host": "127.0.0.1"})
    producer.put("k", np.ones(1))
    assert any(t.name.startswith("omni-tcp-server") for t in threading.enumerate())
    producer.close()
    assert not any(t.name.startswith("omni-tcp-server") for t in threading.enumerate())
    with pytest.raises(ConnectorError, match="closed"):
        producer.put("late", np.ones(1))
