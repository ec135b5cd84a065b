"""The Videos API's jobs: created, run and answered for by any router replica of a pipeline.

``POST /v1/videos`` stores a queued job in the pipeline's job store (``router.job_store``)
and answers with it at once: a clip takes minutes, longer than a request should be held and
longer than a router replica is sure to live. Each replica runs a claim loop that takes
queued jobs (its own or another replica's), up to ``jobs_per_router`` at once, and holds
each under a lease that it renews while the job runs:

- a job runs through the orchestrator as one pipeline request with the clip's params; the
  DiT's progress reports become the job's ``progress``; the frames become an MP4
  (``videos.encode_mp4``) stored with the job, both deleted ``content_ttl_seconds`` after
  it ends;
- a replica that dies mid-job stops renewing: once its lease lapses another replica claims
  the job and runs it again from the first stage, once (a second loss fails it as
  ``job_lost``); a replica that shuts down gives its jobs back at once instead;
- ``DELETE`` removes the job; the replica running it aborts it in every stage at once if it
  is the one asked, else at its next renewal (a third of the lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol

from omni_runtime.config import VideoJobsConfig
from omni_runtime.families.base import VideoRecipe
from omni_runtime.router.adapters import AdapterCatalog
from omni_runtime.router.errors import RequestError
from omni_runtime.router.job_store import JobStore, JobStoreError, QueueFullError, VideoJob
from omni_runtime.router.limits import RouterLimits
from omni_runtime.router.media import decode_input_image
from omni_runtime.router.multipart import INPUT_REFERENCE
from omni_runtime.router.orchestrator import PipelineError, PipelineOrchestrator
from omni_runtime.router.stage_requests import PipelineRequest
from omni_runtime.videos import encode_mp4


class VideoAsk(Protocol):
    """What a job is made from: the Videos API's body (router.endpoints.videos), as far
    as the jobs read it."""

    @property
    def prompt(self) -> str: ...
    @property
    def model(self) -> str | None: ...
    @property
    def size(self) -> str | None: ...
    @property
    def user(self) -> str | None: ...
    def job_params(self, recipe: VideoRecipe, limits: RouterLimits) -> dict[str, Any]: ...


logger = logging.getLogger(__name__)

# A replica that has not renewed its lease for this long is taken for gone. Renewing every
# third of it lets two renewals fail (a slow store, a stalled loop) before another replica
# takes the job.
LEASE_S = 15.0
RENEW_S = LEASE_S / 3
# How often an idle replica looks for jobs that others queued or lost (its own wake it).
POLL_S = 1.0
# A job starts at most twice: a second loss says more about the job than the replicas.
MAX_ATTEMPTS = 2
# Progress is written at most this often: a step every few milliseconds on a small clip
# would be a store write each.
PROGRESS_WRITE_S = 1.0
PURGE_S = 60.0
# A page of GET /v1/videos: OpenAI's default and most.
DEFAULT_PAGE = 20
MAX_PAGE = 100


def new_owner() -> str:
    """This router replica's name in the store: its host (the pod) and process."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def new_job_id(now: float) -> str:
    """``video_`` and 32 hex digits: the creation time in milliseconds, then random ones, so
    that jobs made within one second (``created_at``'s unit) still list in the order they
    were made, as the store orders them by time, then id."""
    return f"video_{int(now * 1000):012x}{secrets.token_hex(10)}"


def video_object(job: VideoJob) -> dict[str, Any]:
    """OpenAI's Video object of ``job``."""
    return {
        "id": job.id,
        "object": "video",
        "created_at": job.created_at,
        "completed_at": job.completed_at,
        "expires_at": job.expires_at,
        "error": job.error,
        "model": job.model,
        "progress": job.progress,
        "prompt": job.prompt,
        "remixed_from_video_id": None,
        "seconds": job.seconds,
        "size": job.size,
        "status": job.status,
    }


