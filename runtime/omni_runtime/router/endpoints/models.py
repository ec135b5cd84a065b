"""GET /v1/models: the one served model, and the LoRA adapters it serves as models of
their own (their ``parent`` the served model)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, Field

from omni_runtime.router.errors import error_responses
from omni_runtime.router.responses import JSONBody
from omni_runtime.router.serving import OpenAIServing

MODELS = "/v1/models"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="The model's path, or an adapter's source.")
    parent: str | None = Field(
        default=None, description="A LoRA adapter's: the served model it adapts."
    )
    stage: str | None = Field(default=None, description="A LoRA adapter's: the stage it runs on.")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


def routes(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.get(
        MODELS,
        summary="List the served model",
        operation_id="listModels",
        response_model=ModelList,
        response_description="The one model served.",
        responses=error_responses(401),
    )
    async def models() -> Response:
        return JSONBody(
            {
                "object": "list",
                "data": [
                    {
                        "id": serving.served_model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "omni-operator",
                        "root": serving.pipeline.model,
                    },
                    *serving.adapters.models(created=0),
                ],
            }
        )

    return router
