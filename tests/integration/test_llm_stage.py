"""The LLM stage for real: vLLM's CPU build in StageLLMCoreProcs on the tiny Qwen2 model,
reached through StageLLMCoreClient / DPLBStageLLMCoreClient, checked against transformers
running the same weights."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM
from vllm import PoolingParams, SamplingParams
from vllm.lora.request import LoRARequest
from vllm.v1.engine import FinishReason
from vllm.v1.engine.core_client import AsyncMPClient
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from omni_runtime.config import PipelineConfig, StageConfig
from omni_runtime.connectors import StageConnectors
from omni_runtime.diffusion.engine import DiffusionEngineConfig
from omni_runtime.diffusion.stage.generate import generate
from omni_runtime.diffusion.stage.inline_stage_diffusion_client import InlineStageDiffusionClient
from omni_runtime.engine.stage.stage_core_client import StageCoreDeadError, StageCoreStartupError
from omni_runtime.engine.stage.stage_core_types import (
    StageDiffusionCoreRequest,
    StageError,
    StageErrorCode,
    StageLLMCoreOutput,
    StageLLMCoreRequest,
    StageServerOutput,
    StageServerRequest,
)
from omni_runtime.engine.stage.stage_llm_core_client import (
    DPLBStageLLMCoreClient,
    StageLLMCoreClient,
    start_stage_llm_client,
)
from omni_runtime.engine.stage.stage_llm_core_proc import StageLLMRequest
from omni_runtime.engine.stage.stage_llm_engine_config import StageLLMConfigError
from omni_runtime.stage_server.llm_frontend import StageLLMFrontend
from omni_runtime.tiny_models import DIFFUSION_SUBDIR, HIDDEN_SIZE, LLM_SUBDIR
from omni_testkit.stage_outputs import (
    StageLLMResult,
    add_prompt,
    collect_results,
    core_pids,
    outputs_until_dead,
)

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

LLMClient = StageLLMCoreClient | DPLBStageLLMCoreClient
PROMPTS = ["a red cat", "draw a blue river under the moon", "paint a portrait of a dog"]
DEADLINE_S = 60


def stage(**fields: Any) -> StageConfig:
    # float32 so that vLLM and transformers compute the same numbers.
    return StageConfig.model_validate(
        {
            "stageId": 0,
            "name": "thinker",
            "type": "llm",
            "dtype": "float32",
            "enforceEager": True,
            "maxModelLen": 512,
            **fields,
        }
    )


TEXT_STAGE = stage(defaultSamplingParams={"temperature": 0.0, "max_tokens": 16})
ENCODE_STAGE = stage(name="encoder", output="hidden_states")


@pytest.fixture(scope="module", autouse=True)
def engine_environment(llm_engine_environment: None) -> None:
    """vLLM's CPU environment for this module's cores (tests/conftest.py)."""


@pytest.fixture(scope="module")
def llm_path(tiny_models: Path) -> str:
    return str(tiny_models / LLM_SUBDIR)


@pytest.fixture(scope="module")
def text_client(llm_path: str) -> Iterator[LLMClient]:
    client = start_stage_llm_client(TEXT_STAGE, llm_path)
    yield client
    stop_and_check_gone(client)


@pytest.fixture(scope="module")
def encode_client(llm_path: str) -> Iterator[LLMClient]:
    client = start_stage_llm_client(ENCODE_STAGE, llm_path)
    yield client
    stop_and_check_gone(client)


@pytest.fixture
def doomed_client(llm_path: str) -> Iterator[LLMClient]:
    """A client of its own, for tests that end its core."""
    client = start_stage_llm_client(TEXT_STAGE, llm_path)
    yield client
    stop_and_check_gone(client)


@pytest.fixture(scope="module")
def hf_model(llm_path: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(llm_path, dtype=torch.float32).eval()


def stop_and_check_gone(client: LLMClient) -> None:
    """Shut the client down; its running cores must stop cleanly on the manager's SIGTERM."""
    assert client.proc_manager is not None
    running = [proc for proc in client.proc_manager.processes if proc.exitcode is None]
    watched = [psutil.Process(proc.pid) for proc in running]
    if (coordinator := client.resources.coordinator) is not None:
        watched.append(psutil.Process(coordinator.proc.pid))
    client.shutdown()
    _, alive = psutil.wait_procs(watched, timeout=10)
    assert not alive
    # 0, not -SIGTERM or -SIGKILL: the core took the signal and finished on its own.
    assert [proc.exitcode for proc in running] == [0] * len(running)


