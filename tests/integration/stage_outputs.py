"""What the stage tests share: reading a stage client's outputs to its end."""

from __future__ import annotations

import asyncio
from typing import Any

from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase, StageCoreDeadError


async def outputs_until_dead(
    client: StageCoreClientBase, timeout: float = 10
) -> tuple[list[Any], StageCoreDeadError]:
    """Every output the client still delivers, and the error that ends them; TimeoutError
    if the stage has not died within ``timeout`` seconds."""
    outputs: list[Any] = []
    async with asyncio.timeout(timeout):
        while True:
            try:
                outputs.extend((await client.get_outputs_async()).outputs)  # type: ignore[attr-defined]
            except StageCoreDeadError as death:
                return outputs, death
