"""What the HunyuanVideo-1.5 tests (text-to-video and image-to-video) share: the
pipeline's own embeddings, the encoder stage run in this process and its hand-off, the DiT
stage's answer, and both stages as processes of their own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from serving import StageProcess, start_stage_processes

from omni_runtime.config import PipelineConfig, load_pipeline
from omni_runtime.connectors import StageConnectors
from omni_runtime.engine.stage.stage_core_types import (
    StageDiffusionCoreOutput,
    StageServerOutput,
    StageServerRequest,
)
from omni_runtime.engine.stage.stage_llm_core_client import start_stage_llm_client
from omni_runtime.families import Family
from omni_runtime.stage_server.llm_frontend import StageLLMFrontend

ENCODER, DIT = 0, 1
DEADLINE_S = 120

Encoder = tuple[StageLLMFrontend, StageConnectors]


def reference_embeds(pipe: Any, prompt: str) -> torch.Tensor:
    """The pipeline's own Qwen embeddings of ``prompt``, the rows its mask keeps (right
    padding: a prefix): transformers' hidden_states[-3], template rows cropped."""
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(prompt, dtype=torch.float32)
    kept = int(mask.sum())
    assert bool(mask[0, :kept].all())
    return embeds[0, :kept]


@contextmanager
def encoder_stage(data: dict[str, Any], family: Family) -> Iterator[Encoder]:
    """The pipeline's encoder stage in this process, as a stage server runs it."""
    pipeline: PipelineConfig = load_pipeline(data)
    stage = pipeline.stages[ENCODER]
    assert pipeline.encoder_recipe(stage) is family.encoder
    client = start_stage_llm_client(
        stage, pipeline.model, encoder=family.encoder, startup_timeout=240
    )
    connectors = StageConnectors(pipeline.connectors)
    frontend = StageLLMFrontend(pipeline, stage, client, connectors)
    try:
        yield frontend, connectors
    finally:
        client.shutdown()
        connectors.close()


async def encoded(encoder: Encoder, request_id: str, prompt: str) -> torch.Tensor:
    """The encoder stage's hand-off of ``prompt`` (vLLM's hidden_states[-3], cropped)."""
    frontend, connectors = encoder
    refused = await frontend.add(
        StageServerRequest(
            request_id=request_id, prompt=prompt, output_connector="shared_memory_connector"
        )
    )
    assert refused == []
    outputs: list[StageServerOutput] = []
    async with asyncio.timeout(DEADLINE_S):
        while not (outputs and outputs[-1].finished):
            outputs.extend(await frontend.next_outputs())
    (final,) = outputs
    assert final.error is None, final.error
    assert set(final.hand_offs) == {"prompt_embeds"}
    handle = final.hand_offs["prompt_embeds"].handle
    tensor: torch.Tensor = connectors.get(handle.connector).get(handle, "cpu").clone()
    return tensor


def frames_of(output: StageDiffusionCoreOutput) -> np.ndarray:
    assert output.error is None, output.error
    assert output.images is not None
    return output.images


@contextmanager
def stage_processes(data: dict[str, Any], workdir: Path) -> Iterator[list[StageProcess]]:
    """Both stages of pipeline ``data`` as processes of their own; each exits cleanly."""
    path = workdir / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data))
    procs = start_stage_processes(path, [ENCODER, DIT], workdir)
    try:
        yield procs
    finally:
        for proc in procs:
            proc.stop()
    for proc in procs:
        assert proc.proc.returncode == 0, proc.log.read_text()[-2000:]
