"""The video job store's contract (tests/job_store_contract.py) on RedisJobStore against a
real redis-server, and what is Redis' own: keys expire by themselves, pipelines' prefixes
keep apart, a password-protected server, a server that is not there."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from job_store_contract import LEASE_S, T0, JobStoreContract, OpenStore, add, job_id, make_job
from omni_runtime.router.job_store import (
    JobStore,
    JobStoreError,
    QueueFullError,
    RedisJobStore,
    open_job_store,
)
from omni_testkit.port_leases import lease_port

pytestmark = pytest.mark.integration

PASSWORD = "s3cret-pa55"


@contextmanager
def redis_server(directory: Path, *, password: str | None = None) -> Iterator[str]:
    """A redis-server on a leased loopback port (asking for ``password``, if given), its
    URL once it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("OMNI_REQUIRE_REDIS") == "1":
            pytest.fail("OMNI_REQUIRE_REDIS=1, but redis-server is missing from PATH")
        pytest.skip("redis-server is missing from PATH (apt-get install redis-server)")
    port = lease_port()
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "redis.log"
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        + ["--dir", str(directory), "--logfile", str(log)]
        + ([] if password is None else ["--requirepass", password]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        client = redis.Redis(port=port, password=password)
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                pytest.fail(f"redis-server exited with {proc.returncode}: {log.read_text()}")
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    pytest.fail(f"redis-server did not answer on port {port} within 20 s")
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
async def open_store(redis_url: str) -> AsyncIterator[OpenStore]:
    # A prefix of its own per test: the tests share one server, as pipelines do.
    prefix = f"omni-test:{uuid.uuid4().hex[:12]}"
    opened: list[JobStore] = []

    def open_store() -> JobStore:
        opened.append(RedisJobStore(redis_url, prefix=prefix))
        return opened[-1]

    yield open_store
    for store in opened:
        await store.close()


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


class TestRedisJobStore(JobStoreContract):
    pass


async def keys_of(raw: aioredis.Redis, store: RedisJobStore) -> set[str]:
    return {str(key) for key in await raw.keys(f"{store.prefix}:*")}  # str: decode_responses


async def wait_for_keys(
    raw: aioredis.Redis, store: RedisJobStore, expected: set[str], timeout: float = 15
) -> None:
    """Poll until the store's keys are ``expected`` (Redis expires keys within about a
    second of their time)."""
    deadline = time.monotonic() + timeout
    while (keys := await keys_of(raw, store)) != expected:
        assert time.monotonic() < deadline, f"keys still {sorted(keys)}, not {sorted(expected)}"
        await asyncio.sleep(0.1)


async def test_nothing_outlives_its_expiry(open_store: OpenStore, raw: aioredis.Redis) -> None:
    store = open_store()
    assert isinstance(store, RedisJobStore)
    await store.create(make_job(1), max_active=5, input_bytes=b"image")
    assert await store.claim("r1", now=T0, lease_s=LEASE_S, max_attempts=3) is not None
    await store.put_content(job_id(1), b"video")
    p = store.prefix
    assert await keys_of(raw, store) == {
        f"{p}:job:{job_id(1)}",
        f"{p}:input:{job_id(1)}",
        f"{p}:content:{job_id(1)}",
        f"{p}:jobs",
        f"{p}:active",
    }
    assert all([await raw.ttl(key) == -1 for key in await keys_of(raw, store)])
    expires_at = int(time.time()) + 3
    done = await store.update(
        job_id(1), owner="r1", status="completed", progress=100, expires_at=expires_at
    )
    assert done is not None
    # Every key carries the expiry now, the indexes too: they hold this job only.
    keys = await keys_of(raw, store)
    assert f"{p}:expiry" in keys
    assert {key: await raw.expiretime(key) for key in keys} == dict.fromkeys(keys, expires_at)
    # No router purges: Redis alone removes it all.
    await wait_for_keys(raw, store, set())
    assert await store.get(job_id(1)) is None


async def test_an_expired_job_leaves_the_others(open_store: OpenStore, raw: aioredis.Redis) -> None:
    store = open_store()
    assert isinstance(store, RedisJobStore)
    await add(store, make_job(1, expires_at=int(time.time()) + 1), make_job(2))
    await store.put_content(job_id(1), b"video")
    p = store.prefix
    # Job 2 has no expiry, so the indexes keep none.
    assert await raw.ttl(f"{p}:jobs") == -1
    await wait_for_keys(
        raw, store, {f"{p}:job:{job_id(2)}", f"{p}:jobs", f"{p}:active", f"{p}:expiry"}
    )
    # The ids left behind in the indexes are dropped by the next script that meets them.
    assert [job.id for job in (await store.list(after=None, limit=5, order="asc"))[0]] == [
        job_id(2)
    ]
    assert await raw.zrange(f"{p}:jobs", 0, -1) == [job_id(2)]
    await store.create(make_job(3), max_active=2)
    with pytest.raises(QueueFullError):
        await store.create(make_job(4), max_active=2)
    assert await store.delete(job_id(2))
    assert await store.delete(job_id(3))
    assert await keys_of(raw, store) == set()


async def test_pipelines_prefixes_keep_apart(redis_url: str) -> None:
    a = RedisJobStore(redis_url, prefix=f"omni-test:{uuid.uuid4().hex[:8]}:a")
    b = RedisJobStore(redis_url, prefix=f"omni-test:{uuid.uuid4().hex[:8]}:b")
    try:
        # The same id in both, and one job each of their own.
        await a.create(make_job(1, prompt="of a"), max_active=2, input_bytes=b"a")
        await b.create(make_job(1, prompt="of b"), max_active=2, input_bytes=b"b")
        await a.create(make_job(2, expires_at=T0 + 10), max_active=2)
        await b.create(make_job(3), max_active=2)
        assert [j.id for j in (await a.list(after=None, limit=9, order="asc"))[0]] == [
            job_id(1),
            job_id(2),
        ]
        assert [j.id for j in (await b.list(after=None, limit=9, order="asc"))[0]] == [
            job_id(1),
            job_id(3),
        ]
        assert (await a.get(job_id(1)), await b.get(job_id(1))) == (
            make_job(1, prompt="of a"),
            make_job(1, prompt="of b"),
        )
        assert (await a.get_input(job_id(1)), await b.get_input(job_id(1))) == (b"a", b"b")
        assert await a.get(job_id(3)) is None
        with pytest.raises(ValueError, match=job_id(3)):
            await a.list(after=job_id(3), limit=9, order="asc")
        # Each pipeline's limit counts its own jobs.
        with pytest.raises(QueueFullError):
            await a.create(make_job(4), max_active=2)
        claimed = [await a.claim("ra", now=T0, lease_s=LEASE_S, max_attempts=3) for _ in range(3)]
        assert [job.id if job else None for job in claimed] == [job_id(1), job_id(2), None]
        b1 = await b.get(job_id(1))
        assert b1 is not None
        assert (b1.status, b1.owner) == ("queued", None)
        assert await a.purge_expired(T0 + 10) == 1
        assert await b.purge_expired(T0 + 10) == 0
        assert await a.delete(job_id(1))
        assert await b.get(job_id(1)) == make_job(1, prompt="of b")
    finally:
        for store in (a, b):
            for job in (await store.list(after=None, limit=9, order="asc"))[0]:
                await store.delete(job.id)
            await store.close()


async def test_a_password_protected_server(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis", password=PASSWORD) as url:
        host = url.removeprefix("redis://")
        prefix = "omni-test:auth"
        right = [
            open_job_store(url, tmp_path, prefix=prefix, password=PASSWORD),
            open_job_store(f"redis://:{PASSWORD}@{host}", tmp_path, prefix=prefix),
        ]
        wrong = [
            open_job_store(url, tmp_path, prefix=prefix),
            open_job_store(url, tmp_path, prefix=prefix, password="not-it"),
        ]
        try:
            await right[0].ping()
            await right[0].create(make_job(1), max_active=1)
            assert await right[1].get(job_id(1)) == make_job(1)
            for store, problem in zip(
                wrong,
                ["asks for a password, and none was given", "refused the password"],
                strict=True,
            ):
                started = time.monotonic()
                with pytest.raises(JobStoreError, match=problem) as raised:
                    await store.get(job_id(1))
                assert PASSWORD not in str(raised.value)
                assert time.monotonic() - started < 10
                with pytest.raises(JobStoreError, match=problem):
                    await store.ping()
        finally:
            for store in right + wrong:
                await store.close()


async def test_a_server_that_is_not_there(tmp_path: Path) -> None:
    # A leased port that nothing listens on: connections are refused.
    store = RedisJobStore(f"redis://127.0.0.1:{lease_port()}/0", prefix="omni-test:none")
    try:
        started = time.monotonic()
        with pytest.raises(JobStoreError, match="ConnectionError") as raised:
            await store.ping()
        assert "127.0.0.1" in str(raised.value)
        assert time.monotonic() - started < 10
        with pytest.raises(JobStoreError):
            await store.create(make_job(1), max_active=1)
    finally:
        await store.close()
