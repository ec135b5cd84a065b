"""The store of Videos API jobs that every router replica of a pipeline shares.

A video takes minutes, longer than an HTTP request should be held open and longer than a
router replica is guaranteed to live (a rollout, an eviction). So a job is a record in a
store the replicas share: whichever replica a client reaches answers for it, and a replica
that takes a job holds it only under a lease it keeps renewing. When its replica dies the
lease lapses and another replica claims the job and runs it again, up to ``max_attempts``
starts, after which the job fails as ``job_lost`` (a job that kills its replica every time
must not go round forever). A replica that stops in good order releases its jobs instead,
which costs them no attempt.

Two backends, one interface:

- ``SqliteJobStore``: a SQLite database plus the finished videos as files in one directory,
  the embedded default of ``omni-runtime serve`` (no server to start). Correct across the
  processes of one host (SQLite's file locks), not across hosts.
- ``RedisJobStore``: the store of a pipeline whose router has several replicas in a
  cluster. Every change that must be atomic is one Lua script; ``prefix`` namespaces one
  pipeline's keys, so several pipelines may share one Redis.

Records are JSON (msgspec), never pickle: a store is shared with other processes and
outlives the code that wrote it. Any backend failure (unreachable server, bad password,
locked or broken database) escapes as ``JobStoreError``, whose message names the store.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import fcntl
import os
import re
import secrets
import sqlite3
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar, cast

import msgspec

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = [
    "JobStatus",
    "JobStore",
    "JobStoreError",
    "QueueFullError",
    "RedisJobStore",
    "SqliteJobStore",
    "VideoJob",
    "open_job_store",
]

JobStatus = Literal["queued", "in_progress", "completed", "failed"]


class VideoJob(msgspec.Struct, frozen=True, kw_only=True):
    id: str  # "video_" + 32 hex chars, made by the router
    created_at: int  # unix seconds
    status: JobStatus
    model: str
    prompt: str
    size: str  # "WxH"
    seconds: str
    progress: int = 0  # 0..100
    # What the router needs to run (or re-run) the job; JSON-able.
    params: dict[str, Any] = {}
    completed_at: int | None = None
    # Unix seconds; past it the job and its files are deleted.
    expires_at: int | None = None
    error: dict[str, str] | None = None  # {"code": ..., "message": ...}
    owner: str | None = None  # the router replica running it
    # Unix seconds; past it another replica may take the job.
    lease_until: float | None = None
    attempts: int = 0  # times a replica has started it


class QueueFullError(Exception):
    """create() found max_active jobs queued or in progress already."""


class JobStoreError(RuntimeError):
    """The store failed (unreachable, refused the credentials, broken): not the caller's
    fault, and the same call may succeed later."""


# Ids name files and keys: anything else cannot be a job, and must never become a path.
_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
# Fields that place a job in the stores' indexes: a job keeps them for life.
_FIXED_FIELDS: Final = frozenset({"id", "created_at"})
_FIELD_TYPES: Final[Mapping[str, Any]] = {f.name: f.type for f in msgspec.structs.fields(VideoJob)}
_ENCODER: Final = msgspec.json.Encoder()
_JOB_DECODER: Final = msgspec.json.Decoder(VideoJob)


def _valid_id(job_id: str) -> bool:
    return _JOB_ID.fullmatch(job_id) is not None


def _checked_job(job: VideoJob) -> VideoJob:
    """``job`` as it will read back: a Struct's constructor checks no types, and params must
    survive JSON, so the record is validated by the same round trip every read takes."""
    if not _valid_id(job.id):
        raise ValueError(f"job id {job.id!r} is not 1-128 letters, digits, '_' or '-'")
    return _JOB_DECODER.decode(_ENCODER.encode(job))


def _checked_changes(changes: Mapping[str, Any]) -> dict[str, Any]:
    """``changes`` validated field by field (ValueError or TypeError naming the field),
    before anything is written: one bad value would otherwise make the record unreadable."""
    checked: dict[str, Any] = {}
    for name, value in changes.items():
        if name in _FIXED_FIELDS:
            raise ValueError(f"a job's {name} never changes")
        if name not in _FIELD_TYPES:
            raise TypeError(f"VideoJob has no field {name!r}")
        try:
            checked[name] = msgspec.convert(value, _FIELD_TYPES[name])
        except msgspec.ValidationError as e:
            raise ValueError(f"job field {name}: {e}") from e
        _ENCODER.encode(checked[name])  # TypeError if it is not JSON-able
    return checked


def _lost_error(max_attempts: int) -> dict[str, str]:
    return {
        "code": "job_lost",
        "message": (
            "the router replica running this job stopped before finishing it, and the job "
            f"had been started as many times as allowed ({max_attempts})"
        ),
    }


def _redacted(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = f"{parts.username}:" if parts.username else ":"
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}***@{host}"))


class JobStore(abc.ABC):
    """Video jobs, their input images and their finished videos, shared by every router
    replica of one pipeline. Times are passed in (``now``) rather than read, so that every
    replica's decision is made on the clock its caller chose."""

    @abc.abstractmethod
    async def create(
        self, job: VideoJob, *, max_active: int, input_bytes: bytes | None = None
    ) -> None:
        """Store a new job (and its input image's bytes, if any) unless max_active jobs are
        queued or in_progress already: QueueFullError (atomic: two routers racing cannot
        both pass the limit). ValueError for an id in use or a record that does not
        validate."""

    @abc.abstractmethod
    async def get(self, job_id: str) -> VideoJob | None: ...

    @abc.abstractmethod
    async def list(
        self, *, after: str | None, limit: int, order: Literal["asc", "desc"]
    ) -> tuple[list[VideoJob], bool]:
        """Jobs by created_at (then id), ``after`` a job id cursor (the jobs after it in
        that order; an unknown id: ValueError), and whether more follow."""

    @abc.abstractmethod
    async def update(self, job_id: str, *, owner: str | None, **changes: Any) -> VideoJob | None:
        """Apply field changes atomically if the job exists and (owner is None or the job's
        owner is ``owner``); the new job, else None (gone, or owned by another replica: a
        stale router must not overwrite). The job's own ``owner`` cannot be a change (the
        keyword is the check): release() hands a job back. ValueError or TypeError, before
        anything is written, for a change that is no VideoJob field, does not validate, or
        touches id or created_at (they place the job in the indexes)."""

    @abc.abstractmethod
    async def claim(
        self,
        owner: str,
        *,
        now: float,
        lease_s: float,
        max_attempts: int,
        lost_ttl_s: int | None = None,
    ) -> VideoJob | None:
        """Atomically take the oldest job that is queued with no live holder (no owner, or
        its lease lapsed) or in_progress with its lease lapsed (lease_until < now, or none:
        its router died): owner=owner, status in_progress, lease_until now+lease_s,
        attempts+1. A lost job whose attempts already reached max_attempts is marked failed
        instead (error code "job_lost", completed_at now, expires_at now+lost_ttl_s when
        given) and the next candidate is considered. None if nothing to take."""

    @abc.abstractmethod
    async def renew(self, job_id: str, owner: str, lease_until: float) -> bool:
        """Extend the lease; False if the job is gone or owned by another (the runner then
        aborts)."""

    @abc.abstractmethod
    async def release(self, job_id: str, owner: str) -> bool:
        """Give a job that ``owner`` runs back to the queue (its replica stops): queued, no
        owner, no lease, progress 0, and the attempt it was given back, so that another
        replica takes it at once and the stop costs it none of its max_attempts. False if
        the job is gone, owned by another, or not in progress."""

    @abc.abstractmethod
    async def put_content(self, job_id: str, data: bytes) -> None:
        """Store the finished MP4; nothing is kept if the job is gone (deleted meanwhile)."""

    @abc.abstractmethod
    async def get_content(self, job_id: str) -> bytes | None: ...

    @abc.abstractmethod
    async def get_input(self, job_id: str) -> bytes | None: ...

    @abc.abstractmethod
    async def delete(self, job_id: str) -> bool:
        """Delete the job, its input and its content; False if there was no job."""

    @abc.abstractmethod
    async def purge_expired(self, now: int) -> int:
        """Delete the jobs (and files) whose expires_at <= now; how many."""

    async def ping(self) -> None:
        """JobStoreError now if the store cannot be used (for a router's start)."""
        await self.get("ping")

    @abc.abstractmethod
    async def close(self) -> None: ...


