"""The probes and the metrics: GET /health (readiness: some pipeline revision has a live
replica of every stage), /livez (the process serves) and /metrics (Prometheus)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from omni_runtime.router.responses import JSONBody
from omni_runtime.router.serving import OpenAIServing


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    live_replicas: dict[str, int] = Field(description="Live replicas of each stage, by name.")
    revision: str | None = Field(
        default=None, description="The pipeline revision new requests run on (200 only)."
    )
    error: str | None = Field(default=None, description="Why nothing can be served (503 only).")


class Liveness(BaseModel):
    status: Literal["ok"]


def routes(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.get(
        "/health",
        summary="Readiness",
        operation_id="health",
        response_model=Health,
        response_description="Some pipeline revision has a live replica of every stage.",
        responses={503: {"model": Health, "description": "Nothing can be served; says why."}},
    )
    async def health() -> Response:
        return serving.health()

    @router.get(
        "/livez",
        summary="Liveness",
        operation_id="livez",
        response_model=Liveness,
        response_description="The process serves.",
    )
    async def livez() -> Response:
        return JSONBody({"status": "ok"})

    @router.get(
        "/metrics",
        summary="Prometheus metrics",
        operation_id="metrics",
        response_class=PlainTextResponse,
        response_description="Prometheus' text exposition format.",
    )
    async def prometheus() -> Response:
        return Response(generate_latest(serving.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router
