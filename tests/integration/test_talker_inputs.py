"""A talker's requests as its stage serves them: the stage server forwards the thinker's
hand-offs as handles, and the talker's engine core (StageLLMCoreProc, the tiny Qwen3-Omni's
talker on vLLM's CPU build) fetches the arrays itself and makes the request of them.

The thinker's arrays are put here, into a shared-memory connector that only the core is
told of (the stage server's connectors lack it): a stage server that fetched them would
fail every request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from omni_runtime.config import ConnectorConfig, PipelineConfig, load_pipeline
from omni_runtime.connectors import ConnectorError, ConnectorHandle, StageConnectors
from omni_runtime.connectors.shared_memory import SharedMemoryConnector
from omni_runtime.engine.stage.stage_core_types import (
    HandOff,
    StageErrorCode,
    StageServerOutput,
    StageServerRequest,
)
from omni_runtime.engine.stage.stage_llm_core_client import start_stage_llm_client
from omni_runtime.stage_server.llm_frontend import StageLLMFrontend
from omni_runtime.tiny_models import QWEN3_OMNI_SUBDIR

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]
ROOT = Path(__file__).resolve().parents[2]
# The thinker's connector, known to the talker's core alone.
THINKER_CONNECTOR = "thinker_shm"
OUTPUT_CONNECTOR = "shared_memory_connector"
DEADLINE_S = 120
FRAMES = 6


@pytest.fixture(scope="module", autouse=True)
def engine_environment(llm_engine_environment: None) -> None:
    """vLLM's CPU environment for this module's core (tests/conftest.py)."""


@pytest.fixture(scope="module")
def checkpoint(tiny_models: Path) -> Path:
    return tiny_models / QWEN3_OMNI_SUBDIR


@pytest.fixture(scope="module")
def pipeline(checkpoint: Path) -> PipelineConfig:
    loaded = load_pipeline(ROOT / "examples" / "tiny-qwen3-omni.yaml", model=str(checkpoint))
    talker = loaded.stages[1]
    talker.default_sampling_params = {**talker.default_sampling_params, "max_tokens": FRAMES}
    return loaded


@pytest.fixture(scope="module")
def frontend(pipeline: PipelineConfig, checkpoint: Path) -> Iterator[StageLLMFrontend]:
    talker = pipeline.stages[1]
    core_connectors = {
        **pipeline.connectors,
        THINKER_CONNECTOR: ConnectorConfig(name="SharedMemoryConnector"),
    }
    client = start_stage_llm_client(
        talker,
        str(checkpoint),
        speech=pipeline.speech_stage(talker),
        connectors=core_connectors,
    )
    connectors = StageConnectors(pipeline.connectors)
    try:
        yield StageLLMFrontend(pipeline, talker, client, connectors)
    finally:
        client.shutdown()
        connectors.close()


@pytest.fixture
def thinker() -> Iterator[SharedMemoryConnector]:
    """The thinker's side of the hand-off: its connector, in this process."""
    connector = SharedMemoryConnector(THINKER_CONNECTOR)
    yield connector
    connector.close()


@pytest.fixture(scope="module")
def hf_config(checkpoint: Path) -> Any:
    return AutoConfig.from_pretrained(checkpoint)


def thought(hf_config: Any, width: int | None = None) -> dict[str, torch.Tensor]:
    """What a thinker hands its talker for a short user turn: a row per prompt token and
    per answer token (random), and the prompt's ids."""
    start, user, assistant = (
        hf_config.im_start_token_id,
        hf_config.user_token_id,
        hf_config.assistant_token_id,
    )
    prompt = [start, user, 10, 11, 12, hf_config.im_end_token_id, start, assistant]
    hidden = hf_config.thinker_config.text_config.hidden_size
    rows = torch.randn(
        (len(prompt) + 4, width or 2 * hidden), generator=torch.Generator().manual_seed(0)
    )
    return {"thinker_rows": rows, "thinker_prompt": torch.tensor(prompt)}


def put(thinker: SharedMemoryConnector, request_id: str, arrays: dict[str, torch.Tensor]) -> Any:
    return {name: HandOff(thinker.put(f"{request_id}/{name}", a)) for name, a in arrays.items()}


def take(handle: ConnectorHandle) -> torch.Tensor:
    """What the talker's stage handed off, as code2wav fetches it (a copy of its own)."""
    consumer = SharedMemoryConnector(OUTPUT_CONNECTOR)
    try:
        return consumer.get(handle).clone()
    finally:
        consumer.close()


