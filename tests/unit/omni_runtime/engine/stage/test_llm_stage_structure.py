"""The LLM stage's structure: the seed's class diagrams and renames, its wire format, and the
pure parts (engine arguments from the schema, the core host, inputs from upstream)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Generic

import msgspec
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.engine.core_client import AsyncMPClient, DPLBAsyncMPClient
from vllm.v1.engine.utils import CoreEngineProcManager
from vllm.v1.serial_utils import CUSTOM_TYPE_RAW_VIEW, MsgpackDecoder, MsgpackEncoder

from omni_runtime.config import StageConfig
from omni_runtime.config.stages import VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
from omni_runtime.connectors import ConnectorHandle
from omni_runtime.diffusion.stage.inline_stage_diffusion_client import InlineStageDiffusionClient
from omni_runtime.diffusion.stage.stage_diffusion_core_client import StageDiffusionCoreClient
from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase
from omni_runtime.engine.stage.stage_core_types import (
    HandOff,
    StageError,
    StageErrorCode,
    StageLLMCoreOutput,
    StageLLMCoreOutputs,
    StageLLMCoreRequest,
)
from omni_runtime.engine.stage.stage_llm_core_client import (
    DPLBStageLLMCoreClient,
    StageLLMCoreClient,
    StageLLMCoreClientBase,
)
from omni_runtime.engine.stage.stage_llm_core_proc import StageLLMCoreProc
from omni_runtime.engine.stage.stage_llm_core_proc_manager import StageLLMCoreProcManager
from omni_runtime.engine.stage.stage_llm_engine_config import (
    StageLLMConfigError,
    make_stage_llm_engine_args,
)
from omni_runtime.engine.stage.stage_llm_request_builder import (
    InvalidLLMRequestError,
    _encoder_dit_params,
)
from omni_runtime.engine.stage.zmq_stage_client import ZmqStageClientBase
from omni_runtime.families import FAMILIES

CONTRACT = (
    "add_request_async",
    "get_outputs_async",
    "get_outputs_nowait",
    "abort_requests_async",
    "collective_rpc_async",
    "check_health",
    "shutdown",
)


@pytest.mark.parametrize(
    ("cls", "bases"),
    [
        (StageLLMCoreProc, (EngineCoreProc,)),
        (StageLLMCoreProcManager, (CoreEngineProcManager,)),
        (StageLLMCoreClientBase, (StageCoreClientBase,)),
        (StageLLMCoreClient, (AsyncMPClient, StageLLMCoreClientBase)),
        (DPLBStageLLMCoreClient, (DPLBAsyncMPClient, StageLLMCoreClientBase)),
        # The out-of-process diffusion client shares its ZMQ machinery with the router's
        # RemoteStageClient; the base they share meets the stage contract.
        (StageDiffusionCoreClient, (ZmqStageClientBase,)),
        (ZmqStageClientBase, (StageCoreClientBase, Generic)),
        (InlineStageDiffusionClient, (StageCoreClientBase,)),
    ],
)
def test_bases_are_the_seeds(cls: type, bases: tuple[type, ...]) -> None:
    assert cls.__bases__ == bases


@pytest.mark.parametrize(
    ("client", "transport"),
    [(StageLLMCoreClient, AsyncMPClient), (DPLBStageLLMCoreClient, DPLBAsyncMPClient)],
)
def test_client_mro_puts_vllm_first_then_the_stage_bases(client: type, transport: type) -> None:
    mro = client.__mro__
    assert mro.index(transport) < mro.index(StageLLMCoreClientBase)
    assert mro.index(StageLLMCoreClientBase) < mro.index(StageCoreClientBase)
    # The two clients are siblings, not one a kind of the other.
    assert StageLLMCoreClient not in DPLBStageLLMCoreClient.__mro__
    assert not inspect.isabstract(client)
    for name in CONTRACT:
        assert not getattr(getattr(client, name), "__isabstractmethod__", False), name


def _parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_proc_manager_takes_the_seeds_renamed_arguments() -> None:
    parameters = inspect.signature(StageLLMCoreProcManager.__init__).parameters
    # The stage's own, beside the seed's: the connectors its cores fetch inputs through.
    assert [p.name for p in parameters.values() if p.kind is p.KEYWORD_ONLY] == ["connectors"]
    assert [p.name for p in parameters.values() if p.kind is not p.KEYWORD_ONLY] == [
        "self",
        "local_proc_count",
        "vllm_config",
        "local_client",
        "handshake_address",
        "executor_class",
        "log_stats",
        "client_handshake_address",
        "tensor_queue",
    ]
    # What it reuses of vLLM's manager is vLLM's own; its shutdown is vLLM's followed by
    # reaping the procs vLLM killed (test_llm_stage.py checks that none is left a zombie).
    for name in ("monitor_engine_liveness", "finished_procs", "sentinels"):
        assert getattr(StageLLMCoreProcManager, name) is getattr(CoreEngineProcManager, name)


def test_run_stage_core_has_no_local_dp_rank() -> None:
    assert isinstance(inspect.getattr_static(StageLLMCoreProc, "run_stage_core"), staticmethod)
    parameters = _parameters(StageLLMCoreProc.run_stage_core)
    assert "local_dp_rank" not in parameters
    assert "dp_rank" in parameters


def test_make_async_mp_client_signature() -> None:
    assert isinstance(
        inspect.getattr_static(StageLLMCoreClientBase, "make_async_mp_client"), staticmethod
    )
    signature = inspect.signature(StageLLMCoreClientBase.make_async_mp_client)
    assert list(signature.parameters) == [
        "vllm_config",
        "executor_class",
        "log_stats",
        "metadata",
        "client_addresses",
        "proc_manager",
        "coordinator",
    ]
    assert signature.parameters["proc_manager"].annotation == "StageLLMCoreProcManager | None"
    assert signature.parameters["coordinator"].annotation == "DPCoordinator | None"
    for name in ("_default_process_core_inputs", "_resolve_core_host"):
        assert isinstance(inspect.getattr_static(StageLLMCoreClientBase, name), staticmethod)


def test_stage_fields_are_appended_after_vllms() -> None:
    assert StageLLMCoreRequest.__struct_fields__[:-2] == EngineCoreRequest.__struct_fields__
    assert StageLLMCoreRequest.__struct_fields__[-2:] == ("additional_information", "inputs")
    assert StageLLMCoreOutput.__struct_fields__[:-1] == EngineCoreOutput.__struct_fields__
    assert StageLLMCoreOutput.__struct_fields__[-1] == "error"
    assert StageLLMCoreOutputs.__struct_fields__ == EngineCoreOutputs.__struct_fields__


def _request(**extra: object) -> StageLLMCoreRequest:
    return StageLLMCoreRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        mm_features=None,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=4),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        **extra,
    )


def test_additional_information_survives_the_stage_decoder_not_vllms() -> None:
    frames = MsgpackEncoder().encode(_request(additional_information={"source": "stage-0"}))
    decoded = MsgpackDecoder(StageLLMCoreRequest).decode(frames)
    assert decoded.additional_information == {"source": "stage-0"}
    # vLLM's own decoder drops the trailing field without a word: why the core decodes
    # with the stage type.
    assert not hasattr(MsgpackDecoder(EngineCoreRequest).decode(frames), "additional_information")


def test_a_requests_hand_offs_cross_to_the_core_as_handles() -> None:
    handle = ConnectorHandle("shm", "r1/thinker_rows", "float32", [5, 256], 5120, token="t")
    frames = MsgpackEncoder().encode(_request(inputs={"thinker_rows": HandOff(handle)}))
    decoded = MsgpackDecoder(StageLLMCoreRequest).decode(frames)
    assert decoded.inputs == {"thinker_rows": HandOff(handle)}
    assert _request().inputs == {}


def test_vllm_outputs_decode_as_stage_outputs() -> None:
    hidden = torch.randn(7, 128)
    vllm_message = EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id="r1", new_token_ids=[], pooling_output=hidden)]
    )
    decoded = MsgpackDecoder(StageLLMCoreOutputs).decode(MsgpackEncoder().encode(vllm_message))
    assert isinstance(decoded, StageLLMCoreOutputs)
    (output,) = decoded.outputs
    assert isinstance(output, StageLLMCoreOutput)
    assert output.error is None
    assert torch.equal(output.pooling_output, hidden)
    # The other way loses the stage's field: why the clients decode with the stage type.
    empty = StageError.bad_request("prompt: empty", "prompt")
    refusal = MsgpackEncoder().encode(StageLLMCoreOutputs.refusal("r2", empty))
    assert MsgpackDecoder(StageLLMCoreOutputs).decode(refusal).outputs[0].error == empty
    assert not hasattr(MsgpackDecoder(EngineCoreOutputs).decode(refusal).outputs[0], "error")


def test_tensors_travel_as_raw_frames_and_pickle_is_off() -> None:
    hidden = torch.randn(7, 128)
    frames = MsgpackEncoder().encode(
        StageLLMCoreOutputs(outputs=[StageLLMCoreOutput("r1", [], pooling_output=hidden)])
    )
    # The body, and the tensor's bytes as a frame of their own.
    assert len(frames) == 2
    assert bytes(frames[1]) == hidden.numpy().tobytes()
    codes: list[int] = []

    def record(code: int, data: memoryview) -> None:
        codes.append(code)

    msgspec.msgpack.decode(frames[0], ext_hook=record)
    assert set(codes) <= {CUSTOM_TYPE_RAW_VIEW}  # no pickle or cloudpickle extension
    # With VLLM_ALLOW_INSECURE_SERIALIZATION off (the clients and cores refuse to start
    # with it on), an object that only pickle could carry is refused, both ways.
    with pytest.raises(TypeError, match="not serializable"):
        MsgpackEncoder().encode({"x": object()})
    forged = msgspec.msgpack.encode(msgspec.msgpack.Ext(1, b"\x80\x04N."))
    with pytest.raises(NotImplementedError):
        MsgpackDecoder().decode(forged)


def test_refusal_is_a_finished_error_output() -> None:
    message = StageLLMCoreOutputs.refusal("r9", StageError.bad_request("prompt: empty", "prompt"))
    (output,) = message.outputs
    assert output.finish_reason == FinishReason.ERROR
    assert output.error is not None
    assert (output.error.code, output.error.param) == (StageErrorCode.BAD_REQUEST, "prompt")
    assert message.finished_requests == {"r9"}
    # A refused duplicate: the first request under the id goes on, so the id is not
    # finished (a data parallel client keeps it bound to its core).
    duplicate = StageLLMCoreOutputs.refusal(
        "r9", StageError(StageErrorCode.REQUEST_ID_IN_FLIGHT, "in flight"), still_in_flight=True
    )
    assert duplicate.outputs[0].finish_reason == FinishReason.ERROR
    assert not duplicate.finished_requests


def _stage(**fields: object) -> StageConfig:
    return StageConfig.model_validate({"stageId": 0, "type": "llm", **fields})


def test_engine_args_follow_the_stage() -> None:
    args = make_stage_llm_engine_args(
        _stage(maxModelLen=256, maxNumSeqs=4, dtype="float32", enforceEager=True), "/m"
    )
    assert (args.model, args.runner, args.max_model_len, args.max_num_seqs) == (
        "/m",
        "generate",
        256,
        4,
    )
    assert (args.dtype, args.enforce_eager) == ("float32", True)
    encode = make_stage_llm_engine_args(_stage(output="hidden_states"), "/m")
    assert (encode.runner, encode.convert) == ("pooling", "embed")
    passed = make_stage_llm_engine_args(_stage(engineArgs={"seed": 7}), "/m")
    assert passed.seed == 7


def test_an_unset_gpu_share_is_counted_as_what_vllm_reserves() -> None:
    # The GPU memory admission counts an LLM stage without gpuMemoryUtilization as vLLM's
    # default; a vLLM upgrade that changes the default must change the constant with it.
    args = make_stage_llm_engine_args(_stage(), "/m")
    assert args.gpu_memory_utilization == VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
    assert _stage(devices="0").gpu_share == VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
    declared = make_stage_llm_engine_args(_stage(gpuMemoryUtilization=0.45), "/m")
    assert declared.gpu_memory_utilization == 0.45


def test_a_bagel_thinker_is_the_plugin_prefilling_whole_prompts() -> None:
    thinker = _stage(name="thinker", maxNumBatchedTokens=32768, enforceEager=False)
    args = make_stage_llm_engine_args(thinker, "/m", FAMILIES["bagel"].encoder)
    assert (args.runner, args.convert) == ("pooling", "embed")
    assert args.hf_overrides == {"architectures": ["OmniBagelThinker"]}
    assert (args.enable_chunked_prefill, args.enable_prefix_caching) == (False, False)
    assert args.enforce_eager is True  # its forward is Python over each prompt's spans
    assert args.max_num_batched_tokens == 32768


def test_engine_args_errors_name_the_field() -> None:
    with pytest.raises(StageLLMConfigError, match=r"engineArgs\.sharpness: not an engine"):
        make_stage_llm_engine_args(_stage(engineArgs={"sharpness": 1}), "/m")
    diffusion = StageConfig.model_validate({"stageId": 1, "type": "diffusion"})
    with pytest.raises(StageLLMConfigError, match="type: stage 1 is a diffusion stage"):
        make_stage_llm_engine_args(diffusion, "/m")


def test_core_host() -> None:
    resolve = StageLLMCoreClientBase._resolve_core_host
    assert resolve({"core_host": "10.0.0.9", "input_address": "tcp://10.1.1.1:5"}) == "10.0.0.9"
    assert resolve({"input_address": "tcp://10.1.1.1:5555"}) == "10.1.1.1"
    local = resolve({"input_address": "ipc:///tmp/x", "output_address": "tcp://0.0.0.0:6"})
    assert local not in ("", "0.0.0.0", "*")
    assert local == resolve({})


@dataclasses.dataclass
class _Upstream:
    request_id: str
    token_ids: list[int] = dataclasses.field(default_factory=list)
    error: StageError | None = None


def test_default_process_core_inputs_takes_the_generated_tokens() -> None:
    first = _Upstream("a", token_ids=[5, 6, 2])
    second = _Upstream("b", token_ids=[7])
    assert StageLLMCoreClientBase._default_process_core_inputs([first, second]) == [
        [5, 6, 2],
        [7],
    ]
    encoded = _Upstream("c")  # an encode stage generates no tokens
    with pytest.raises(ValueError, match="upstream request c has no prompt"):
        StageLLMCoreClientBase._default_process_core_inputs([encoded])


@pytest.mark.parametrize(
    ("params", "taken", "left"),
    [
        ({"seed": 52}, {"seed": 52}, {}),
        ({}, {}, {}),
        ({"seed": 1, "max_tokens": 3}, {"seed": 1}, {"max_tokens": 3}),
        # An edit's size is the DiT's: left to be refused as any param the stage lacks.
        ({"seed": 2, "height": 32}, {"seed": 2}, {"height": 32}),
    ],
)
def test_a_bagel_thinker_takes_the_seed_of_its_params(
    params: dict[str, object], taken: dict[str, object], left: dict[str, object]
) -> None:
    params = dict(params)
    assert _encoder_dit_params(params, ("seed",)) == taken
    assert params == left  # the rest is checked as the stage's params


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"seed": "52"}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": True}, "seed"),
    ],
)
def test_a_bagel_thinkers_bad_seed_is_refused_by_name(
    params: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidLLMRequestError, match=rf"params\.{field}: expected") as refused:
        _encoder_dit_params(dict(params), ("seed",))
    assert refused.value.error.param == field