def children() -> list[int]:
    """This process's descendants, but multiprocessing's resource tracker (a helper that
    lives as long as this process once any core was started)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "multiprocessing.resource_tracker" not in " ".join(proc.cmdline()):
                found.append(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def hf_greedy(model: Any, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_token_ids]), max_new_tokens=max_new_tokens, do_sample=False
        )
    tokens: list[int] = out[0, len(prompt_token_ids) :].tolist()
    return tokens


async def run(client: LLMClient, request_id: str, **prompt: Any) -> StageLLMResult:
    await add_prompt(client, request_id, **prompt)
    return (await collect_results(client, [request_id], timeout=DEADLINE_S))[request_id]


async def run_good(client: LLMClient, request_id: str) -> None:
    """A well-formed request of the client's stage kind, which must succeed."""
    params = {} if client.request_builder.encodes else {"max_tokens": 4, "ignore_eos": True}
    result = await run(client, request_id, prompt="a red cat", params=params)
    assert result.error is None
    if client.request_builder.encodes:
        assert result.hidden_states is not None
    else:
        assert result.finish_reason == FinishReason.LENGTH
        assert len(result.token_ids) == 4


async def test_greedy_generation_equals_transformers(text_client: LLMClient, hf_model: Any) -> None:
    builder = text_client.request_builder
    for index, prompt in enumerate(PROMPTS):
        result = await run(text_client, f"greedy-{index}", prompt=prompt, params={"max_tokens": 24})
        prompt_ids = builder.build("ids", prompt=prompt).prompt_token_ids
        expected = hf_greedy(hf_model, prompt_ids, 24)
        assert result.token_ids == expected, prompt
        assert result.finish_reason == FinishReason.LENGTH
    # A chat request: the stage's default params (greedy, 16 tokens) apply.
    messages = [{"role": "user", "content": "draw a red cat"}]
    chat = await run(text_client, "greedy-chat", messages=messages)
    chat_ids = builder.build("ids", messages=messages).prompt_token_ids
    assert chat.token_ids == hf_greedy(hf_model, chat_ids, 16)


async def test_the_stage_frontend_streams_the_text_of_the_tokens(
    text_client: LLMClient, llm_path: str
) -> None:
    pipeline = PipelineConfig.model_validate({"model": llm_path, "stages": [TEXT_STAGE]})
    frontend = StageLLMFrontend(pipeline, TEXT_STAGE, text_client, StageConnectors({}))
    tokenizer = text_client.request_builder.tokenizer
    for skip_special_tokens in (True, False):
        request_id = f"frontend-{skip_special_tokens}"
        params = {"max_tokens": 24, "ignore_eos": True, "skip_special_tokens": skip_special_tokens}
        refused = await frontend.add(
            StageServerRequest(request_id=request_id, prompt=PROMPTS[1], params=params)
        )
        assert refused == []
        outputs: list[StageServerOutput] = []
        async with asyncio.timeout(DEADLINE_S):
            while not (outputs and outputs[-1].finished):
                outputs.extend(await frontend.next_outputs())
        token_ids = [token for output in outputs for token in output.token_ids]
        deltas = [output.text for output in outputs]
        assert len(token_ids) == 24
        assert "".join(deltas) == tokenizer.decode(
            token_ids, skip_special_tokens=skip_special_tokens
        )
        assert len([delta for delta in deltas if delta]) > 1
        assert (outputs[-1].finish_reason, outputs[-1].completion_tokens) == ("length", 24)
        assert frontend.in_flight == 0


