"""What each stage of a route gets follows from the edge into it, not from its name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from omni_runtime.config.loader import load_pipeline
from omni_runtime.connectors import ConnectorHandle
from omni_runtime.engine.stage.stage_core_types import HandOff, StageServerOutput
from omni_runtime.families.graph import GraphEdge
from omni_runtime.router.stage_requests import (
    PipelineRequest,
    build_stage_request,
    companions,
    prompt_text,
)

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"


def handed(name: str) -> StageServerOutput:
    handle = ConnectorHandle(connector="shm", key="k", dtype="float32", shape=[1], nbytes=4)
    return StageServerOutput(request_id="r", finished=True, hand_offs={name: HandOff(handle)})


def caller(**fields: object) -> PipelineRequest:
    return PipelineRequest(
        request_id="r",
        messages=[{"role": "user", "content": "hello"}],
        llm_params={"max_tokens": 5},
        **fields,  # type: ignore[arg-type]
    )


def test_a_speaking_route_feeds_each_stage_by_its_edge() -> None:
    pipeline = load_pipeline(EXAMPLES / "tiny-qwen3-omni.yaml")
    thinker, talker, code2wav = sorted(pipeline.stages, key=lambda s: s.stage_id)
    audio = [np.zeros(16, np.float32)]
    request = caller(audios=audio, answer="audio", stage_params={"voice": "chelsie"}, stream=True)
    first = build_stage_request(
        pipeline, request, 0, thinker, None, None, "", reads_media=True, streams=True
    )
    assert first.messages == request.messages
    assert first.audios == audio
    assert first.params == {"max_tokens": 5}
    assert first.stream
    # The hand-off's consumer gets the inputs and the caller's params its graph gives it,
    # not the caller's sampling params, which are for the text the first stage writes.
    rows = handed("thinker_rows")
    second = build_stage_request(
        pipeline,
        request,
        1,
        talker,
        GraphEdge(0, 1, "hand_off"),
        rows,
        "hi",
        caller_params=("voice",),
    )
    assert second.inputs == rows.hand_offs
    assert second.params == {"voice": "chelsie"}
    assert second.prompt is None
    assert second.messages is None
    assert not second.stream
    # A retry's ids differ from the first attempt's.
    assert second.request_id == "r-1"
    third = build_stage_request(
        pipeline, request, 0, code2wav, GraphEdge(1, 2, "stream"), handed("codes"), ""
    )
    assert set(third.inputs) == {"codes"}
    assert third.params == {}


def test_a_dit_fed_by_hand_off_gets_the_prompt_text_and_its_params() -> None:
    pipeline = load_pipeline(EXAMPLES / "tiny-qwen-image.yaml")
    encoder, dit = sorted(pipeline.stages, key=lambda s: s.stage_id)
    request = PipelineRequest(
        request_id="r", prompt="a cat", diffusion_params={"true_cfg_scale": 4.0}
    )
    first = build_stage_request(pipeline, request, 0, encoder, None, None, "")
    assert first.prompt == "a cat"
    assert first.messages is None
    embeds = handed("prompt_embeds")
    second = build_stage_request(pipeline, request, 0, dit, GraphEdge(0, 1, "hand_off"), embeds, "")
    assert second.prompt == "a cat"
    assert second.inputs == embeds.hand_offs
    assert second.params == {"true_cfg_scale": 4.0}
    # Guidance above 1 with a negative prompt needs its embeddings beside the prompt's.
    negative = PipelineRequest(
        request_id="r",
        prompt="a cat",
        diffusion_params={"true_cfg_scale": 4.0, "negative_prompt": "blur"},
    )
    (companion,) = companions(pipeline, negative, encoder, "a cat")
    assert companion.prompt == "blur"
    assert companion.names == {"prompt_embeds": "negative_prompt_embeds"}
    assert companions(pipeline, request, dit, "a cat") == []


def test_an_llm_that_writes_the_dits_prompt_leaves_the_callers_image_to_the_dit() -> None:
    pipeline = load_pipeline(EXAMPLES / "tiny-text-to-image.yaml")
    llm, dit = sorted(pipeline.stages, key=lambda s: s.stage_id)
    image = [np.zeros((8, 8, 3), np.uint8)]
    request = caller(images=image)
    assert build_stage_request(pipeline, request, 0, llm, None, None, "").images == []
    edge = GraphEdge(0, 1, "hand_off")
    assert build_stage_request(pipeline, request, 0, dit, edge, None, "").images == image


def test_a_text_edge_makes_the_producers_text_the_prompt() -> None:
    pipeline = load_pipeline(EXAMPLES / "tiny-text-to-image.yaml")
    _, dit = sorted(pipeline.stages, key=lambda s: s.stage_id)
    request = caller(diffusion_params={"num_inference_steps": 2})
    drawn = build_stage_request(
        pipeline, request, 0, dit, GraphEdge(0, 1, "text"), None, "a red square"
    )
    assert drawn.prompt == "a red square"
    assert drawn.inputs == {}
    assert drawn.params == {"num_inference_steps": 2}


def test_the_prompt_text_is_the_prompt_or_the_last_user_message() -> None:
    assert prompt_text(PipelineRequest("r", prompt="p")) == "p"
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "last"},
    ]
    assert prompt_text(PipelineRequest("r", messages=messages)) == "last"
    # Parts (text and audio) are not a DiT's prompt.
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert prompt_text(PipelineRequest("r", messages=parts)) == ""


async def test_an_answer_the_graph_has_no_route_for_is_refused_before_any_stage() -> None:
    from omni_runtime.router.orchestrator import PipelineError, PipelineOrchestrator

    pipeline = load_pipeline(EXAMPLES / "tiny-qwen3-omni.yaml")
    alone = pipeline.model_copy(update={"stages": pipeline.stages[:1]})
    # No pool at all: a refusal that asked a replica first would fail another way.
    orchestrator = PipelineOrchestrator(alone, {})
    with pytest.raises(PipelineError) as refused:
        await orchestrator.complete(caller(answer="audio"))
    assert refused.value.status == 400
    assert refused.value.message == "this pipeline answers with text, not audio"
