"""Run a batch of diffusion requests through any diffusion stage client and collect them."""

from __future__ import annotations

import asyncio

from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase
from omni_runtime.engine.stage.stage_core_types import (
    StageDiffusionCoreOutput,
    StageDiffusionCoreOutputs,
    StageDiffusionCoreRequest,
)


async def generate(
    client: StageCoreClientBase,
    requests: list[StageDiffusionCoreRequest],
    timeout: float | None = None,
) -> dict[str, StageDiffusionCoreOutput]:
    """Send every request at once and wait for all their final outputs, by request id.

    The client must be this caller's alone: outputs for other requests are not expected.
    Raises StageCoreDeadError if the stage dies, TimeoutError after ``timeout`` seconds.
    """
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    for request in requests:
        await client.add_request_async(request)
    results: dict[str, StageDiffusionCoreOutput] = {}
    async with asyncio.timeout(timeout):
        while len(results) < len(requests):
            outputs = await client.get_outputs_async()
            assert isinstance(outputs, StageDiffusionCoreOutputs)
            for output in outputs.outputs:
                if output.final:  # not a partial image or progress: the request goes on
                    results[output.request_id] = output
    return results