async def test_a_request_that_does_not_stream_gets_one_output_with_all_its_text(
    text_client: LLMClient, llm_path: str
) -> None:
    pipeline = PipelineConfig.model_validate({"model": llm_path, "stages": [TEXT_STAGE]})
    frontend = StageLLMFrontend(pipeline, TEXT_STAGE, text_client, StageConnectors({}))
    params = {"max_tokens": 24, "ignore_eos": True}
    streamed: list[StageServerOutput] = []
    whole: list[StageServerOutput] = []
    for request_id, stream, outputs in (("streamed", True, streamed), ("whole", False, whole)):
        request = StageServerRequest(
            request_id=request_id, prompt=PROMPTS[1], params=params, stream=stream
        )
        assert await frontend.add(request) == []
        async with asyncio.timeout(DEADLINE_S):
            while not (outputs and outputs[-1].finished):
                outputs.extend(await frontend.next_outputs())
    assert len(streamed) > 1
    assert len(whole) == 1  # greedy: the same tokens, in one message
    assert whole[0].token_ids == [t for output in streamed for t in output.token_ids]
    assert whole[0].text == "".join(output.text for output in streamed)
    assert (whole[0].finish_reason, whole[0].completion_tokens) == ("length", 24)
    assert frontend.in_flight == 0


async def test_chat_messages_go_through_the_models_template(
    text_client: LLMClient, encode_client: LLMClient
) -> None:
    tokenizer = text_client.request_builder.tokenizer
    messages = [{"role": "user", "content": "draw a red cat"}]
    for client, generation_prompt in ((text_client, True), (encode_client, False)):
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        request = client.request_builder.build("chat", messages=messages)
        assert request.prompt_token_ids == tokenizer(text, add_special_tokens=False)["input_ids"]


async def test_default_sampling_params_merge_under_the_requests_own(text_client: LLMClient) -> None:
    builder = text_client.request_builder
    defaults_only = builder.build("a", prompt="a red cat").sampling_params
    assert (defaults_only.temperature, defaults_only.max_tokens) == (0.0, 16)
    overridden = builder.build("b", prompt="a red cat", params={"max_tokens": 3}).sampling_params
    assert (overridden.temperature, overridden.max_tokens) == (0.0, 3)
    # What vLLM's front end would add: the end-of-sequence token the core stops at.
    assert overridden.eos_token_id == builder.tokenizer.eos_token_id
    request = builder.build("c", prompt="a", additional_information={"from": "stage-0"})
    assert isinstance(request, StageLLMCoreRequest)
    assert request.additional_information == {"from": "stage-0"}


async def test_eight_concurrent_requests_all_finish(text_client: LLMClient) -> None:
    lengths = [8, 12, 16, 20]
    ids = []
    for index in range(8):
        request_id = f"concurrent-{index}"
        ids.append(request_id)
        params = {"max_tokens": lengths[index % 4], "ignore_eos": True}
        await add_prompt(text_client, request_id, prompt=PROMPTS[index % 3], params=params)
    results = await collect_results(text_client, ids, timeout=DEADLINE_S)
    for index, request_id in enumerate(ids):
        result = results[request_id]
        assert result.finish_reason == FinishReason.LENGTH
        assert len(result.token_ids) == lengths[index % 4]
    # Same prompt, same greedy tokens, whatever else shared the batch.
    first, again = results["concurrent-0"].token_ids, results["concurrent-3"].token_ids
    assert first == again[: len(first)]


async def test_streaming_deltas_arrive_in_order(text_client: LLMClient, hf_model: Any) -> None:
    params = {"max_tokens": 12, "ignore_eos": True}
    await add_prompt(text_client, "stream", prompt=PROMPTS[0], params=params)
    deltas: list[list[int]] = []
    finished_at: int | None = None
    deadline = time.monotonic() + DEADLINE_S
    while finished_at is None:
        assert time.monotonic() < deadline, "the request never finished"
        outputs = text_client.get_outputs_nowait()
        if outputs is None:
            await asyncio.sleep(0.005)
            continue
        for output in outputs.outputs:
            assert output.request_id == "stream"
            deltas.append(list(output.new_token_ids))
            if output.finish_reason is not None:
                finished_at = len(deltas)
    # One token per engine step, the finish on the last, nothing after it.
    assert [len(delta) for delta in deltas] == [1] * 12
    assert finished_at == 12
    assert text_client.get_outputs_nowait() is None
    prompt_ids = text_client.request_builder.build("ids", prompt=PROMPTS[0]).prompt_token_ids
    assert [token for delta in deltas for token in delta] == hf_greedy(hf_model, prompt_ids, 12)


