"""OpenAI's Videos API: POST /v1/videos (a job: multipart/form-data or JSON: prompt,
seconds, size, input_reference, ...), GET /v1/videos[/{id}[/content]] and DELETE
/v1/videos/{id}, for pipelines whose DiT makes videos. The jobs themselves, their store and
their runs are ``router.video_jobs``'."""

from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from omni_runtime.config import VIDEO_STORE_PASSWORD_ENV, VideoJobsConfig
from omni_runtime.families.base import VideoRecipe
from omni_runtime.router.body import Body, NonNegativeFloat, Positive, Seed, given
from omni_runtime.router.errors import RequestError, error_responses
from omni_runtime.router.job_store import open_job_store
from omni_runtime.router.json_body import parse_body, read_json
from omni_runtime.router.limits import RouterLimits, check_common, parse_size
from omni_runtime.router.multipart import INPUT_REFERENCE, read_form
from omni_runtime.router.orchestrator import PipelineError
from omni_runtime.router.responses import JSONBody
from omni_runtime.router.route_docs import request_body
from omni_runtime.router.served import VIDEOS
from omni_runtime.router.serving import OpenAIServing
from omni_runtime.router.video_jobs import VideoJobs, video_object
from omni_runtime.videos import frames_for

# Where an embedded video store keeps its jobs (a pipeline's own directory below it) when
# the router is given none: it outlives the router, so a restart loses no job.
DEFAULT_STATE_DIR = Path("~/.cache/omni-runtime/videos")
# A describe() call (asked only of replicas that do not report their size multiple) is
# milliseconds of an idle DiT's time; a DiT busy with a clip answers it only once the clip
# ends: a creation waits no longer than this for it (the job is then queued, and the stage
# checks its size when it runs).
_DESCRIBE_TIMEOUT_S = 2.0


DEFAULT_VIDEO_SECONDS = 4


class VideoCreateRequest(Body):
    """POST /v1/videos: OpenAI's fields (``input_reference``, an image file, travels beside
    as bytes) and the video DiT's own, spelled as the image endpoints spell them."""

    prompt: str = Field(min_length=1)
    model: str | None = None
    # OpenAI's clients send "4", "8" or "12"; any length in seconds is taken here.
    seconds: str | None = None
    size: str | None = None
    num_inference_steps: Positive | None = None
    seed: Seed | None = None
    guidance_scale: NonNegativeFloat | None = None
    negative_prompt: str | None = None
    # The clip's frames, instead of those ``seconds`` asks for; and its frame rate.
    num_frames: Positive | None = None
    fps: Positive | None = None
    user: str | None = None

    def job_params(self, recipe: VideoRecipe, limits: RouterLimits) -> dict[str, Any]:
        """The diffusion params of this clip (frames from ``seconds`` at the family's fps,
        or ``num_frames``) and its ``fps``; RequestError naming the field over a limit."""
        check_common(limits, len(self.prompt), 1, self.num_inference_steps, "prompt")
        height, width = parse_size(self.size, limits)
        fps = self.fps or recipe.fps
        # Checked even where num_frames wins over it: a bad field is refused, not ignored.
        seconds = _seconds(self.seconds)
        frames = self.num_frames
        if frames is None:
            frames = frames_for(seconds, fps, recipe.frame_step)
        if frames > limits.max_video_frames:
            field = "num_frames" if self.num_frames is not None else "seconds"
            raise RequestError(
                400,
                f"{field}: at most {limits.max_video_frames} frames a clip "
                f"({limits.max_video_frames / fps:.1f} s at {fps} fps); this asks for {frames}",
                param=field,
            )
        if (frames - 1) % recipe.frame_step:
            raise RequestError(
                400,
                f"num_frames: 1 + a multiple of {recipe.frame_step} (the VAE's "
                f"compression), such as {frames_for(frames / fps, fps, recipe.frame_step)}; "
                f"got {frames}",
                param="num_frames",
            )
        return given(
            height=height,
            width=width,
            num_frames=frames,
            fps=fps,
            num_inference_steps=self.num_inference_steps,
            seed=self.seed,
            guidance_scale=self.guidance_scale,
            negative_prompt=self.negative_prompt,
        )


def _seconds(value: str | None) -> float:
    if value is None:
        return float(DEFAULT_VIDEO_SECONDS)
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not (seconds > 0 and seconds != float("inf")):
        raise RequestError(
            400, f"seconds: a positive number of seconds, such as 4 (got {value!r})", "seconds"
        )
    return seconds


