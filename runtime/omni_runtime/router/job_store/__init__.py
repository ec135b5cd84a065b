"""The store of Videos API jobs that every router replica of a pipeline shares.

A video takes minutes, longer than an HTTP request should be held open and longer than a
router replica is guaranteed to live (a rollout, an eviction). So a job is a record in a
store the replicas share: whichever replica a client reaches answers for it, and a replica
that takes a job holds it only under a lease it keeps renewing. When its replica dies the
lease lapses and another replica claims the job and runs it again, up to ``max_attempts``
starts, after which the job fails as ``job_lost`` (a job that kills its replica every time
must not go round forever). A replica that stops in good order releases its jobs instead,
which costs them no attempt.

Two backends, one interface (``base``: the record, the errors, ``JobStore``):

- ``SqliteJobStore`` (``sqlite``): a SQLite database plus the finished videos as files in
  one directory, the embedded default of ``omni-runtime serve`` (no server to start).
  Correct across the processes of one host (SQLite's file locks), not across hosts.
- ``RedisJobStore`` (``redis``): the store of a pipeline whose router has several replicas
  in a cluster. Every change that must be atomic is one Lua script; ``prefix`` namespaces
  one pipeline's keys, so several pipelines may share one Redis.

Records are JSON (msgspec), never pickle: a store is shared with other processes and
outlives the code that wrote it. Any backend failure (unreachable server, bad password,
locked or broken database) escapes as ``JobStoreError``, whose message names the store.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from omni_runtime.router.job_store.base import (
    JobStatus,
    JobStore,
    JobStoreError,
    QueueFullError,
    VideoJob,
    redacted_url,
)
from omni_runtime.router.job_store.redis import RedisJobStore
from omni_runtime.router.job_store.sqlite import SqliteJobStore

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
        f"job store URL {redacted_url(url)!r}: "
        "expected redis://[[user]:password@]host[:port][/db], "
        "rediss://... (Redis over TLS), or none for the embedded SQLite store in "
        f"{directory}"
    )