async def test_additional_information_reaches_the_scheduled_request(
    text_client: LLMClient,
) -> None:
    """What a stage request carries beyond vLLM's fields survives the wire (msgpack, as the
    client sends it) and lands on the request the core's scheduler holds."""
    info = {"source_stage": 0, "note": "handoff"}
    request = text_client.request_builder.build(
        "info", prompt=PROMPTS[1], additional_information=info
    )
    wire = MsgpackDecoder(StageLLMCoreRequest).decode(MsgpackEncoder().encode(request))
    scheduled = StageLLMRequest.from_stage_request(wire, None)
    assert scheduled.additional_information == info
    assert scheduled.request_id == "info"


async def test_abort_answers_a_running_request(text_client: LLMClient) -> None:
    await add_prompt(
        text_client, "long", prompt=PROMPTS[1], params={"max_tokens": 400, "ignore_eos": True}
    )
    first = await text_client.get_outputs_async()
    assert first.outputs[0].request_id == "long"
    await text_client.abort_requests_async(["long"])
    result = StageLLMResult("long")
    result.add(first.outputs[0])
    async with asyncio.timeout(10):
        while not result.finished:
            for output in (await text_client.get_outputs_async()).outputs:
                result.add(output)
    assert result.aborted
    assert len(result.token_ids) < 400
    await run_good(text_client, "after-abort")


def _core_request(client: LLMClient, request_id: str, **fields: Any) -> StageLLMCoreRequest:
    """A well-formed request, then changed behind the builder's back (as a faulty or
    hostile peer could): what only the core's own checks stand against."""
    request = client.request_builder.build(request_id, prompt="a red cat", params={"max_tokens": 4})
    for name, value in fields.items():
        if name in ("max_tokens", "temperature", "logprobs", "allowed_token_ids"):
            setattr(request.sampling_params, name, value)  # no validation on assignment
        else:
            setattr(request, name, value)
    return request


@pytest.mark.parametrize(
    ("prompt", "error", "param"),
    [
        (
            {"prompt_token_ids": [5] * 600},
            "prompt_token_ids: This model's maximum context length is 512 tokens",
            "prompt_token_ids",
        ),
        (
            # Fits the context, but leaves no position for a generated token.
            {"prompt_token_ids": [5] * 512},
            "prompt_token_ids: The decoder prompt (length 512) plus",
            "prompt_token_ids",
        ),
        (
            {"prompt_token_ids": [5, 384]},
            "prompt_token_ids: Token id 384 is out of vocabulary",
            "prompt_token_ids",
        ),
        (
            {"messages": [{"role": "user", "content": "cat " * 2000}]},
            "messages: This model's maximum context length is 512 tokens",
            "messages",
        ),
        ({"prompt": "cat " * 700}, "prompt: ", "prompt"),
        ({"prompt": ""}, "prompt: empty", "prompt"),
        ({"messages": []}, "messages: empty", "messages"),
        (
            {"prompt": "x", "params": {"sharpness": 2}},
            "params.sharpness: unknown sampling",
            "sharpness",
        ),
        (
            {"prompt": "x", "params": {"max_tokens": 0}},
            "params.max_tokens: max_tokens must",
            "max_tokens",
        ),
        (
            {"prompt": "x", "params": {"temperature": -1}},
            "params.temperature: temperature must",
            "temperature",
        ),
        (
            {"prompt": "x", "params": {"max_tokens": "8"}},
            "params.max_tokens: Expected `int",
            "max_tokens",
        ),
        (
            {"prompt": "x", "params": {"stop_token_ids": [999]}},
            "params.stop_token_ids: token_id(s) [999]",
            "stop_token_ids",
        ),
    ],
)
async def test_bad_request_from_the_builder_errors_and_next_succeeds(
    text_client: LLMClient, prompt: dict[str, Any], error: str, param: str
) -> None:
    result = await run(text_client, "bad", **prompt)
    assert result.finish_reason == FinishReason.ERROR
    assert result.error is not None
    assert result.error.code == StageErrorCode.BAD_REQUEST
    assert result.error.message.startswith(error)
    assert result.error.param == param
    assert result.token_ids == []
    await run_good(text_client, "good")


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"prompt_token_ids": [5] * 600}, "prompt: 600 tokens, but this stage takes at most 511"),
        ({"prompt_token_ids": []}, "prompt: empty"),
        ({"prompt_token_ids": [5, 384]}, "prompt_token_ids: token ids must be in [0, 384)"),
        ({"max_tokens": 0}, "max_tokens: max_tokens must be at least 1"),
        ({"temperature": -0.5}, "temperature: temperature must be non-negative"),
        ({"logprobs": 1000}, "logprobs: Requested sample logprobs of 1000"),
        ({"allowed_token_ids": [7, 999]}, "allowed_token_ids: allowed_token_ids contains out-of"),
        (
            {"lora_request": LoRARequest("adapter", 1, "/nowhere")},
            "lora_request: this stage serves no LoRA adapters",
        ),
        (
            {"sampling_params": None, "pooling_params": PoolingParams(task="token_embed")},
            "pooling_params: this stage generates text",
        ),
    ],
)
async def test_bad_request_at_the_core_errors_and_next_succeeds(
    text_client: LLMClient, fields: dict[str, Any], error: str
) -> None:
    await text_client.add_request_async(_core_request(text_client, "bad-core", **fields))
    result = (await collect_results(text_client, ["bad-core"], timeout=DEADLINE_S))["bad-core"]
    assert result.finish_reason == FinishReason.ERROR
    assert result.error is not None
    assert result.error.code == StageErrorCode.BAD_REQUEST
    assert result.error.message.startswith(error)
    # Each of these is one field's fault, which the error names as data too.
    assert result.error.param is not None
    assert result.error.message.startswith(f"{result.error.param}: ")
    await run_good(text_client, "good-core")