# ---------------------------------------------------------------------------------------
# SQLite

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
        "record": _ENCODER.encode(job).decode(),
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
        job = _checked_job(job)

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
            return None if row is None else _JOB_DECODER.decode(row[0])

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
            jobs = [_JOB_DECODER.decode(record) for (record,) in rows]
            return jobs[:limit], len(jobs) > limit

        return await self._db(page)

    async def update(self, job_id: str, *, owner: str | None, **changes: Any) -> VideoJob | None:
        checked = _checked_changes(changes)

        def update(conn: sqlite3.Connection) -> VideoJob | None:
            with _immediate(conn):
                row = conn.execute("SELECT record FROM jobs WHERE id = ?", (job_id,)).fetchone()
                if row is None:
                    return None
                job = _JOB_DECODER.decode(row[0])
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
                    job = _JOB_DECODER.decode(row[0])
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
                    _JOB_DECODER.decode(row[0]), lease_until=float(lease_until)
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
                conn.execute(_UPSERT, _row(_released(_JOB_DECODER.decode(row[0]))))
                return True

        return await self._db(release)

    async def put_content(self, job_id: str, data: bytes) -> None:
        if not _valid_id(job_id):
            return
        path = self._content_path(job_id)
        await self._files(_write_atomically, path, data)
        # After the rename, not before: a delete that ran in between removed the row and
        # found no file; this one then finds no row and removes the file itself.
        if await self.get(job_id) is None:
            await self._files(path.unlink, True)

    async def get_content(self, job_id: str) -> bytes | None:
        if not _valid_id(job_id):
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
        if _valid_id(job_id):
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
        error=_lost_error(max_attempts),
        owner=None,
        lease_until=None,
        completed_at=int(now),
        expires_at=job.expires_at if lost_ttl_s is None else int(now) + lost_ttl_s,
    )


