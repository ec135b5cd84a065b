"""What every video job store is and shares: the job record (``VideoJob``), the errors a
store raises, the ``JobStore`` interface, and the checks and codecs both backends apply, so
that a record reads back the same whichever backend wrote it."""

from __future__ import annotations

import abc
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any, Final, Literal

import msgspec

__all__ = [
    "JOB_DECODER",
    "JSON_ENCODER",
    "JobStatus",
    "JobStore",
    "JobStoreError",
    "QueueFullError",
    "VideoJob",
    "checked_changes",
    "checked_job",
    "lost_error",
    "redacted_url",
    "valid_id",
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
JSON_ENCODER: Final = msgspec.json.Encoder()
JOB_DECODER: Final = msgspec.json.Decoder(VideoJob)


def valid_id(job_id: str) -> bool:
    return _JOB_ID.fullmatch(job_id) is not None


def checked_job(job: VideoJob) -> VideoJob:
    """``job`` as it will read back: a Struct's constructor checks no types, and params must
    survive JSON, so the record is validated by the same round trip every read takes."""
    if not valid_id(job.id):
        raise ValueError(f"job id {job.id!r} is not 1-128 letters, digits, '_' or '-'")
    return JOB_DECODER.decode(JSON_ENCODER.encode(job))


def checked_changes(changes: Mapping[str, Any]) -> dict[str, Any]:
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
        JSON_ENCODER.encode(checked[name])  # TypeError if it is not JSON-able
    return checked


def lost_error(max_attempts: int) -> dict[str, str]:
    return {
        "code": "job_lost",
        "message": (
            "the router replica running this job stopped before finishing it, and the job "
            f"had been started as many times as allowed ({max_attempts})"
        ),
    }


def redacted_url(url: str) -> str:
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
