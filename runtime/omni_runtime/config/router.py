"""The router's settings: the HTTP front of a pipeline, and its Videos API jobs."""

from __future__ import annotations

import urllib.parse
from typing import Annotated, Literal

from pydantic import Field, StrictInt, field_validator

from .base import SchemaModel

RouterPolicy = Literal[
    "round-robin", "least-outstanding-requests", "least-outstanding-work", "sticky"
]

# Where a router finds the video store's password: never in the pipeline's config, which
# a ConfigMap holds.
VIDEO_STORE_PASSWORD_ENV = "OMNI_VIDEO_STORE_PASSWORD"


class VideoJobsConfig(SchemaModel):
    """The Videos API's jobs, for a pipeline whose DiT makes videos."""

    store_url: str | None = Field(
        default=None,
        description="redis:// or rediss:// URL of the Redis where the pipeline's router "
        "replicas share their jobs (the password comes from the router's environment, "
        f"{VIDEO_STORE_PASSWORD_ENV}, never the URL); unset: an embedded store (SQLite and "
        "files in the router's state directory) that one router replica uses alone.",
    )
    max_active_jobs: Annotated[StrictInt, Field(ge=1, le=1_000_000)] = Field(
        default=64,
        description="Jobs queued or running at once, over all router replicas; past it POST "
        "/v1/videos answers 429.",
    )
    jobs_per_router: Annotated[StrictInt, Field(ge=1, le=256)] = Field(
        default=2,
        description="Jobs one router replica runs at once; the rest wait, queued, for any replica.",
    )
    content_ttl_seconds: Annotated[StrictInt, Field(ge=60, le=30 * 86400)] = Field(
        default=3600,
        description="How long a finished job and its video are kept; then both are deleted.",
    )
    job_timeout_seconds: Annotated[StrictInt, Field(ge=10, le=86400)] = Field(
        default=3600, description="A job still running after this long fails (timeout)."
    )

    @field_validator("store_url")
    @classmethod
    def _check_store_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        url = urllib.parse.urlsplit(value)
        if url.scheme not in ("redis", "rediss") or not url.hostname:
            raise ValueError(
                f"{value!r} is not a Redis URL: use redis://HOST:PORT/DB or rediss://... (TLS)"
            )
        if url.password is not None:
            raise ValueError(
                "the URL holds a password, which would sit in the pipeline's ConfigMap; give "
                f"it to the router as {VIDEO_STORE_PASSWORD_ENV} instead"
            )
        return value


class RouterConfig(SchemaModel):
    """The HTTP router in front of the stages."""

    port: Annotated[StrictInt, Field(ge=1, le=65535)] = Field(
        default=8000, description="The HTTP port the router listens on."
    )
    policy: RouterPolicy = Field(
        default="round-robin",
        description="How a request picks a stage replica: round-robin, "
        "least-outstanding-requests, least-outstanding-work (a diffusion request weighs "
        "its steps x pixels x images, each replica its own costs per request and per unit), or "
        "sticky (requests with the same user field go to the same replica).",
    )
    served_model_name: str | None = Field(
        default=None,
        min_length=1,
        description="The model name clients send (GET /v1/models lists it); defaults to "
        "the last part of the pipeline's model path.",
    )
    videos: VideoJobsConfig | None = Field(
        default=None,
        description="The Videos API's jobs (a pipeline whose DiT makes videos): their store, "
        "limits and how long a video is kept; unset: the defaults.",
    )
    # None, not False, when unset: a pipeline that does not name it keeps its revision.
    metrics_need_api_key: bool | None = Field(
        default=None,
        description="When the router has API keys, whether GET /metrics needs one too; by "
        "default (unset or false) it stays open to Prometheus scrapers, like the probes "
        "(/health, /livez).",
    )

    @field_validator("policy", mode="before")
    @classmethod
    def _accept_underscores(cls, value: object) -> object:
        # The rest of the deploy YAML is snake_case, so round_robin is an easy slip.
        return value.replace("_", "-") if isinstance(value, str) else value