# ---------------------------------------------------------------------------------------
# Redis
#
# Keys, for a pipeline's prefix P (the values of a job's hash are each field's JSON):
#   P:job:<id>      hash    the job, one field per VideoJob field
#   P:input:<id>    string  its input image's bytes
#   P:content:<id>  string  its finished MP4
#   P:jobs          zset    every job's id, scored by created_at (ties: by id, as Redis
#                           orders equal scores): what list pages through
#   P:active        zset    the queued and in_progress jobs' ids, the same scores: what
#                           create counts against max_active and claim searches
#   P:expiry        zset    the ids of jobs with an expires_at, scored by it: what
#                           purge_expired takes
# A job's three keys carry EXPIREAT expires_at, so Redis removes them on time with no
# router running; an id left behind in the zsets is dropped by the next script that finds
# its job gone, and the zsets themselves expire with their last job once every job they
# hold has an expiry.

_LUA_PRELUDE: Final = """
local prefix = ARGV[1]
local function key(kind, id) return prefix .. ':' .. kind .. ':' .. id end
local index_key = prefix .. ':jobs'
local active_key = prefix .. ':active'
local expiry_key = prefix .. ':expiry'

-- Drop an id from every zset; 1 if it was in the index.
local function forget(id)
  redis.call('ZREM', active_key, id)
  redis.call('ZREM', expiry_key, id)
  return redis.call('ZREM', index_key, id)
end

-- Expire a job's keys at `at` (unix seconds, as text), or never (nil).
local function set_expiry(id, at)
  local keys = {key('job', id), key('input', id), key('content', id)}
  if at then
    redis.call('ZADD', expiry_key, at, id)
    for _, k in ipairs(keys) do redis.call('EXPIREAT', k, at) end
  else
    redis.call('ZREM', expiry_key, id)
    for _, k in ipairs(keys) do redis.call('PERSIST', k) end
  end
end

-- The zsets expire with the last job once every job in them has an expiry, else never.
local function refresh_ttl()
  local n = redis.call('ZCARD', index_key)
  if n > 0 and redis.call('ZCARD', expiry_key) == n then
    local last = redis.call('ZRANGE', expiry_key, -1, -1, 'WITHSCORES')[2]
    for _, k in ipairs({index_key, active_key, expiry_key}) do redis.call('EXPIREAT', k, last) end
  else
    for _, k in ipairs({index_key, active_key, expiry_key}) do redis.call('PERSIST', k) end
  end
end
"""

