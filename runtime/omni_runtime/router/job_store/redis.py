"""``RedisJobStore``: the job store of a pipeline whose router has several replicas in a
cluster. Every change that must be atomic is one Lua script; ``prefix`` namespaces one
pipeline's keys, so several pipelines may share one Redis.

Keys, for a pipeline's prefix P (the values of a job's hash are each field's JSON):
  P:job:<id>      hash    the job, one field per VideoJob field
  P:input:<id>    string  its input image's bytes
  P:content:<id>  string  its finished MP4
  P:jobs          zset    every job's id, scored by created_at (ties: by id, as Redis
                          orders equal scores): what list pages through
  P:active        zset    the queued and in_progress jobs' ids, the same scores: what
                          create counts against max_active and claim searches
  P:expiry        zset    the ids of jobs with an expires_at, scored by it: what
                          purge_expired takes
A job's three keys carry EXPIREAT expires_at, so Redis removes them on time with no
router running; an id left behind in the zsets is dropped by the next script that finds
its job gone, and the zsets themselves expire with their last job once every job they
hold has an expiry.
"""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, cast

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
    redacted_url,
)

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = ["RedisJobStore"]

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
    return JSON_ENCODER.encode(value)


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
    return JOB_DECODER.decode(b"{" + body + b"}")


class RedisJobStore(JobStore):
    """Jobs in Redis under ``prefix`` (the key layout: the module's docstring). Every
    read-then-write is one Lua script, so it is atomic against every other replica. A
    standalone Redis (or a primary with replicas); not Redis Cluster (the scripts reach keys
    they are not given)."""

    def __init__(self, url: str, *, prefix: str, password: str | None = None) -> None:
        if not prefix or any(c.isspace() for c in prefix):
            raise ValueError(f"a job store prefix is non-empty text with no spaces: {prefix!r}")
        self.prefix = prefix
        self._where = f"job store {redacted_url(url)} (prefix {prefix})"
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
        job = checked_job(job)
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
        checked = checked_changes(changes)
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
            _json(lost_error(max_attempts)),
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