class VideoJobs:
    """One router replica's part in its pipeline's video jobs."""

    def __init__(
        self,
        store: JobStore,
        orchestrator: PipelineOrchestrator,
        config: VideoJobsConfig,
        recipe: VideoRecipe,
        *,
        model_name: str,
        limits: RouterLimits,
        takes_image: bool = True,
        requires_image: bool = False,
        sized_by_image: bool = False,
        owner: str | None = None,
        clock: Callable[[], float] = time.time,
        adapters: AdapterCatalog | None = None,
        size_multiple: Callable[[], Awaitable[int | None]] | None = None,
    ) -> None:
        self.store = store
        # What the DiT's heights and widths must be multiples of (None: unknown for now,
        # which leaves the check to the stage when the job runs).
        self.size_multiple = size_multiple
        # The pipeline's LoRA adapters, which a job's model may name (None: it takes none).
        self.adapters = adapters
        self.orchestrator = orchestrator
        self.config = config
        self.recipe = recipe
        self.model_name = model_name
        self.limits = limits
        # Whether the family's DiT starts a clip from an image (image-to-video), whether it
        # makes none without one, and whether it then takes the clip's size from the image
        # (its family's DiTRecipe: HunyuanVideo-1.5's image-to-video does both).
        self.takes_image = takes_image
        self.requires_image = requires_image
        self.sized_by_image = sized_by_image
        self.owner = owner or new_owner()
        self.clock = clock
        # The jobs this replica runs, by id.
        self._running: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []

    @property
    def running(self) -> int:
        return len(self._running)

    def start(self) -> None:
        self._loops = [
            asyncio.create_task(self._claim_loop(), name="video-jobs-claim"),
            asyncio.create_task(self._purge_loop(), name="video-jobs-purge"),
        ]

    async def close(self) -> None:
        """Stop taking jobs, and give those running here back to the queue: another
        replica takes them at once, without counting an attempt lost."""
        for loop in self._loops:
            loop.cancel()
        running = dict(self._running)
        for task in running.values():
            task.cancel()
        await asyncio.gather(*self._loops, *running.values(), return_exceptions=True)
        for job_id in running:
            with contextlib.suppress(JobStoreError):
                await self.store.release(job_id, self.owner)
        await self.store.close()

    # -- the API ----------------------------------------------------------------------

    async def create(self, body: VideoAsk, input_bytes: list[bytes]) -> VideoJob:
        """A new queued job; RequestError naming the field if the body is bad, 429 past the
        pipeline's limit of active jobs."""
        model = self.model_name
        if self.adapters is not None and body.model is not None:
            # The job keeps the name the caller gave: its run picks the adapters by it.
            if self.adapters.pick(body.model):
                model = body.model
        elif body.model is not None and body.model != self.model_name:
            raise RequestError(
                404,
                f"model: {body.model!r} is not served here; this router serves "
                f"{self.model_name!r} (GET /v1/models)",
                param="model",
            )
        params = body.job_params(self.recipe, self.limits)
        reference = input_bytes[0] if input_bytes else None
        if reference is not None and not self.takes_image:
            raise RequestError(
                400,
                "input_reference: this pipeline makes videos from text alone (its model "
                "family's checkpoint has no image-to-video); send no input_reference",
                param=INPUT_REFERENCE.field,
            )
        if reference is None and self.requires_image:
            raise RequestError(
                400,
                "input_reference: required: this pipeline makes a clip from an image (its "
                "first frame) and a prompt; send the image as the input_reference file of a "
                "multipart/form-data body",
                param=INPUT_REFERENCE.field,
            )
        if self.sized_by_image and "height" in params:
            raise RequestError(
                400,
                f"size: this pipeline sizes its clip from the input image (the size bucket "
                f"nearest its aspect ratio, at its checkpoint's resolution); send no size, "
                f"or auto (got {body.size!r})",
                param="size",
            )
        if "height" in params and self.size_multiple is not None:
            await self._check_size(params["width"], params["height"])
        if reference is not None:
            # Refused now, not when the job runs: decoding takes milliseconds, off the loop.
            await asyncio.to_thread(
                decode_input_image, reference, self.limits, INPUT_REFERENCE.field
            )
        now = int(self.clock())
        frames, fps = params["num_frames"], params["fps"]
        size = f"{params['width']}x{params['height']}" if "height" in params else "auto"
        job = VideoJob(
            id=new_job_id(self.clock()),
            created_at=now,
            status="queued",
            model=model,
            prompt=body.prompt,
            size=size,
            seconds=f"{frames / fps:g}",
            params={**params, **({"user": body.user} if body.user else {})},
        )
        try:
            await self.store.create(
                job, max_active=self.config.max_active_jobs, input_bytes=reference
            )
        except QueueFullError:
            raise PipelineError(
                429,
                f"the pipeline has {self.config.max_active_jobs} video jobs queued or running, "
                "its limit (router.videos.maxActiveJobs); retry once some finish",
                kind="rate_limit_exceeded",
                retry_after=10.0,
            ) from None
        self._wake.set()
        return job

    async def _check_size(self, width: int, height: int) -> None:
        """A size the DiT cannot make is refused at creation, as OpenAI's API refuses one,
        not as a job that fails a moment later."""
        assert self.size_multiple is not None
        multiple = await self.size_multiple()
        if multiple is None or (width % multiple == 0 and height % multiple == 0):
            return
        near = "x".join(
            str(max(multiple, round(side / multiple) * multiple)) for side in (width, height)
        )
        raise RequestError(
            400,
            f"size: width and height must be multiples of {multiple} for this pipeline's "
            f"model, such as {near} (got {width}x{height})",
            param="size",
        )

    async def get(self, job_id: str) -> VideoJob:
        job = await self.store.get(job_id)
        if job is None:
            raise _no_such_job(job_id)
        return job

    async def page(self, after: str | None, limit: int | None, order: str | None) -> dict[str, Any]:
        """OpenAI's page of jobs: ``data``, ``first_id``, ``last_id``, ``has_more``."""
        size = DEFAULT_PAGE if limit is None else limit
        if not 1 <= size <= MAX_PAGE:
            raise RequestError(400, f"limit: 1 to {MAX_PAGE} (got {size})", param="limit")
        direction: Literal["asc", "desc"]
        if order in (None, "desc"):
            direction = "desc"
        elif order == "asc":
            direction = "asc"
        else:
            raise RequestError(400, f"order: asc or desc (got {order!r})", param="order")
        try:
            jobs, more = await self.store.list(after=after, limit=size, order=direction)
        except ValueError:
            raise RequestError(404, f"after: no video {after!r}", param="after") from None
        data = [video_object(job) for job in jobs]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }

    async def content(self, job_id: str) -> bytes:
        """The finished job's MP4; 404 for no such job, 409 while it is not finished."""
        job = await self.get(job_id)
        if job.status != "completed":
            raise PipelineError(
                409,
                f"video {job_id} is {job.status}: its content exists once it is completed",
                kind="invalid_request_error",
            )
        data = await self.store.get_content(job_id)
        if data is None:  # expired between the two reads
            raise _no_such_job(job_id)
        return data

    async def delete(self, job_id: str) -> dict[str, Any]:
        """Delete the job and its video; a job running here is aborted in every stage now,
        one running on another replica at that replica's next renewal."""
        task = self._running.get(job_id)
        if task is not None:
            task.cancel()
        if not await self.store.delete(job_id):
            raise _no_such_job(job_id)
        return {"id": job_id, "object": "video.deleted", "deleted": True}

    # -- running jobs -----------------------------------------------------------------

    async def _claim_loop(self) -> None:
        while True:
            job = None
            if len(self._running) < self.config.jobs_per_router and self._servable():
                try:
                    job = await self.store.claim(
                        self.owner,
                        now=self.clock(),
                        lease_s=LEASE_S,
                        max_attempts=MAX_ATTEMPTS,
                        lost_ttl_s=self.config.content_ttl_seconds,
                    )
                except JobStoreError as e:
                    logger.warning("video jobs: claiming failed: %s", e)
            if job is not None:
                self._running[job.id] = asyncio.create_task(
                    self._run(job), name=f"video-job-{job.id}"
                )
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_S)

    def _servable(self) -> bool:
        """Whether some pipeline revision has a live replica of every stage: a job taken
        before (a router just started, its replicas not yet connected) would fail at once."""
        try:
            self.orchestrator.choose_revision()
        except PipelineError:
            return False
        return True

    async def _purge_loop(self) -> None:
        while True:
            try:
                await self.store.purge_expired(int(self.clock()))
            except JobStoreError as e:
                logger.warning("video jobs: purging expired jobs failed: %s", e)
            await asyncio.sleep(PURGE_S)

    async def _run(self, job: VideoJob) -> None:
        me = asyncio.current_task()
        assert me is not None
        renewing = asyncio.create_task(self._renew(job.id, me))
        started = [False]
        try:
            await self._produce(job, started)
        except asyncio.CancelledError:
            raise  # deleted, taken, or this replica shuts down: nothing to record
        except RequestError as e:
            # Its adapter was unloaded (POST /v1/unload_lora_adapter) while it queued.
            await self._end(
                job.id,
                status="failed",
                error={"code": "invalid_request_error", "message": e.message},
            )
        except PipelineError as e:
            if e.status == 503 and not started[0]:
                # The stages went away before it began (a rollout, a lost replica): back
                # to the queue, at no cost to its attempts, for when they serve again.
                logger.warning("video job %s: %s; queued again", job.id, e.message)
                with contextlib.suppress(JobStoreError):
                    await self.store.release(job.id, self.owner)
                return
            await self._end(job.id, status="failed", error={"code": e.kind, "message": e.message})
        except Exception as e:
            logger.exception("video job %s failed", job.id)
            await self._end(
                job.id,
                status="failed",
                error={"code": "server_error", "message": f"the router failed the job: {e}"},
            )
        finally:
            renewing.cancel()
            self._running.pop(job.id, None)
            self._wake.set()

    async def _produce(self, job: VideoJob, started: list[bool]) -> None:
        params = dict(job.params)
        fps = float(params.pop("fps"))
        user = params.pop("user", None)
        images = []
        reference = await self.store.get_input(job.id)
        if reference is not None:
            images.append(
                await asyncio.to_thread(
                    decode_input_image, reference, self.limits, INPUT_REFERENCE.field
                )
            )
        request = PipelineRequest(
            # A run of its own: a retry's stage requests never meet the last run's. Not the
            # attempt alone: a run given back (its router stopping) keeps its attempt, and
            # its stage requests may still be aborting when another router starts it again
            # (the stages refuse a request id in flight).
            request_id=f"{job.id}-{job.attempts}-{secrets.token_hex(3)}",
            messages=[{"role": "user", "content": job.prompt}],
            diffusion_params={**params, "report_progress": True},
            images=images,
            sticky_key=user,
            adapters=self.adapters.pick(job.model) if self.adapters is not None else {},
        )
        frames = None
        written = 0.0
        outputs = self.orchestrator.run(request, timeout=self.config.job_timeout_seconds)
        try:
            async for output in outputs:
                started[0] = True
                if output.progress is not None and self.clock() - written >= PROGRESS_WRITE_S:
                    written = self.clock()
                    await self._write(job.id, progress=output.progress)
                if output.finished:
                    frames = output.images
        finally:
            await outputs.aclose()
        if frames is None:
            raise PipelineError(500, "the pipeline answered without frames", kind="server_error")
        video = await asyncio.to_thread(encode_mp4, frames, fps)
        await self.store.put_content(job.id, video)
        height, width = frames.shape[1:3]
        await self._end(job.id, status="completed", size=f"{width}x{height}", progress=100)

    async def _write(self, job_id: str, **changes: Any) -> None:
        if await self.store.update(job_id, owner=self.owner, **changes) is None:
            # Deleted, or taken by another replica (this one's lease lapsed): stop.
            raise asyncio.CancelledError

    async def _end(self, job_id: str, **changes: Any) -> None:
        now = int(self.clock())
        with contextlib.suppress(asyncio.CancelledError):
            await self._write(
                job_id,
                completed_at=now,
                expires_at=now + self.config.content_ttl_seconds,
                lease_until=None,
                **changes,
            )

    async def _renew(self, job_id: str, task: asyncio.Task[None]) -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            try:
                held = await self.store.renew(job_id, self.owner, self.clock() + LEASE_S)
            except JobStoreError as e:
                logger.warning("video job %s: renewing its lease failed: %s", job_id, e)
                continue
            if not held:
                logger.info("video job %s was deleted or taken over: aborting it", job_id)
                task.cancel()
                return


def _no_such_job(job_id: str) -> PipelineError:
    return PipelineError(404, f"no video {job_id!r} (GET /v1/videos lists them)")