# ARGV: prefix, id, max_active, created_at, expires_at or '', has input ('1'/'0'),
# input, then the job's field/JSON pairs.
_CREATE_LUA: Final = (
    _LUA_PRELUDE
    + """
local id = ARGV[2]
local job_key = key('job', id)
if redis.call('EXISTS', job_key) == 1 then return 'exists' end
local active = 0
for _, other in ipairs(redis.call('ZRANGE', active_key, 0, -1)) do
  if redis.call('EXISTS', key('job', other)) == 1 then active = active + 1 else forget(other) end
end
if active >= tonumber(ARGV[3]) then return 'full' end
redis.call('HSET', job_key, unpack(ARGV, 8))
redis.call('ZADD', index_key, ARGV[4], id)
local status = redis.call('HGET', job_key, 'status')
if status == '"queued"' or status == '"in_progress"' then
  redis.call('ZADD', active_key, ARGV[4], id)
end
if ARGV[6] == '1' then redis.call('SET', key('input', id), ARGV[7]) end
if ARGV[5] ~= '' then set_expiry(id, ARGV[5]) end
refresh_ttl()
return 'ok'
"""
)

# ARGV: prefix, id, the owner's JSON to check or '', the new status or '', the new
# expires_at ('' unchanged, 'null' none, else unix seconds), then field/JSON pairs.
_UPDATE_LUA: Final = (
    _LUA_PRELUDE
    + """
local id = ARGV[2]
local job_key = key('job', id)
if redis.call('EXISTS', job_key) == 0 then return false end
if ARGV[3] ~= '' and redis.call('HGET', job_key, 'owner') ~= ARGV[3] then return false end
if #ARGV >= 6 then redis.call('HSET', job_key, unpack(ARGV, 6)) end
if ARGV[4] == 'queued' or ARGV[4] == 'in_progress' then
  redis.call('ZADD', active_key, redis.call('HGET', job_key, 'created_at'), id)
elseif ARGV[4] ~= '' then
  redis.call('ZREM', active_key, id)
end
local job = redis.call('HGETALL', job_key)
if ARGV[5] == 'null' then set_expiry(id, nil) elseif ARGV[5] ~= '' then set_expiry(id, ARGV[5]) end
refresh_ttl()
return job
"""
)

# ARGV: prefix, owner's JSON, now, the new lease_until's JSON, max_attempts, the job_lost
# error's JSON, its completed_at's, its expires_at or ''.
# Returns the claimed job's HGETALL, or nil.
_CLAIM_LUA: Final = (
    _LUA_PRELUDE
    + """
local now = tonumber(ARGV[3])
local max_attempts = tonumber(ARGV[5])
local result = false
for _, id in ipairs(redis.call('ZRANGE', active_key, 0, -1)) do
  local job_key = key('job', id)
  local f = redis.call('HMGET', job_key, 'status', 'owner', 'lease_until', 'attempts')
  local status, owner, lease = f[1], f[2], f[3]
  if not status then
    forget(id)  -- expired by its TTL
  elseif status ~= '"queued"' and status ~= '"in_progress"' then
    redis.call('ZREM', active_key, id)
  else
    local lapsed = (not lease) or lease == 'null' or tonumber(lease) < now
    local attempts = tonumber(f[4]) or 0
    if status == '"in_progress"' and lapsed and attempts >= max_attempts then
      redis.call('HSET', job_key, 'status', '"failed"', 'owner', 'null', 'lease_until', 'null',
        'error', ARGV[6], 'completed_at', ARGV[7])
      redis.call('ZREM', active_key, id)
      if ARGV[8] ~= '' then
        redis.call('HSET', job_key, 'expires_at', ARGV[8])
        set_expiry(id, ARGV[8])
      end
    elseif lapsed or (status == '"queued"' and ((not owner) or owner == 'null')) then
      redis.call('HSET', job_key, 'status', '"in_progress"', 'owner', ARGV[2],
        'lease_until', ARGV[4], 'attempts', string.format('%d', attempts + 1))
      result = redis.call('HGETALL', job_key)
      break
    end
  end
end
refresh_ttl()
return result
"""
)

