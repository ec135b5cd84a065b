"""``SqliteJobStore``: the embedded job store, a SQLite database plus the finished videos as
files in one directory. Correct across the processes of one host (SQLite's file locks), not
across hosts."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import msgspec

from omni_runtime.router.job_store.base import (
    JOB_DECODER,
    JSON_ENCODER,
    JobStore,
    JobStoreError,
    QueueFullError,
    VideoJob,
    checked_changes,
    checked_job,
    lost_error,
    valid_id,
)

__all__ = ["SqliteJobStore"]

_T = TypeVar("_T")

_SCHEMA: Final = (
    # record is the VideoJob as JSON; the columns before it copy it for queries.
    """CREATE TABLE IF NOT EXISTS jobs (
        id TEXT PRIMARY KEY,
        created_at INTEGER NOT NULL,
        status TEXT NOT NULL,
        owner TEXT,
        lease_until REAL,
        expires_at INTEGER,
        record TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS jobs_order ON jobs (created_at, id)",
    "CREATE INDEX IF NOT EXISTS jobs_active ON jobs (status, created_at, id)",
    "CREATE INDEX IF NOT EXISTS jobs_expiry ON jobs (expires_at) WHERE expires_at IS NOT NULL",
    "CREATE TABLE IF NOT EXISTS inputs (id TEXT PRIMARY KEY, data BLOB NOT NULL)",
)
_SCHEMA_VERSION: Final = 1
# The oldest candidate first. A queued job is held only by an owner whose lease is live:
# one an owner put back with update (which cannot clear the owner) is not stuck.
_CLAIM_CANDIDATE: Final = """
SELECT record FROM jobs
WHERE (status = 'queued' AND (owner IS NULL OR lease_until IS NULL OR lease_until < :now))
   OR (status = 'in_progress' AND (lease_until IS NULL OR lease_until < :now))
ORDER BY created_at, id LIMIT 1
"""
# A temp or content file without a job older than this is debris of a killed writer.
_ORPHAN_GRACE_S: Final = 3600


def _row(job: VideoJob) -> dict[str, Any]:
    return {
        "id": job.id,
        "created_at": job.created_at,
        "status": job.status,
        "owner": job.owner,
        "lease_until": job.lease_until,
        "expires_at": job.expires_at,
        "record": JSON_ENCODER.encode(job).decode(),
    }


_UPSERT: Final = """
INSERT OR REPLACE INTO jobs (id, created_at, status, owner, lease_until, expires_at, record)
VALUES (:id, :created_at, :status, :owner, :lease_until, :expires_at, :record)
"""