async def test_a_request_id_in_flight_is_refused_and_the_first_goes_on(
    text_client: LLMClient,
) -> None:
    # vLLM's scheduler asserts on a duplicate id, which would end the core.
    # Long enough to be running still when both duplicates arrive, on a busy machine too.
    params = {"max_tokens": 256, "ignore_eos": True}
    await add_prompt(text_client, "twice", prompt="a red cat", params=params)
    # Each refused by the core: through the stage's client, straight through vLLM's
    # transport, and one the core would refuse anyway (refused in its input thread, it is
    # still answered as a duplicate, in order with the first).
    await add_prompt(text_client, "twice", prompt="a blue dog", params=params)
    duplicate = text_client.request_builder.build("twice", prompt="a blue dog", params=params)
    await AsyncMPClient.add_request_async(text_client, duplicate)
    await text_client.add_request_async(_core_request(text_client, "twice", max_tokens=0))
    errors: list[StageError] = []
    first = StageLLMResult("twice")
    async with asyncio.timeout(DEADLINE_S):
        while not (first.finished and len(errors) == 3):
            for output in (await text_client.get_outputs_async()).outputs:
                assert output.request_id == "twice"
                if output.error is not None:
                    errors.append(output.error)
                else:
                    first.add(output)
    assert [error.code for error in errors] == [StageErrorCode.REQUEST_ID_IN_FLIGHT] * 3
    assert [error.message for error in errors] == [
        "request_id: 'twice' is in flight already; use an id of its own"
    ] * 3
    assert first.finish_reason == FinishReason.LENGTH
    assert len(first.token_ids) == 256
    await run_good(text_client, "twice")  # free again once finished


async def test_wrong_kind_is_refused_by_an_encode_stage(encode_client: LLMClient) -> None:
    result = await run(encode_client, "sampled", prompt="a red cat", params={"temperature": 0})
    assert result.error == StageError.bad_request(
        "params.temperature: this stage returns hidden states and takes no sampling parameters",
        "temperature",
    )
    generate_request = _core_request_for_kind(encode_client)
    await encode_client.add_request_async(generate_request)
    core = await collect_results(encode_client, ["sampled-core"], timeout=DEADLINE_S)
    assert core["sampled-core"].finish_reason == FinishReason.ERROR
    assert core["sampled-core"].error is not None
    assert core["sampled-core"].error.message.startswith(
        "sampling_params: this stage encodes hidden"
    )
    await run_good(encode_client, "good-encode")