async def speak(
    frontend: StageLLMFrontend, request_id: str, inputs: dict[str, HandOff], **params: Any
) -> list[StageServerOutput]:
    """The request's outputs, to its last."""
    request = StageServerRequest(
        request_id=request_id,
        params=params,
        inputs=inputs,
        stream=False,
        output_connector=OUTPUT_CONNECTOR,
    )
    outputs = await frontend.add(request)
    async with asyncio.timeout(DEADLINE_S):
        while not (outputs and outputs[-1].finished):
            outputs += await frontend.next_outputs()
    return outputs


async def test_the_core_fetches_the_thinkers_arrays_and_the_talker_speaks(
    frontend: StageLLMFrontend, thinker: SharedMemoryConnector, hf_config: Any
) -> None:
    inputs = put(thinker, "spoken", thought(hf_config))
    (output,) = await speak(frontend, "spoken", inputs, voice="ethan")
    assert output.error is None, output.error
    assert output.finish_reason in ("stop", "length")
    codes = output.hand_offs["codes"].handle
    groups = hf_config.talker_config.num_code_groups
    assert codes.shape[1] == groups
    assert 1 <= codes.shape[0] <= FRAMES
    frames = take(codes)
    assert frames.dtype == torch.int64
    assert int(frames.max()) < hf_config.talker_config.text_config.vocab_size - 1024
    # The core took the thinker's arrays: the producer's copies are gone.
    for hand_off in inputs.values():
        with pytest.raises(ConnectorError):
            thinker.get(hand_off.handle)
    assert frontend.in_flight == 0


async def test_a_lost_hand_off_fails_the_request_naming_the_input(
    frontend: StageLLMFrontend, thinker: SharedMemoryConnector, hf_config: Any
) -> None:
    inputs = put(thinker, "lost", thought(hf_config))
    # Taken by another: for the talker, the thinker's rows are gone.
    thinker.get(inputs["thinker_rows"].handle)
    (output,) = await speak(frontend, "lost", inputs)
    assert output.error is not None
    assert output.error.code == StageErrorCode.STAGE_FAILED
    # Named, the router runs the request again from the thinker.
    assert output.error.param == "thinker_rows"
    assert output.finish_reason == "error"
    # What was still there is freed at once, not at the connector's expiry.
    with pytest.raises(ConnectorError):
        thinker.get(inputs["thinker_prompt"].handle)
    assert frontend.in_flight == 0


async def test_rows_the_talker_cannot_read_are_refused_saying_why(
    frontend: StageLLMFrontend, thinker: SharedMemoryConnector, hf_config: Any
) -> None:
    inputs = put(thinker, "narrow", thought(hf_config, width=8))
    (output,) = await speak(frontend, "narrow", inputs)
    assert output.error is not None
    assert output.error.code == StageErrorCode.STAGE_FAILED
    assert output.error.param is None  # no resend fixes a thinker of another model
    width = 2 * hf_config.thinker_config.text_config.hidden_size
    assert f"[tokens, {width}]" in output.error.message
    # And the engine goes on: the next request is spoken.
    (spoken,) = await speak(frontend, "after-narrow", put(thinker, "ok", thought(hf_config)))
    assert spoken.error is None
    assert "codes" in spoken.hand_offs
    take(spoken.hand_offs["codes"].handle)


async def test_an_unknown_voice_is_refused_by_the_stage_server(
    frontend: StageLLMFrontend, thinker: SharedMemoryConnector, hf_config: Any
) -> None:
    inputs = put(thinker, "mute", thought(hf_config))
    (output,) = await speak(frontend, "mute", inputs, voice="nobody")
    assert output.error is not None
    assert output.error.code == StageErrorCode.BAD_REQUEST
    assert output.error.param == "voice"
    assert "ethan" in output.error.message


async def test_an_abort_while_its_inputs_are_fetched_is_answered(
    frontend: StageLLMFrontend, thinker: SharedMemoryConnector, hf_config: Any
) -> None:
    inputs = put(thinker, "aborted", thought(hf_config))
    request = StageServerRequest(
        request_id="aborted", inputs=inputs, stream=False, output_connector=OUTPUT_CONNECTOR
    )
    outputs = await frontend.add(request)
    await frontend.abort(["aborted"])
    async with asyncio.timeout(DEADLINE_S):
        while not (outputs and outputs[-1].finished):
            outputs += await frontend.next_outputs()
    assert [o.finish_reason for o in outputs] == ["abort"]
    assert frontend.in_flight == 0