@contextlib.contextmanager
def _immediate(conn: sqlite3.Connection) -> Iterator[None]:
    """A write transaction that takes the database's write lock at its start: a deferred
    one that reads first and writes later may find another process wrote in between and
    fail at once (SQLITE_BUSY without the busy timeout), where this one waits its turn."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            conn.rollback()
        raise
    conn.commit()


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` at ``path`` so that a reader sees all of it or the file as it was:
    a temp file beside it, flushed to disk, renamed over it."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_file(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


class SqliteJobStore(JobStore):
    """``directory``/jobs.sqlite3 (jobs and input images) and ``directory``/content (the
    videos, one file per job). The database is in WAL mode and every read-then-write is one
    ``BEGIN IMMEDIATE`` transaction, so several processes on one host may share the
    directory. Database calls run on one worker thread per store (its connection's own);
    file reads and writes in threads of their own, so a large video does not hold up
    claims."""

    def __init__(self, directory: Path, *, busy_timeout_s: float = 30.0) -> None:
        self.directory = Path(directory)
        self._db_path = self.directory / "jobs.sqlite3"
        self._content_dir = self.directory / "content"
        self._busy_timeout_s = busy_timeout_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="job-store")
        self._conn: sqlite3.Connection | None = None  # the worker thread's

    def __repr__(self) -> str:
        return f"SqliteJobStore({str(self.directory)!r})"

    def _content_path(self, job_id: str) -> Path:
        return self._content_dir / f"{job_id}.mp4"

    def _connect(self) -> sqlite3.Connection:
        self._content_dir.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(
            self._db_path,
            timeout=self._busy_timeout_s,
            isolation_level=None,  # transactions are begun explicitly
            check_same_thread=False,  # made on the worker thread; closed by close()
        )
        try:
            # Switching a new database to WAL takes an exclusive lock without waiting for
            # it (no busy timeout): two stores opening at once would fail one of them. So
            # openers take turns, under a lock file every process shares.
            with open(self.directory / "jobs.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                conn.execute("PRAGMA journal_mode=WAL")
                # With WAL, NORMAL loses nothing when a process is killed (only on power
                # loss).
                conn.execute("PRAGMA synchronous=NORMAL")
                with _immediate(conn):
                    for statement in _SCHEMA:
                        conn.execute(statement)
                    conn.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _call(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        try:
            if self._conn is None:
                self._conn = self._connect()
            return fn(self._conn)
        except sqlite3.Error as e:
            raise JobStoreError(f"job store {self._db_path}: {e}") from e

    async def _db(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, fn)

    async def _files(self, fn: Callable[..., _T], *args: Any) -> _T:
        try:
            return await asyncio.to_thread(fn, *args)
        except OSError as e:
            raise JobStoreError(f"job store {self.directory}: {e}") from e

    async def create(
        self, job: VideoJob, *, max_active: int, input_bytes: bytes | None = None
    ) -> None:
        job = checked_job(job)

        def create(conn: sqlite3.Connection) -> None:
            with _immediate(conn):
                (active,) = conn.execute(
                    "SELECT count(*) FROM jobs WHERE status IN ('queued', 'in_progress')"
                ).fetchone()
                if active >= max_active:
                    raise QueueFullError(f"{active} video jobs are queued or running already")
                if conn.execute("SELECT 1 FROM jobs WHERE id = ?", (job.id,)).fetchone():
                    raise ValueError(f"job id {job.id} is in use")
                conn.execute(_UPSERT, _row(job))
                if input_bytes is not None:
                    conn.execute(
                        "INSERT OR REPLACE INTO inputs (id, data) VALUES (?, ?)",
                        (job.id, input_bytes),
                    )

        await self._db(create)

    async def get(self, job_id: str) -> VideoJob | None:
        def get(conn: sqlite3.Connection) -> VideoJob | None:
            row = conn.execute("SELECT record FROM jobs WHERE id = ?", (job_id,)).fetchone()
            return None if row is None else JOB_DECODER.decode(row[0])

        return await self._db(get)

    async def list(
        self, *, after: str | None, limit: int, order: Literal["asc", "desc"]
    ) -> tuple[list[VideoJob], bool]:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        if order not in ("asc", "desc"):
            raise ValueError(f"order is 'asc' or 'desc', not {order!r}")
        direction, beyond = ("ASC", ">") if order == "asc" else ("DESC", "<")

        def page(conn: sqlite3.Connection) -> tuple[list[VideoJob], bool]:
            with contextlib.closing(conn.cursor()) as cur:
                cur.execute("BEGIN")  # one snapshot for the cursor's position and the page
                try:
                    where, args = "", dict[str, Any](limit=limit + 1)
                    if after is not None:
                        row = cur.execute(
                            "SELECT created_at FROM jobs WHERE id = ?", (after,)
                        ).fetchone()
                        if row is None:
                            raise ValueError(f"no job {after!r} to list after")
                        where = f"WHERE (created_at, id) {beyond} (:created_at, :after)"
                        args |= {"created_at": row[0], "after": after}
                    rows = cur.execute(
                        f"SELECT record FROM jobs {where} "
                        f"ORDER BY created_at {direction}, id {direction} LIMIT :limit",
                        args,
                    ).fetchall()
                finally:
                    conn.rollback()
            jobs = [JOB_DECODER.decode(record) for (record,) in rows]
            return jobs[:limit], len(jobs) > limit

        return await self._db(page)

    async def update(self, job_id: str, *, owner: str | None, **changes: Any) -> VideoJob | None:
        checked = checked_changes(changes)

        def update(conn: sqlite3.Connection) -> VideoJob | None:
            with _immediate(conn):
                row = conn.execute("SELECT record FROM jobs WHERE id = ?", (job_id,)).fetchone()
                if row is None:
                    return None
                job = JOB_DECODER.decode(row[0])
                if owner is not None and job.owner != owner:
                    return None
                if not checked:
                    return job
                job = msgspec.structs.replace(job, **checked)
                conn.execute(_UPSERT, _row(job))
                return job

        return await self._db(update)

    async def claim(
        self,
        owner: str,
        *,
        now: float,
        lease_s: float,
        max_attempts: int,
        lost_ttl_s: int | None = None,
    ) -> VideoJob | None:
        def claim(conn: sqlite3.Connection) -> VideoJob | None:
            with _immediate(conn):
                while True:
                    row = conn.execute(_CLAIM_CANDIDATE, {"now": now}).fetchone()
                    if row is None:
                        return None
                    job = JOB_DECODER.decode(row[0])
                    if job.status == "in_progress" and job.attempts >= max_attempts:
                        conn.execute(
                            _UPSERT, _row(_failed_lost(job, now, max_attempts, lost_ttl_s))
                        )
                        continue
                    job = msgspec.structs.replace(
                        job,
                        status="in_progress",
                        owner=owner,
                        lease_until=now + lease_s,
                        attempts=job.attempts + 1,
                    )
                    conn.execute(_UPSERT, _row(job))
                    return job

        return await self._db(claim)

    async def renew(self, job_id: str, owner: str, lease_until: float) -> bool:
        def renew(conn: sqlite3.Connection) -> bool:
            with _immediate(conn):
                row = conn.execute(
                    "SELECT record FROM jobs WHERE id = ? AND owner = ?", (job_id, owner)
                ).fetchone()
                if row is None:
                    return False
                job = msgspec.structs.replace(
                    JOB_DECODER.decode(row[0]), lease_until=float(lease_until)
                )
                conn.execute(_UPSERT, _row(job))
                return True

        return await self._db(renew)

    async def release(self, job_id: str, owner: str) -> bool:
        def release(conn: sqlite3.Connection) -> bool:
            with _immediate(conn):
                row = conn.execute(
                    "SELECT record FROM jobs WHERE id = ? AND owner = ? AND status = ?",
                    (job_id, owner, "in_progress"),
                ).fetchone()
                if row is None:
                    return False
                conn.execute(_UPSERT, _row(_released(JOB_DECODER.decode(row[0]))))
                return True

        return await self._db(release)

    async def put_content(self, job_id: str, data: bytes) -> None:
        if not valid_id(job_id):
            return
        path = self._content_path(job_id)
        await self._files(_write_atomically, path, data)
        # After the rename, not before: a delete that ran in between removed the row and
        # found no file; this one then finds no row and removes the file itself.
        if await self.get(job_id) is None:
            await self._files(path.unlink, True)

    async def get_content(self, job_id: str) -> bytes | None:
        if not valid_id(job_id):
            return None
        return await self._files(_read_file, self._content_path(job_id))

    async def get_input(self, job_id: str) -> bytes | None:
        def get_input(conn: sqlite3.Connection) -> bytes | None:
            row = conn.execute("SELECT data FROM inputs WHERE id = ?", (job_id,)).fetchone()
            return None if row is None else bytes(row[0])

        return await self._db(get_input)

    async def delete(self, job_id: str) -> bool:
        def delete(conn: sqlite3.Connection) -> bool:
            with _immediate(conn):
                deleted = conn.execute("DELETE FROM jobs WHERE id = ?", (job_id,)).rowcount
                conn.execute("DELETE FROM inputs WHERE id = ?", (job_id,))
            return deleted > 0

        existed = await self._db(delete)
        if valid_id(job_id):
            await self._files(self._content_path(job_id).unlink, True)
        return existed

    async def purge_expired(self, now: int) -> int:
        def purge(conn: sqlite3.Connection) -> tuple[list[str], set[str]]:
            with _immediate(conn):
                expired = [
                    job_id
                    for (job_id,) in conn.execute(
                        "SELECT id FROM jobs WHERE expires_at <= ?", (now,)
                    ).fetchall()
                ]
                conn.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in expired])
                conn.executemany("DELETE FROM inputs WHERE id = ?", [(i,) for i in expired])
            kept = {job_id for (job_id,) in conn.execute("SELECT id FROM jobs").fetchall()}
            return expired, kept

        expired, kept = await self._db(purge)
        await self._files(self._sweep, expired, kept, now)
        return len(expired)

    def _sweep(self, expired: Sequence[str], kept: set[str], now: int) -> None:
        """Remove the expired jobs' videos, and the debris of writers killed mid-write:
        temp files, and videos of jobs that are gone, once they are old enough that no
        writer can be at work on them."""
        for job_id in expired:
            self._content_path(job_id).unlink(missing_ok=True)
        for path in self._content_dir.iterdir():
            job_id = path.name.removesuffix(".mp4")
            if path.name.startswith(".") or job_id not in kept:
                with contextlib.suppress(FileNotFoundError):
                    if path.stat().st_mtime < now - _ORPHAN_GRACE_S:
                        path.unlink()

    async def ping(self) -> None:
        await self._db(lambda conn: conn.execute("SELECT 1").fetchone())

    async def close(self) -> None:
        def close() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        await asyncio.get_running_loop().run_in_executor(self._executor, close)
        self._executor.shutdown(wait=False)


def _released(job: VideoJob) -> VideoJob:
    return msgspec.structs.replace(
        job,
        status="queued",
        owner=None,
        lease_until=None,
        progress=0,
        attempts=max(job.attempts - 1, 0),
    )


def _failed_lost(job: VideoJob, now: float, max_attempts: int, lost_ttl_s: int | None) -> VideoJob:
    return msgspec.structs.replace(
        job,
        status="failed",
        error=lost_error(max_attempts),
        owner=None,
        lease_until=None,
        completed_at=int(now),
        expires_at=job.expires_at if lost_ttl_s is None else int(now) + lost_ttl_s,
    )