# ARGV: prefix, id, owner's JSON, lease_until's JSON.
_RENEW_LUA: Final = (
    _LUA_PRELUDE
    + """
local job_key = key('job', ARGV[2])
if redis.call('HGET', job_key, 'owner') ~= ARGV[3] then return 0 end
redis.call('HSET', job_key, 'lease_until', ARGV[4])
return 1
"""
)

# ARGV: prefix, id, owner's JSON. 1 if the job was given back.
_RELEASE_LUA: Final = (
    _LUA_PRELUDE
    + """
local job_key = key('job', ARGV[2])
local f = redis.call('HMGET', job_key, 'owner', 'status', 'attempts')
if f[1] ~= ARGV[3] or f[2] ~= '"in_progress"' then return 0 end
local attempts = math.max((tonumber(f[3]) or 0) - 1, 0)
redis.call('HSET', job_key, 'status', '"queued"', 'owner', 'null', 'lease_until', 'null',
  'progress', '0', 'attempts', string.format('%d', attempts))
return 1
"""
)

# ARGV: prefix, id, data. The content expires with its job; none is kept for a job gone.
_PUT_CONTENT_LUA: Final = (
    _LUA_PRELUDE
    + """
local job_key = key('job', ARGV[2])
local expires_at = redis.call('HGET', job_key, 'expires_at')
if not expires_at then return 0 end
local content_key = key('content', ARGV[2])
redis.call('SET', content_key, ARGV[3])
if expires_at ~= 'null' then redis.call('EXPIREAT', content_key, expires_at) end
return 1
"""
)

# ARGV: prefix, id. 1 if the job was there.
_DELETE_LUA: Final = (
    _LUA_PRELUDE
    + """
local id = ARGV[2]
local existed = redis.call('DEL', key('job', id))
redis.call('DEL', key('input', id), key('content', id))
forget(id)
refresh_ttl()
return existed
"""
)

# ARGV: prefix, now, batch. {jobs deleted, ids taken}: at most `batch` ids a call, so that
# one call never holds Redis for long.
_PURGE_LUA: Final = (
    _LUA_PRELUDE
    + """
local ids = redis.call('ZRANGEBYSCORE', expiry_key, '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))
local deleted = 0
for _, id in ipairs(ids) do
  redis.call('DEL', key('job', id), key('input', id), key('content', id))
  deleted = deleted + forget(id)
end
refresh_ttl()
return {deleted, #ids}
"""
)

# ARGV: prefix, after or '', limit, 'asc' or 'desc'. {0} for an unknown cursor, else
# {1, {job's HGETALL, ...}} with up to limit + 1 live jobs (the extra one: more follow).
_LIST_LUA: Final = (
    _LUA_PRELUDE
    + """
local after, want, desc = ARGV[2], tonumber(ARGV[3]) + 1, ARGV[4] == 'desc'
local pos = 0
if after ~= '' then
  local rank
  if desc then rank = redis.call('ZREVRANK', index_key, after)
  else rank = redis.call('ZRANK', index_key, after) end
  if not rank then return {0} end
  pos = rank + 1
end
local jobs, stale = {}, {}
while #jobs < want do
  local ids
  if desc then ids = redis.call('ZREVRANGE', index_key, pos, pos + want - 1)
  else ids = redis.call('ZRANGE', index_key, pos, pos + want - 1) end
  if #ids == 0 then break end
  for _, id in ipairs(ids) do
    local job = redis.call('HGETALL', key('job', id))
    if #job == 0 then stale[#stale + 1] = id
    else
      jobs[#jobs + 1] = job
      if #jobs == want then break end
    end
  end
  pos = pos + #ids
end
for _, id in ipairs(stale) do forget(id) end
if #stale > 0 then refresh_ttl() end
return {1, jobs}
"""
)

_PURGE_BATCH: Final = 500


def _json(value: Any) -> bytes:
    return _ENCODER.encode(value)


def _hash_fields(values: Mapping[str, Any]) -> list[bytes | str]:
    """``values`` as HSET's field/value arguments, each value its JSON."""
    fields: list[bytes | str] = []
    for name, value in values.items():
        fields += [name, _json(value)]
    return fields


