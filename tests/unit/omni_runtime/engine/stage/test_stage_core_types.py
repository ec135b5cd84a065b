"""Stage wire types: the seed's inheritance, and lossless, pickle-free round trips."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest

from omni_runtime.engine.stage.stage_core_types import (
    StageCoreOutput,
    StageCoreOutputs,
    StageCoreRequest,
    StageDiffusionCoreOutput,
    StageDiffusionCoreOutputs,
    StageDiffusionCoreRequest,
    StageError,
    StageErrorCode,
    StageLLMCoreOutput,
    StageLLMCoreOutputs,
    StageLLMCoreRequest,
    StageServerOutput,
    StageServerOutputs,
    StageUtilityCall,
    StageUtilityOutput,
)
from omni_runtime.wire import INLINE_LIMIT, WireDecoder, WireEncoder, WireError

TOO_BIG = StageError.bad_request("params.height: too big", "height")


def round_trip(obj: object, type_: object) -> object:
    frames = WireEncoder().encode(obj)
    # What a peer receives is bytes, not our in-memory buffers.
    return WireDecoder(type_).decode([bytes(f) for f in frames])


@pytest.mark.parametrize(
    ("cls", "parents"),
    [
        (StageLLMCoreRequest, (EngineCoreRequest, StageCoreRequest)),
        (StageLLMCoreOutput, (EngineCoreOutput, StageCoreOutput)),
        (StageLLMCoreOutputs, (EngineCoreOutputs, StageCoreOutputs)),
        (StageDiffusionCoreRequest, (StageCoreRequest,)),
        (StageDiffusionCoreOutput, (StageCoreOutput,)),
        (StageDiffusionCoreOutputs, (StageCoreOutputs,)),
    ],
)
def test_inheritance_is_the_seeds(cls: type, parents: tuple[type, ...]) -> None:
    assert cls.__bases__ == parents
    assert all(issubclass(cls, msgspec.Struct) for cls in parents)


def test_markers_have_no_fields() -> None:
    for marker in (StageCoreRequest, StageCoreOutput, StageCoreOutputs):
        assert marker.__struct_fields__ == ()


def test_llm_request_round_trips_and_is_both_kinds() -> None:
    request = StageLLMCoreRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        mm_features=None,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=4),
        pooling_params=None,
        arrival_time=1.5,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        prompt_embeds=torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    )
    decoded = round_trip(request, StageLLMCoreRequest)
    assert isinstance(decoded, EngineCoreRequest)
    assert isinstance(decoded, StageCoreRequest)
    assert decoded.prompt_token_ids == [1, 2, 3]
    assert decoded.sampling_params is not None
    assert decoded.sampling_params.max_tokens == 4
    assert decoded.prompt_embeds is not None
    assert decoded.prompt_embeds.dtype == torch.bfloat16
    assert torch.equal(decoded.prompt_embeds, request.prompt_embeds)


def test_llm_outputs_round_trip_with_pooling_tensor() -> None:
    hidden = torch.randn(7, 128)
    outputs = StageLLMCoreOutputs(
        outputs=[StageLLMCoreOutput(request_id="r1", new_token_ids=[5], pooling_output=hidden)]
    )
    decoded = round_trip(outputs, StageLLMCoreOutputs)
    assert isinstance(decoded, StageCoreOutputs)
    (output,) = decoded.outputs
    assert isinstance(output, StageLLMCoreOutput)
    assert output.new_token_ids == [5]
    assert torch.equal(output.pooling_output, hidden)


def test_diffusion_types_round_trip_with_arrays_as_frames() -> None:
    image = np.random.default_rng(0).integers(0, 256, size=(64, 48, 3), dtype=np.uint8)
    embeds = np.random.default_rng(1).standard_normal((5, 128)).astype(np.float32)
    request = StageDiffusionCoreRequest(
        request_id="d1",
        prompt="cat",
        params={"height": 64, "seed": 3},
        images=[image, image[:32]],
        prompt_embeds=embeds,
    )
    frames = WireEncoder().encode(request)
    assert len(frames) == 4  # body + three arrays, each out of band
    decoded = round_trip(request, StageDiffusionCoreRequest)
    assert decoded.params == {"height": 64, "seed": 3}
    assert [a.shape for a in decoded.images] == [(64, 48, 3), (32, 48, 3)]
    assert np.array_equal(decoded.images[0], image)
    assert np.array_equal(decoded.images[1], image[:32])
    assert decoded.images[0].dtype == np.uint8
    assert np.array_equal(decoded.prompt_embeds, embeds)

    outputs = StageDiffusionCoreOutputs(
        outputs=[
            StageDiffusionCoreOutput(request_id="d1", images=image[None], execute_time=0.5),
            StageDiffusionCoreOutput(request_id="d2", error=TOO_BIG),
        ],
        utility_output=StageUtilityOutput(call_id=3, result={"a": [1, 2]}),
        engine_dead=None,
    )
    back = round_trip(outputs, StageDiffusionCoreOutputs)
    assert back == StageDiffusionCoreOutputs(
        outputs=[
            StageDiffusionCoreOutput(
                request_id="d1", images=back.outputs[0].images, execute_time=0.5
            ),
            StageDiffusionCoreOutput(request_id="d2", error=TOO_BIG),
        ],
        utility_output=StageUtilityOutput(call_id=3, result={"a": [1, 2]}),
    )
    assert np.array_equal(back.outputs[0].images, image[None])
    call = StageUtilityCall(call_id=1, method="describe", args=[1], kwargs={"x": "y"})
    assert round_trip(call, StageUtilityCall) == call


@pytest.mark.parametrize(
    "error",
    [
        StageError.bad_request("params.temperature: must be non-negative", "temperature"),
        StageError.bad_request("malformed ADD message: truncated"),
        StageError(
            StageErrorCode.REQUEST_ID_IN_FLIGHT, "request_id: 'a' is in flight", "request_id"
        ),
        StageError(StageErrorCode.STAGE_FAILED, "the pipeline failed: RuntimeError: boom"),
        StageError(StageErrorCode.UNAVAILABLE, "stage 'dit' is unavailable: its core died"),
    ],
)
def test_stage_errors_round_trip_as_data_on_every_output(error: StageError) -> None:
    server = StageServerOutputs(
        outputs=[StageServerOutput("s", finished=True, finish_reason="error", error=error)]
    )
    diffusion = StageDiffusionCoreOutputs(outputs=[StageDiffusionCoreOutput("d", error=error)])
    llm = StageLLMCoreOutputs.refusal("l", error)
    for message, type_ in (
        (server, StageServerOutputs),
        (diffusion, StageDiffusionCoreOutputs),
        (llm, StageLLMCoreOutputs),
    ):
        (output,) = round_trip(message, type_).outputs  # type: ignore[attr-defined]
        assert output.error == error
        # The code decodes as the enum, not its wire value: receivers compare members.
        assert output.error.code is error.code
        assert output.error.param == error.param
    # For people (logs, a CLI line), an error reads as its message.
    assert str(error) == f"{error}" == error.message


def test_a_stage_error_of_an_unknown_code_is_refused() -> None:
    frames = WireEncoder().encode(
        StageServerOutputs(
            outputs=[StageServerOutput("s", finished=True, error=StageError.bad_request("x"))]
        )
    )
    forged = bytes(frames[0]).replace(b"bad_request", b"bad_weather")
    assert forged != bytes(frames[0])
    with pytest.raises(WireError, match="bad_weather"):
        WireDecoder(StageServerOutputs).decode([forged])


def test_small_arrays_are_inlined() -> None:
    small = np.zeros(INLINE_LIMIT // 8 - 1, dtype=np.float64)
    frames = WireEncoder().encode(StageDiffusionCoreRequest(request_id="s", prompt_embeds=small))
    assert len(frames) == 1


def test_object_arrays_are_refused_both_ways() -> None:
    with pytest.raises(TypeError, match="numeric only"):
        WireEncoder().encode(
            StageDiffusionCoreRequest(request_id="o", images=[np.array([object()])])
        )
    # A forged message naming an object dtype must not be turned into objects.
    forged = msgspec.msgpack.encode(
        ["o", None, {}, msgspec.msgpack.Ext(1, msgspec.msgpack.encode(("|O", [1], b"\0" * 8)))]
    )
    with pytest.raises((WireError, msgspec.ValidationError)):
        WireDecoder(StageDiffusionCoreRequest).decode([forged])


def test_references_to_missing_frames_are_refused() -> None:
    frames = WireEncoder().encode(
        StageDiffusionCoreRequest(request_id="m", images=[np.zeros((32, 32, 3), np.uint8)])
    )
    with pytest.raises(WireError, match="frame 1"):
        WireDecoder(StageDiffusionCoreRequest).decode(frames[:1])


def test_stage_core_types_does_not_import_vllm() -> None:
    # A diffusion core proc imports these types; importing vLLM would add ~7 s to its start.
    code = (
        "import sys; import omni_runtime.engine.stage.stage_core_types as t; "
        "t.StageDiffusionCoreRequest; print('vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
