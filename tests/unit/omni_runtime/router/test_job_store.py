"""The video job store's contract on SqliteJobStore (tests/job_store_contract.py; the
integration suite runs the same on Redis), and what is SQLite's own: a store outlives the
router that wrote it, processes share one directory, files are written whole."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from job_store_contract import LEASE_S, T0, JobStoreContract, OpenStore, add, job_id, make_job
from omni_runtime.router.job_store import (
    JobStore,
    JobStoreError,
    RedisJobStore,
    SqliteJobStore,
    open_job_store,
)


@pytest.fixture
async def open_store(tmp_path: Path) -> AsyncIterator[OpenStore]:
    opened: list[JobStore] = []

    def open_store() -> JobStore:
        opened.append(SqliteJobStore(tmp_path / "jobs"))
        return opened[-1]

    yield open_store
    for store in opened:
        await store.close()


class TestSqliteJobStore(JobStoreContract):
    pass


async def test_jobs_outlive_the_router_that_wrote_them(open_store: OpenStore) -> None:
    # The first router is never closed: it is killed with the job in hand.
    first = open_store()
    await first.create(make_job(1), max_active=5, input_bytes=b"image")
    assert await first.claim("r1", now=T0, lease_s=LEASE_S, max_attempts=3) is not None
    second = open_store()
    taken = await second.claim("r2", now=T0 + LEASE_S + 1, lease_s=LEASE_S, max_attempts=3)
    assert taken is not None
    assert (taken.id, taken.owner, taken.attempts) == (job_id(1), "r2", 2)
    assert await second.get_input(job_id(1)) == b"image"


_CLAIMER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from omni_runtime.router.job_store import SqliteJobStore

    async def main() -> None:
        store = SqliteJobStore(Path(sys.argv[1]))
        owner, now = sys.argv[2], float(sys.argv[3])
        claimed = []

        async def claimer() -> None:
            while (job := await store.claim(owner, now=now, lease_s=30, max_attempts=3)):
                claimed.append(job.id)

        await asyncio.gather(*(claimer() for _ in range(4)))
        await store.close()
        print(" ".join(claimed))

    asyncio.run(main())
    """
)


async def test_processes_sharing_a_directory_never_share_a_job(tmp_path: Path) -> None:
    store = SqliteJobStore(tmp_path)
    try:
        await add(store, *(make_job(n) for n in range(60)))
    finally:
        await store.close()
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _CLAIMER,
            str(tmp_path),
            f"p{i}",
            str(T0),
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        for i in range(3)
    ]
    outputs = [await asyncio.wait_for(proc.communicate(), 60) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0]
    claimed = [ids for stdout, _ in outputs for ids in stdout.decode().split()]
    assert sorted(claimed) == sorted(job_id(n) for n in range(60))


async def test_content_is_written_whole_and_leaves_no_temp_files(tmp_path: Path) -> None:
    store = SqliteJobStore(tmp_path)
    try:
        await add(store, make_job(1))
        await store.put_content(job_id(1), b"video" * 1000)
        await store.put_content(job_id(2), b"no such job")
        assert sorted(p.name for p in (tmp_path / "content").iterdir()) == [f"{job_id(1)}.mp4"]
    finally:
        await store.close()


async def test_purge_sweeps_the_debris_of_killed_writers(tmp_path: Path) -> None:
    store = SqliteJobStore(tmp_path)
    try:
        await add(store, make_job(1))
        await store.put_content(job_id(1), b"video")
        content = tmp_path / "content"
        debris = [content / f".{job_id(1)}.mp4.0123.tmp", content / f"{job_id(9)}.mp4"]
        for path in debris:
            path.write_bytes(b"partial")
        now = int(debris[0].stat().st_mtime)
        # Young debris may be a write in progress: kept.
        assert await store.purge_expired(now) == 0
        assert all(path.exists() for path in debris)
        assert await store.purge_expired(now + 2 * 3600) == 0
        assert not any(path.exists() for path in debris)
        assert await store.get_content(job_id(1)) == b"video"
    finally:
        await store.close()


async def test_a_broken_database_is_a_job_store_error(tmp_path: Path) -> None:
    (tmp_path / "jobs.sqlite3").write_bytes(b"this is not a database" * 100)
    store = SqliteJobStore(tmp_path)
    try:
        with pytest.raises(JobStoreError, match=r"jobs\.sqlite3"):
            await store.ping()
    finally:
        await store.close()


def test_open_job_store_picks_the_backend(tmp_path: Path) -> None:
    assert isinstance(open_job_store(None, tmp_path, prefix="p"), SqliteJobStore)
    for url in ("redis://127.0.0.1:1/0", "rediss://user:secret@example.com:6380", "REDIS://h"):
        # Opening connects to nothing: a router starts before its Redis answers.
        store = open_job_store(url, tmp_path, prefix="omni:ns/pipe", password="pw")
        assert isinstance(store, RedisJobStore)
        assert "secret" not in repr(store)
    for url in ("http://127.0.0.1:6379", "127.0.0.1:6379", "unix:///tmp/redis.sock", ""):
        with pytest.raises(ValueError, match=r"redis://.*rediss://.*SQLite") as raised:
            open_job_store(url, tmp_path, prefix="p")
        assert url in str(raised.value)
    with pytest.raises(ValueError, match="http://u:") as raised:
        open_job_store("http://u:secret@h", tmp_path, prefix="p")
    assert "secret" not in str(raised.value)
    with pytest.raises(ValueError, match="prefix"):
        open_job_store("redis://h", tmp_path, prefix="")