def _job_from_hash(fields: Mapping[bytes, bytes] | Sequence[bytes]) -> VideoJob:
    """The job of a hash, as HGETALL gives it (a mapping, or a script's flat list)."""
    if not isinstance(fields, Mapping):
        it = iter(fields)
        fields = dict(zip(it, it, strict=True))
    # Each value is JSON already: the object is spliced together, then validated whole.
    body = b",".join(b'"' + name + b'":' + value for name, value in fields.items())
    return _JOB_DECODER.decode(b"{" + body + b"}")


class RedisJobStore(JobStore):
    """Jobs in Redis under ``prefix`` (key layout above). Every read-then-write is one Lua
    script, so it is atomic against every other replica. A standalone Redis (or a primary
    with replicas); not Redis Cluster (the scripts reach keys they are not given)."""

    def __init__(self, url: str, *, prefix: str, password: str | None = None) -> None:
        if not prefix or any(c.isspace() for c in prefix):
            raise ValueError(f"a job store prefix is non-empty text with no spaces: {prefix!r}")
        self.prefix = prefix
        self._where = f"job store {_redacted(url)} (prefix {prefix})"
        self._has_password = password is not None or bool(urllib.parse.urlsplit(url).password)
        # Imported here, not with the module: redis-py imports OpenTelemetry's SDK, which a
        # router that exports no traces never loads otherwise, and most routers (those of
        # image and text pipelines) never open a Redis store.
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialWithJitterBackoff

        options: dict[str, Any] = {}
        if password is not None:
            options["password"] = password
        self._redis: aioredis.Redis = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=5,
            # Per read, so a large video still crosses; a hung server fails calls instead
            # of holding them (each retried, so about 40 s in all).
            socket_timeout=10,
            # A connection idle this long is checked before use (a proxy may have cut it).
            health_check_interval=30,
            # A few quick retries ride over a dropped connection; a server that is down
            # fails the call within about a second.
            retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=3),
            **options,
        )
        register = self._redis.register_script
        self._create = register(_CREATE_LUA)
        self._update = register(_UPDATE_LUA)
        self._claim = register(_CLAIM_LUA)
        self._renew = register(_RENEW_LUA)
        self._release = register(_RELEASE_LUA)
        self._put_content = register(_PUT_CONTENT_LUA)
        self._delete = register(_DELETE_LUA)
        self._purge = register(_PURGE_LUA)
        self._list = register(_LIST_LUA)

    def __repr__(self) -> str:
        return f"RedisJobStore({self._where})"

    def _key(self, kind: str, job_id: str) -> str:
        return f"{self.prefix}:{kind}:{job_id}"

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        import redis.exceptions

        try:
            yield
        except redis.exceptions.AuthenticationError as e:
            problem = (
                "Redis refused the password"
                if self._has_password
                else "Redis asks for a password, and none was given"
            )
            raise JobStoreError(
                f"{self._where}: {problem} (it is taken from the URL, or from the job "
                f"store's own password setting); Redis said: {e}"
            ) from e
        except redis.exceptions.RedisError as e:
            raise JobStoreError(f"{self._where}: {type(e).__name__}: {e}") from e

    async def create(
        self, job: VideoJob, *, max_active: int, input_bytes: bytes | None = None
    ) -> None:
        job = _checked_job(job)
        args: list[Any] = [
            self.prefix,
            job.id,
            max_active,
            job.created_at,
            "" if job.expires_at is None else job.expires_at,
            "0" if input_bytes is None else "1",
            input_bytes or b"",
            *_hash_fields(msgspec.structs.asdict(job)),
        ]
        with self._errors():
            outcome = await self._create(args=args)
            if outcome == b"exists":
                # A retry after a reply that was lost finds its own job: done already.
                stored = await self.get(job.id)
                if stored is not None and _same_creation(stored, job):
                    return
        if outcome == b"full":
            raise QueueFullError(f"{max_active} video jobs are queued or running already")
        if outcome == b"exists":
            raise ValueError(f"job id {job.id} is in use")

    async def get(self, job_id: str) -> VideoJob | None:
        with self._errors():
            fields = cast("dict[bytes, bytes]", await self._redis.hgetall(self._key("job", job_id)))
        return _job_from_hash(fields) if fields else None

    async def list(
        self, *, after: str | None, limit: int, order: Literal["asc", "desc"]
    ) -> tuple[list[VideoJob], bool]:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        if order not in ("asc", "desc"):
            raise ValueError(f"order is 'asc' or 'desc', not {order!r}")
        with self._errors():
            reply = await self._list(args=[self.prefix, after or "", limit, order])
        if reply[0] == 0:
            raise ValueError(f"no job {after!r} to list after")
        jobs = [_job_from_hash(fields) for fields in reply[1]]
        return jobs[:limit], len(jobs) > limit

    async def update(self, job_id: str, *, owner: str | None, **changes: Any) -> VideoJob | None:
        checked = _checked_changes(changes)
        expires: str | int = ""
        if "expires_at" in checked:
            expires = "null" if checked["expires_at"] is None else checked["expires_at"]
        args: list[Any] = [
            self.prefix,
            job_id,
            b"" if owner is None else _json(owner),
            checked.get("status", ""),
            expires,
            *_hash_fields(checked),
        ]
        with self._errors():
            fields = await self._update(args=args)
        return _job_from_hash(fields) if fields else None

    async def claim(
        self,
        owner: str,
        *,
        now: float,
        lease_s: float,
        max_attempts: int,
        lost_ttl_s: int | None = None,
    ) -> VideoJob | None:
        args: list[Any] = [
            self.prefix,
            _json(owner),
            repr(float(now)),
            _json(float(now + lease_s)),
            max_attempts,
            _json(_lost_error(max_attempts)),
            _json(int(now)),
            "" if lost_ttl_s is None else int(now) + lost_ttl_s,
        ]
        with self._errors():
            fields = await self._claim(args=args)
        return _job_from_hash(fields) if fields else None

    async def renew(self, job_id: str, owner: str, lease_until: float) -> bool:
        with self._errors():
            renewed = await self._renew(
                args=[self.prefix, job_id, _json(owner), _json(float(lease_until))]
            )
        return bool(renewed)

    async def release(self, job_id: str, owner: str) -> bool:
        with self._errors():
            released = await self._release(args=[self.prefix, job_id, _json(owner)])
        return bool(released)

    async def put_content(self, job_id: str, data: bytes) -> None:
        with self._errors():
            await self._put_content(args=[self.prefix, job_id, data])

    async def get_content(self, job_id: str) -> bytes | None:
        with self._errors():
            data = cast("bytes | None", await self._redis.get(self._key("content", job_id)))
        return data

    async def get_input(self, job_id: str) -> bytes | None:
        with self._errors():
            data = cast("bytes | None", await self._redis.get(self._key("input", job_id)))
        return data

    async def delete(self, job_id: str) -> bool:
        with self._errors():
            existed = await self._delete(args=[self.prefix, job_id])
        return bool(existed)

    async def purge_expired(self, now: int) -> int:
        total = 0
        with self._errors():
            while True:
                deleted, taken = await self._purge(args=[self.prefix, int(now), _PURGE_BATCH])
                total += int(deleted)
                if int(taken) < _PURGE_BATCH:
                    return total

    async def ping(self) -> None:
        with self._errors():
            await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()


def _same_creation(stored: VideoJob, job: VideoJob) -> bool:
    """Whether ``stored`` is ``job`` as created (a claim may have changed it since)."""
    return (stored.created_at, stored.model, stored.prompt, stored.params) == (
        job.created_at,
        job.model,
        job.prompt,
        job.params,
    )


def open_job_store(
    url: str | None, directory: Path, *, prefix: str, password: str | None = None
) -> JobStore:
    """redis:// or rediss:// -> RedisJobStore; None -> SqliteJobStore(directory); anything
    else: ValueError naming the accepted forms."""
    if url is None:
        return SqliteJobStore(directory)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("redis", "rediss"):
        return RedisJobStore(url, prefix=prefix, password=password)
    raise ValueError(
        f"job store URL {_redacted(url)!r}: expected redis://[[user]:password@]host[:port][/db], "
        "rediss://... (Redis over TLS), or none for the embedded SQLite store in "
        f"{directory}"
    )