def _core_request_for_kind(client: LLMClient) -> StageLLMCoreRequest:
    request = client.request_builder.build("sampled-core", prompt="a red cat")
    request.pooling_params = None
    request.sampling_params = SamplingParams(max_tokens=4)
    return request


async def test_hidden_states_equal_transformers(encode_client: LLMClient, llm_path: str) -> None:
    model = AutoModel.from_pretrained(llm_path, dtype=torch.float32).eval()
    builder = encode_client.request_builder
    for request_id, prompt in (
        ("plain", {"prompt": "a gold sculpture of a cat"}),
        ("chat", {"messages": [{"role": "user", "content": "draw a red cat"}]}),
    ):
        result = await run(encode_client, request_id, **prompt)
        prompt_ids = builder.build("ids", **prompt).prompt_token_ids
        with torch.no_grad():
            expected = model(torch.tensor([prompt_ids])).last_hidden_state[0]
        hidden = result.hidden_states
        assert hidden is not None
        assert hidden.dtype == torch.float32
        assert tuple(hidden.shape) == (len(prompt_ids), HIDDEN_SIZE)
        torch.testing.assert_close(hidden, expected, atol=1e-4, rtol=1e-4)
        assert result.finish_reason == FinishReason.STOP


async def test_hidden_states_condition_the_diffusion_stage(
    encode_client: LLMClient, tiny_models: Path
) -> None:
    result = await run(encode_client, "for-diffusion", prompt="a red cat in a garden")
    assert result.hidden_states is not None
    diffusion = InlineStageDiffusionClient(
        DiffusionEngineConfig(model=str(tiny_models / DIFFUSION_SUBDIR))
    )
    try:
        request = StageDiffusionCoreRequest(
            request_id="from-llm",
            prompt_embeds=result.hidden_states.numpy(),
            params={"num_inference_steps": 2, "height": 64, "width": 64, "seed": 1},
        )
        image = (await generate(diffusion, [request], timeout=DEADLINE_S))["from-llm"]
    finally:
        diffusion.shutdown()
    assert image.error is None
    assert image.images is not None
    assert image.images.shape == (1, 64, 64, 3)
    assert np.ptp(image.images) > 0


async def test_cores_report_themselves_and_run_collective_rpc(
    text_client: LLMClient, encode_client: LLMClient
) -> None:
    # The cores run in processes of their own, their runner as the stage configures it.
    assert os.getpid() not in core_pids(text_client)
    assert (
        "token_embed"
        in (await encode_client.collective_rpc_async("get_supported_tasks", timeout=10))[0]
    )
    assert await text_client.collective_rpc_async("get_supported_tasks", timeout=10) == [
        ["generate"]
    ]
    with pytest.raises(Exception, match="no_such_method"):
        await text_client.collective_rpc_async("no_such_method", timeout=10)
    text_client.check_health()


@pytest.mark.asyncio(loop_scope="function")
async def test_killed_core_fails_in_flight_requests_fast(doomed_client: LLMClient) -> None:
    params = {"max_tokens": 400, "ignore_eos": True}
    await add_prompt(doomed_client, "in-flight", prompt="a red cat", params=params)
    await doomed_client.get_outputs_async()  # it is running
    assert doomed_client.proc_manager is not None
    os.kill(doomed_client.proc_manager.processes[0].pid, signal.SIGKILL)
    start = time.monotonic()
    _, death = await outputs_until_dead(doomed_client)
    assert time.monotonic() - start < 5
    assert "killed by signal SIGKILL" in str(death)
    assert "thinker" in str(death)
    assert type(death.__cause__).__name__ == "EngineDeadError"
    with pytest.raises(StageCoreDeadError):
        await add_prompt(doomed_client, "after-death", prompt="a red cat")
    with pytest.raises(StageCoreDeadError):
        async with asyncio.timeout(10):
            await doomed_client.collective_rpc_async("get_supported_tasks")
    with pytest.raises(StageCoreDeadError):
        doomed_client.check_health()