# -- answers (built as plain dicts by router.video_jobs; these document them) ----------------


class VideoError(BaseModel):
    code: str
    message: str


class Video(BaseModel):
    """A video job (OpenAI's Video object)."""

    id: str
    object: Literal["video"]
    created_at: int
    completed_at: int | None = Field(description="When it ended (completed or failed).")
    expires_at: int | None = Field(description="When it and its clip are deleted.")
    error: VideoError | None = Field(description="Why it failed (failed only).")
    model: str
    progress: int = Field(ge=0, le=100, description="Percent of its denoising steps done.")
    prompt: str
    remixed_from_video_id: None
    seconds: str = Field(description="The clip's length: frames / fps.")
    size: str = Field(description="WIDTHxHEIGHT, or auto until done where none was asked.")
    status: Literal["queued", "in_progress", "completed", "failed"]


class VideoList(BaseModel):
    object: Literal["list"]
    data: list[Video]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"]
    deleted: Literal[True]


# -- serving ---------------------------------------------------------------------------------


class VideosRoom:
    """The Videos API of one router: its jobs (opened by ``start``, where the pipeline makes
    videos) and its routes."""

    def __init__(self, serving: OpenAIServing, state_dir: Path | None = None) -> None:
        self.serving = serving
        self.state_dir = state_dir
        self.jobs: VideoJobs | None = None

    def start(self) -> None:
        """Open the job store and start taking jobs, where the pipeline makes videos."""
        serving = self.serving
        recipe = serving.pipeline.video_recipe
        if recipe is None:
            return
        family = serving.pipeline.family_recipe
        config = serving.pipeline.router.videos or VideoJobsConfig()
        name = serving.served_model_name
        store = open_job_store(
            config.store_url,
            (self.state_dir or DEFAULT_STATE_DIR / name).expanduser(),
            prefix=f"omni-videos:{name}",
            password=os.environ.get(VIDEO_STORE_PASSWORD_ENV),
        )
        self.jobs = VideoJobs(
            store,
            serving.orchestrator,
            config,
            recipe,
            model_name=name,
            limits=serving.limits,
            takes_image=serving.served.takes_image,
            requires_image=serving.served.requires_image,
            sized_by_image=family is not None and family.dit.sized_by_image,
            adapters=serving.adapters if serving.adapters.takes_adapters else None,
            size_multiple=self._size_multiple(),
        )
        self.jobs.start()

    async def close(self) -> None:
        if self.jobs is not None:
            await self.jobs.close()

    def _size_multiple(self) -> Callable[[], Awaitable[int | None]]:
        """What the DiT's sizes must be multiples of (its loaded pipeline's: the VAE's scale
        times the patch, which no config states), for a creation to refuse a size the DiT
        cannot make, as OpenAI's API does, rather than queue a job that fails when it runs.

        Where the replicas say it in their reports (StageLoad.size_multiple), the router
        knows it as soon as one is connected, busy or not. Replicas that predate the field
        say nothing: then, as before it, a describe() answer (which a DiT busy with a clip
        gives only when the clip ends), held for the router's life once one comes. With no
        replica connected yet (a router up before its DiTs), None: the job is taken and
        queued, as it would wait for a replica anyway, and the stage checks its size when
        it runs (the job fails naming it); refusing it would fail every creation that races
        a rollout or a cold start."""
        orchestrator = self.serving.orchestrator
        # The stage that makes the clip.
        pool = orchestrator.pools[orchestrator.answer_stage.stage_id]
        described: list[int] = []

        async def size_multiple() -> int | None:
            advertised = pool.size_multiples()
            if advertised:
                # A job may run on any replica (in a rollout to another checkpoint they may
                # differ): a size must suit them all.
                return math.lcm(*advertised)
            if not described:
                try:
                    info = await pool.call_utility("describe", {}, timeout=_DESCRIBE_TIMEOUT_S)
                except (RuntimeError, TimeoutError):
                    return None  # no replica answers now: the stage checks when it runs
                multiple = info.get("size_multiple") if isinstance(info, dict) else None
                if not isinstance(multiple, int) or multiple < 1:
                    return None
                described.append(multiple)
            return described[0]

        return size_multiple

    def _jobs(self) -> VideoJobs:
        self.serving.served.require(VIDEOS)
        if self.jobs is None:
            raise PipelineError(
                503, "the Videos API is not started yet", kind="service_unavailable"
            )
        return self.jobs

    def routes(self) -> APIRouter:
        router = APIRouter()
        served = self.serving.served
        limits = self.serving.limits
        documented = served.serves(VIDEOS)
        job = {"name": "video_id", "in": "path", "required": True, "schema": {"type": "string"}}
        # Every clip of an image-to-video pipeline needs its input_reference file, which a
        # JSON body cannot carry.
        bodies = {"multipart/form-data": "VideoCreateForm"}
        if not served.requires_image:
            bodies["application/json"] = "VideoCreateRequest"

        @router.post(
            VIDEOS,
            summary="Create a video job",
            operation_id="createVideo",
            response_model=Video,
            response_description="The job, queued.",
            responses=error_responses(400, 401, 404, 413, 415, 429, 500, 503),
            openapi_extra=request_body(bodies),
            include_in_schema=documented,
        )
        async def create_video(request: Request) -> Response:
            jobs = self._jobs()
            content_type = request.headers.get("content-type", "")
            files: list[bytes] = []
            if content_type.split(";")[0].strip().lower() == "application/json":
                body = parse_body(VideoCreateRequest, await read_json(request, limits))
            else:
                form = await read_form(request, limits, VideoCreateRequest, INPUT_REFERENCE)
                body, files = form.finish()
            return JSONBody(video_object(await jobs.create(body, files)))

        @router.get(
            VIDEOS,
            summary="List video jobs",
            operation_id="listVideos",
            response_model=VideoList,
            response_description="A page of jobs.",
            responses=error_responses(400, 401, 404, 500, 503),
            openapi_extra={
                "parameters": [
                    {"name": "after", "in": "query", "schema": {"type": "string"}},
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 1, "maximum": 100},
                    },
                    {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
                ]
            },
            include_in_schema=documented,
        )
        async def list_videos(request: Request) -> Response:
            query = request.query_params
            limit = query.get("limit")
            if limit is not None and not limit.isdigit():
                raise RequestError(400, f"limit: an integer, 1 to 100 (got {limit!r})", "limit")
            page = await self._jobs().page(
                query.get("after"), None if limit is None else int(limit), query.get("order")
            )
            return JSONBody(page)

        # The path's parameters are read from the request, not declared to FastAPI, so that
        # it neither validates them (a 422 no client of this API expects) nor documents one.
        @router.get(
            VIDEOS + "/{video_id}",
            summary="Retrieve a video job",
            operation_id="retrieveVideo",
            response_model=Video,
            response_description="The job.",
            responses=error_responses(401, 404, 500, 503),
            openapi_extra={"parameters": [job]},
            include_in_schema=documented,
        )
        async def retrieve_video(request: Request) -> Response:
            video_id = request.path_params["video_id"]
            return JSONBody(video_object(await self._jobs().get(video_id)))

        @router.delete(
            VIDEOS + "/{video_id}",
            summary="Delete a video job (aborting it if it runs) and its clip",
            operation_id="deleteVideo",
            response_model=VideoDeleted,
            response_description="Deleted.",
            responses=error_responses(401, 404, 500, 503),
            openapi_extra={"parameters": [job]},
            include_in_schema=documented,
        )
        async def delete_video(request: Request) -> Response:
            return JSONBody(await self._jobs().delete(request.path_params["video_id"]))

        @router.get(
            VIDEOS + "/{video_id}/content",
            summary="Download a completed job's clip (MP4, H.264)",
            operation_id="downloadVideoContent",
            response_class=Response,
            response_description="The clip.",
            responses={
                200: {"content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}},
                **error_responses(400, 401, 404, 409, 500, 503),
            },
            openapi_extra={
                "parameters": [
                    job,
                    {"name": "variant", "in": "query", "schema": {"enum": ["video"]}},
                ]
            },
            include_in_schema=documented,
        )
        async def download_video_content(request: Request) -> Response:
            variant = request.query_params.get("variant", "video")
            if variant != "video":
                raise RequestError(
                    400, f"variant: only 'video' is made here (got {variant!r})", param="variant"
                )
            data = await self._jobs().content(request.path_params["video_id"])
            return Response(data, media_type="video/mp4")

        return router
