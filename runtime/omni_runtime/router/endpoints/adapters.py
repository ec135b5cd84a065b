"""vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters added
and removed at run time (behind the API key, as all of /v1), where a stage takes adapters.
What the router serves of them is ``router.adapters``' catalog."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import Field

from omni_runtime.router.adapters import CatalogEntry
from omni_runtime.router.body import Body, Integer, Number
from omni_runtime.router.errors import RequestError, error_responses
from omni_runtime.router.json_body import parse_body, read_json
from omni_runtime.router.orchestrator import PipelineError
from omni_runtime.router.route_docs import json_request
from omni_runtime.router.serving import OpenAIServing
from omni_runtime.router.stage_replica_pool import NoLiveReplicaError

LOAD = "/v1/load_lora_adapter"
# A load reads the adapter's files, and may fetch them from the hub first.
_ADAPTER_LOAD_TIMEOUT_S = 300.0
UNLOAD = "/v1/unload_lora_adapter"

logger = logging.getLogger(__name__)


class LoadLoraAdapterRequest(Body):
    """POST /v1/load_lora_adapter (vLLM's): serve an adapter from now on, by name."""

    lora_name: str = Field(min_length=1, max_length=64, description="What requests name it by.")
    lora_path: str = Field(
        min_length=1,
        max_length=1024,
        description="Where its files are: an absolute path in the stage's pod, a hub id, or "
        "(a diffusion stage's) an https:// URL of one .safetensors file.",
    )
    stage: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        description="The stage it is for; unset: the one stage that takes adapters.",
    )
    scale: Annotated[Number, Field(ge=-8, le=8)] | None = Field(
        default=None, description="A diffusion stage's: how strongly it applies (unset: 1)."
    )


class UnloadLoraAdapterRequest(Body):
    """POST /v1/unload_lora_adapter (vLLM's): stop serving an adapter added at run time."""

    lora_name: str = Field(min_length=1, max_length=64)
    # vLLM's request carries it; names are what identify adapters here.
    lora_int_id: Integer | None = None


def routes(serving: OpenAIServing) -> APIRouter:
    """The adapter routes, where a stage of the pipeline takes adapters (none otherwise)."""
    router = APIRouter()
    if not serving.adapters.takes_adapters:
        return router
    done: dict[int | str, dict[str, Any]] = {
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}}
    }

    @router.post(
        LOAD,
        summary="Serve a LoRA adapter from now on (vLLM's API): a replica of its stage loads "
        "it at once, and one that cannot load is refused; the others load it on first use. "
        "In this router's memory only: declare a cluster's adapters in the pipeline "
        "(spec.adapters).",
        operation_id="loadLoraAdapter",
        response_class=PlainTextResponse,
        response_description="Done.",
        responses={**done, **error_responses(400, 401, 404, 413, 415, 503, 504)},
        openapi_extra=json_request("LoadLoraAdapterRequest"),
    )
    async def load_lora_adapter(request: Request) -> Response:
        """A replica of the adapter's stage loads it now, and one it cannot load is refused
        (a 400 naming the file, as vLLM's endpoint refuses it); it is served from then on,
        and each other replica loads it on its first request."""
        body = parse_body(LoadLoraAdapterRequest, await read_json(request, serving.limits))
        scale = 1.0 if body.scale is None else float(body.scale)
        entry = serving.adapters.entry(body.lora_name, body.lora_path, body.stage, scale)
        await _load_on_a_replica(serving, entry)
        serving.adapters.insert(entry)
        logger.info(
            "adapter %r of stage %r added from %s", body.lora_name, entry.stage.name, body.lora_path
        )
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post(
        UNLOAD,
        summary="Stop serving a LoRA adapter added at run time (vLLM's API).",
        operation_id="unloadLoraAdapter",
        response_class=PlainTextResponse,
        response_description="Done.",
        responses={**done, **error_responses(400, 401, 404, 413, 415)},
        openapi_extra=json_request("UnloadLoraAdapterRequest"),
    )
    async def unload_lora_adapter(request: Request) -> Response:
        """For an adapter added at run time: requests naming it are refused from now on;
        replicas drop it as their caches need the room."""
        body = parse_body(UnloadLoraAdapterRequest, await read_json(request, serving.limits))
        serving.adapters.remove(body.lora_name)
        logger.info("adapter %r removed", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router


async def _load_on_a_replica(serving: OpenAIServing, entry: CatalogEntry) -> None:
    """Have a replica of ``entry``'s stage load it; RequestError (400) naming the file if
    it cannot, PipelineError if no replica can say (none is up, or it took too long)."""
    adapter = entry.adapter
    pool = serving.pools[entry.stage.stage_id]
    try:
        answer: dict[str, Any] = await pool.call_utility(
            "load_adapter",
            {"name": adapter.name, "source": adapter.source, "scale": adapter.scale},
            timeout=_ADAPTER_LOAD_TIMEOUT_S,
        )
    except NoLiveReplicaError as e:
        raise PipelineError(
            503,
            f"no replica of stage {entry.stage.name!r} is up to load the adapter on: {e}",
            kind="service_unavailable",
            retry_after=5.0,
        ) from None
    except TimeoutError:
        raise PipelineError(
            504,
            f"lora_path: the adapter did not load within {_ADAPTER_LOAD_TIMEOUT_S:g} s",
            kind="timeout",
        ) from None
    if "error" in answer:
        raise RequestError(400, f"lora_path: {answer['error']}", "lora_path")