@pytest.mark.asyncio(loop_scope="function")
async def test_sigint_answers_in_flight_requests_and_exits_cleanly(
    doomed_client: LLMClient,
) -> None:
    params = {"max_tokens": 400, "ignore_eos": True}
    await add_prompt(doomed_client, "in-flight", prompt="a red cat", params=params)
    result = StageLLMResult("in-flight")
    for output in (await doomed_client.get_outputs_async()).outputs:
        result.add(output)
    assert doomed_client.proc_manager is not None
    core = doomed_client.proc_manager.processes[0]
    # SIGTERM is what every shutdown sends (see stop_and_check_gone); SIGINT is a Ctrl-C.
    os.kill(core.pid, signal.SIGINT)
    start = time.monotonic()
    outputs, death = await outputs_until_dead(doomed_client)
    assert "exited with exit code 0" in str(death)
    for output in outputs:
        result.add(output)
    assert result.aborted
    assert time.monotonic() - start < 5
    assert core.exitcode == 0


async def test_core_exits_when_its_parent_is_killed(llm_path: str) -> None:
    script = (
        "import sys\n"
        "from omni_runtime.config import StageConfig\n"
        "from omni_runtime.engine.stage.stage_llm_core_client import start_stage_llm_client\n"
        "if __name__ == '__main__':\n"
        f"    stage = StageConfig.model_validate({TEXT_STAGE.model_dump()!r})\n"
        f"    client = start_stage_llm_client(stage, {llm_path!r})\n"
        "    print('core pid', client.proc_manager.processes[0].pid, flush=True)\n"
        "    sys.stdin.read()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert parent.stdout is not None
        # vLLM logs to stdout too.
        line = ""
        while not line.startswith("core pid "):
            line = parent.stdout.readline()
            assert line, "the parent exited before its core was ready"
        core = psutil.Process(int(line.split()[-1]))
        descendants = psutil.Process(parent.pid).children(recursive=True)
        assert core in descendants
        parent.kill()
        parent.wait(timeout=10)
        # The core (and multiprocessing's resource tracker) must not outlive the parent.
        _, alive = psutil.wait_procs(descendants, timeout=15)
        assert not alive
    finally:
        parent.kill()
        parent.wait()


async def test_startup_failure_is_reported_and_leaves_nothing(
    llm_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = set(children())
    # A KV cache larger than the machine: the core fails while building the engine.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "100000")
    with pytest.raises(StageCoreStartupError, match="exited with exit code 1") as info:
        start_stage_llm_client(TEXT_STAGE, llm_path)
    # The core's own reason, not only "see the logs".
    assert "(ValueError: Available memory" in str(info.value)
    assert "VLLM_CPU_KVCACHE_SPACE" in str(info.value)
    assert set(children()) - before == set()  # nothing it started survived


async def test_an_engine_that_cannot_run_a_request_is_not_ready_and_says_why(
    llm_path: str, tmp_path: Path
) -> None:
    """The tiny LLM with 8 heads of 16 instead of 4 of 32 (the same weights' shapes): vLLM's
    CPU attention has no kernel for head size 16, which its first forward pass finds.
    Without the warm-up the stage said ready and its first request killed the engine."""
    model = tmp_path / "head-dim-16"
    shutil.copytree(llm_path, model)
    config = json.loads((model / "config.json").read_text())
    config.update(num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    (model / "config.json").write_text(json.dumps(config))
    before = set(children())
    with pytest.raises(StageCoreStartupError) as info:
        start_stage_llm_client(TEXT_STAGE, str(model))
    assert "StageWarmUpError: the engine cannot run a request" in str(info.value)
    assert "head_dim=16" in str(info.value)
    assert set(children()) - before == set()


async def test_startup_past_its_deadline_is_reported_and_leaves_nothing(llm_path: str) -> None:
    before = set(children())
    start = time.monotonic()
    # Importing vLLM alone takes longer than this.
    with pytest.raises(StageCoreStartupError, match="not ready within 1 s during startup") as e:
        start_stage_llm_client(TEXT_STAGE, llm_path, startup_timeout=1.0)
    assert time.monotonic() - start < 30
    # The core stopped by the deadline is reaped (no zombie child), and before the error
    # is made, so it says how the core ended.
    assert set(children()) - before == set()
    assert "StageLLMCoreProc" in str(e.value)
    assert "running" not in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("fields", "model", "error"),
    [
        ({}, "/nowhere/model", "model: /nowhere/model is not a directory"),
        (
            {"maxModelLen": 100000},
            None,
            "stage 'thinker': vLLM refuses its engine configuration: User-specified "
            "max_model_len (100000) is greater than the derived max_model_len",
        ),
    ],
)
async def test_a_stage_vllm_cannot_run_is_refused_before_anything_starts(
    llm_path: str, fields: dict[str, Any], model: str | None, error: str
) -> None:
    before = set(children())
    with pytest.raises(StageLLMConfigError) as info:
        start_stage_llm_client(stage(**fields), model or llm_path)
    assert str(info.value).startswith(error)
    assert "\n" not in str(info.value)
    assert set(children()) - before == set()


async def test_insecure_serialization_is_refused_before_anything_starts(
    llm_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    before = set(children())
    with pytest.raises(RuntimeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION is set"):
        start_stage_llm_client(TEXT_STAGE, llm_path)
    assert set(children()) - before == set()  # nothing it started survived


@pytest.fixture
async def data_parallel_client(llm_path: str) -> AsyncIterator[LLMClient]:
    start = time.monotonic()
    client = start_stage_llm_client(stage(dataParallelSize=2), llm_path)
    print(f"\ndata parallel 2: started in {time.monotonic() - start:.1f} s")
    yield client
    stop_and_check_gone(client)


@pytest.mark.asyncio(loop_scope="function")
async def test_data_parallel_client_serves_across_both_engines(
    data_parallel_client: LLMClient,
) -> None:
    assert isinstance(data_parallel_client, DPLBStageLLMCoreClient)
    assert len(set(core_pids(data_parallel_client))) == 2
    ids = [f"dp-{index}" for index in range(8)]
    for request_id in ids:
        await add_prompt(
            data_parallel_client,
            request_id,
            prompt="a red cat",
            params={"max_tokens": 8, "ignore_eos": True, "temperature": 0.0},
        )
    results = await collect_results(data_parallel_client, ids, timeout=DEADLINE_S)
    assert {result.engine_index for result in results.values()} == {0, 1}
    assert all(len(result.token_ids) == 8 for result in results.values())
    # Both engines hold the same weights: the same greedy tokens wherever a request ran.
    assert len({tuple(result.token_ids) for result in results.values()}) == 1
    # Refused duplicate ids leave the first request where the client can still abort it:
    # the core's refusals do not end the id's binding to it, even one the core refuses for
    # another reason as well.
    params = {"max_tokens": 400, "ignore_eos": True}
    await add_prompt(data_parallel_client, "dp-twice", prompt="a red cat", params=params)
    await add_prompt(data_parallel_client, "dp-twice", prompt="a red cat", params=params)
    invalid = _core_request(data_parallel_client, "dp-twice", max_tokens=0)
    await data_parallel_client.add_request_async(invalid)
    finals: list[Any] = []
    async with asyncio.timeout(DEADLINE_S):
        while len(finals) < 3:
            for output in (await data_parallel_client.get_outputs_async()).outputs:
                if output.finish_reason is None:
                    continue
                finals.append(output)
                if len(finals) == 2:
                    await data_parallel_client.abort_requests_async(["dp-twice"])
    assert [output.finish_reason for output in finals] == [FinishReason.ERROR] * 2 + [
        FinishReason.ABORT
    ]
    assert [output.error.code for output in finals[:2]] == [StageErrorCode.REQUEST_ID_IN_FLIGHT] * 2
    assert sum(data_parallel_client.engine_inflight.values()) == 0
    assert data_parallel_client.reqs_in_flight == {}


async def test_result_joins_deltas_in_order_and_ends_at_the_last() -> None:
    result = StageLLMResult("r")
    result.add(StageLLMCoreOutput("r", [4]))
    result.add(StageLLMCoreOutput("r", [9]), engine_index=1)
    result.add(StageLLMCoreOutput("r", [2], finish_reason=FinishReason.STOP))
    assert (result.token_ids, result.num_outputs, result.finished) == ([4, 9, 2], 3, True)
    with pytest.raises(ValueError, match="after its last"):
        result.add(StageLLMCoreOutput("r", [1]))
