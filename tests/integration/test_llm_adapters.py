"""LoRA adapters on an LLM stage for real: vLLM's CPU build serving the tiny Qwen2 with
PEFT adapters (omni_runtime.tiny_models.llm_lora) through StageLLMFrontend, checked token
for token against PEFT's merged models in transformers."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from vllm.lora.request import LoRARequest
from vllm.v1.engine import FinishReason

from omni_runtime.config import PipelineConfig, StageConfig
from omni_runtime.connectors import StageConnectors
from omni_runtime.engine.stage.stage_core_types import (
    StageAdapter,
    StageErrorCode,
    StageServerOutput,
    StageServerRequest,
)
from omni_runtime.engine.stage.stage_llm_core_client import (
    StageLLMCoreClient,
    lora_int_id,
    start_stage_llm_client,
)
from omni_runtime.stage_server.llm_frontend import StageLLMFrontend
from omni_runtime.tiny_models import LLM_SUBDIR
from omni_runtime.tiny_models.llm_lora import ATTN_LORA, MLP_LORA, WIDE_LORA, build_llm_loras
from omni_testkit.stage_outputs import add_prompt, collect_results

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = ["a red cat", "draw a blue river under the moon", "paint a portrait of a dog"]
DEADLINE_S = 60
TOKENS = 16
# Adapters made broken from a good one (loras fixture), beside the good ones.
TARGETS_MISSING = "no-such-targets"
CORRUPT = "corrupt"
MISSING = "missing"


def stage(**fields: Any) -> StageConfig:
    # float32 so that vLLM and transformers compute the same numbers.
    return StageConfig.model_validate(
        {
            "stageId": 0,
            "name": "chat",
            "type": "llm",
            "dtype": "float32",
            "enforceEager": True,
            "maxModelLen": 512,
            "defaultSamplingParams": {"temperature": 0.0, "max_tokens": TOKENS},
            **fields,
        }
    )


@pytest.fixture(scope="module", autouse=True)
def engine_environment(llm_engine_environment: None) -> None:
    """vLLM's CPU environment for this module's cores (tests/conftest.py)."""


@pytest.fixture(scope="module")
def llm_path(tiny_models: Path) -> Path:
    return tiny_models / LLM_SUBDIR


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory, llm_path: Path) -> dict[str, Path]:
    """The tiny LLM's adapters by name, good and broken (every broken one names a path)."""
    root = tmp_path_factory.mktemp("loras")
    paths = build_llm_loras(root, llm_path)
    # Target modules the Qwen2 model does not have (GPT-2's name for its attention).
    targets = root / TARGETS_MISSING
    targets.mkdir()
    config = json.loads((paths[ATTN_LORA] / "adapter_config.json").read_text())
    config["target_modules"] = ["c_attn", "v_proj"]
    (targets / "adapter_config.json").write_text(json.dumps(config))
    weights = load_file(paths[ATTN_LORA] / "adapter_model.safetensors")
    renamed = {name.replace(".q_proj.", ".c_attn."): tensor for name, tensor in weights.items()}
    assert renamed != weights
    save_file(renamed, targets / "adapter_model.safetensors")
    # A weights file that is not safetensors at all (its header length reads as absurd).
    corrupt = root / CORRUPT
    shutil.copytree(paths[ATTN_LORA], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\xff" * 64 + b"not safetensors")
    return {**paths, TARGETS_MISSING: targets, CORRUPT: corrupt, MISSING: root / "nowhere"}


def pipeline_with(
    llm_path: Path, loras: dict[str, Path], stage_config: StageConfig
) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "model": str(llm_path),
            "stages": [stage_config],
            "adapters": [
                {"name": name, "stage": stage_config.name, "source": str(path)}
                for name, path in loras.items()
            ],
        }
    )


LORA_STAGE = stage(maxLoras=2)


@pytest.fixture(scope="module")
def pipeline(llm_path: Path, loras: dict[str, Path]) -> PipelineConfig:
    return pipeline_with(llm_path, loras, LORA_STAGE)


@pytest.fixture(scope="module")
def lora_client(llm_path: Path, pipeline: PipelineConfig) -> Iterator[StageLLMCoreClient]:
    capacity = pipeline.adapter_capacity(LORA_STAGE)
    assert capacity == 2
    client = start_stage_llm_client(LORA_STAGE, str(llm_path), adapter_capacity=capacity)
    assert isinstance(client, StageLLMCoreClient)
    yield client
    client.shutdown()


@pytest.fixture
def frontend(pipeline: PipelineConfig, lora_client: StageLLMCoreClient) -> StageLLMFrontend:
    """A frontend of its own (an empty adapter mirror) on the module's engine."""
    return StageLLMFrontend(pipeline, LORA_STAGE, lora_client, StageConnectors({}))


@pytest.fixture(scope="module")
def reference(
    llm_path: Path, loras: dict[str, Path]
) -> Callable[[str | None, list[int]], list[int]]:
    """PEFT's answer: greedy tokens of the base model merged with an adapter (None: the
    base model alone), as transformers generates them."""
    models: dict[str | None, Any] = {}

    def greedy(adapter: str | None, prompt_ids: list[int]) -> list[int]:
        if adapter not in models:
            model = AutoModelForCausalLM.from_pretrained(llm_path, dtype=torch.float32)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, loras[adapter]).merge_and_unload()
            models[adapter] = model.eval()
        with torch.no_grad():
            out = models[adapter].generate(
                torch.tensor([prompt_ids]), max_new_tokens=TOKENS, do_sample=False
            )
        tokens: list[int] = out[0, len(prompt_ids) :].tolist()
        return tokens

    return greedy


def prompt_ids(client: StageLLMCoreClient, prompt: str) -> list[int]:
    return list(client.request_builder.build("ids", prompt=prompt).prompt_token_ids or ())


def server_request(
    request_id: str, prompt: str, adapter: str | None, loras: dict[str, Path]
) -> StageServerRequest:
    chosen = None if adapter is None else StageAdapter(adapter, str(loras[adapter]))
    # ignore_eos: every request runs its TOKENS steps, so that concurrent ones overlap.
    params = {"ignore_eos": True}
    return StageServerRequest(request_id=request_id, prompt=prompt, params=params, adapter=chosen)


async def collect(
    frontend: StageLLMFrontend, request_ids: list[str]
) -> tuple[dict[str, list[StageServerOutput]], list[set[str]]]:
    """Each request's outputs until all have finished, and which requests each message of
    the core held (one message per engine step)."""
    outputs: dict[str, list[StageServerOutput]] = {request_id: [] for request_id in request_ids}
    steps: list[set[str]] = []
    async with asyncio.timeout(DEADLINE_S):
        while not all(got and got[-1].finished for got in outputs.values()):
            batch = await frontend.next_outputs()
            steps.append({output.request_id for output in batch})
            for output in batch:
                outputs[output.request_id].append(output)
    return outputs, steps


def tokens_of(outputs: list[StageServerOutput]) -> list[int]:
    assert outputs[-1].error is None, outputs[-1].error
    assert outputs[-1].finish_reason == "length"
    return [token for output in outputs for token in output.token_ids]


async def generate(
    frontend: StageLLMFrontend,
    request_id: str,
    prompt: str,
    adapter: str | None,
    loras: dict[str, Path],
) -> list[int]:
    assert await frontend.add(server_request(request_id, prompt, adapter, loras)) == []
    outputs, _ = await collect(frontend, [request_id])
    return tokens_of(outputs[request_id])


async def test_an_adapter_generates_what_pefts_merged_model_does(
    frontend: StageLLMFrontend,
    lora_client: StageLLMCoreClient,
    loras: dict[str, Path],
    reference: Callable[[str | None, list[int]], list[int]],
) -> None:
    for index, name in enumerate((ATTN_LORA, MLP_LORA)):
        prompt = PROMPTS[index]
        ids = prompt_ids(lora_client, prompt)
        tokens = await generate(frontend, f"one-{name}", prompt, name, loras)
        assert tokens == reference(name, ids), name
        # The adapter changed what the model says (else the check above proves little).
        assert tokens != reference(None, ids), name
    assert frontend.held_adapters == [ATTN_LORA, MLP_LORA]


async def test_requests_with_different_adapters_share_batches_and_get_their_own(
    frontend: StageLLMFrontend,
    lora_client: StageLLMCoreClient,
    loras: dict[str, Path],
    reference: Callable[[str | None, list[int]], list[int]],
) -> None:
    prompt = PROMPTS[1]
    ids = prompt_ids(lora_client, prompt)
    # One after the other first: on vLLM's CPU build the engine's adapter slots then all
    # hold one, the last included, which is where its kernels look for a request without
    # an adapter (lora_needs_zero_adapter).
    for name in (ATTN_LORA, MLP_LORA):
        assert await generate(frontend, f"alone-{name}", prompt, name, loras) == reference(
            name, ids
        )
    chosen = {"with-attn": ATTN_LORA, "with-mlp": MLP_LORA, "with-none": None}
    added = await asyncio.gather(
        *(
            frontend.add(server_request(request_id, prompt, adapter, loras))
            for request_id, adapter in chosen.items()
        )
    )
    assert added == [[], [], []]
    outputs, steps = await collect(frontend, list(chosen))
    for request_id, adapter in chosen.items():
        assert tokens_of(outputs[request_id]) == reference(adapter, ids), request_id
    # vLLM's multi-LoRA: both adapters' requests in one engine step, not one after another.
    assert any({"with-attn", "with-mlp"} <= step for step in steps)
    assert {tuple(tokens_of(outputs[r])) for r in chosen} == {
        tuple(reference(a, ids)) for a in chosen.values()
    }
    assert len({tuple(tokens_of(got)) for got in outputs.values()}) == 3


async def test_concurrent_first_requests_of_an_adapter_wait_on_one_load(
    frontend: StageLLMFrontend,
    lora_client: StageLLMCoreClient,
    loras: dict[str, Path],
    reference: Callable[[str | None, list[int]], list[int]],
) -> None:
    loads = len(lora_client.adapter_load_log)
    request_ids = [f"first-{index}" for index in range(3)]
    added = await asyncio.gather(
        *(
            frontend.add(server_request(request_id, PROMPTS[2], MLP_LORA, loras))
            for request_id in request_ids
        )
    )
    assert added == [[], [], []]
    outputs, _ = await collect(frontend, request_ids)
    expected = reference(MLP_LORA, prompt_ids(lora_client, PROMPTS[2]))
    assert [tokens_of(outputs[request_id]) for request_id in request_ids] == [expected] * 3
    assert [load.name for load in lora_client.adapter_load_log[loads:]] == [MLP_LORA]
    # Held now: the next request loads nothing.
    assert await generate(frontend, "first-again", PROMPTS[2], MLP_LORA, loras) == expected
    assert len(lora_client.adapter_load_log) == loads + 1


async def test_least_recently_used_adapter_is_evicted_at_capacity(
    llm_path: Path,
    loras: dict[str, Path],
    reference: Callable[[str | None, list[int]], list[int]],
) -> None:
    single = stage(maxLoras=1)
    pipeline = pipeline_with(llm_path, loras, single)
    assert pipeline.adapter_capacity(single) == 1
    client = start_stage_llm_client(single, str(llm_path), adapter_capacity=1)
    assert isinstance(client, StageLLMCoreClient)
    try:
        frontend = StageLLMFrontend(pipeline, single, client, StageConnectors({}))
        ids = prompt_ids(client, PROMPTS[0])
        for index, name in enumerate((ATTN_LORA, MLP_LORA, ATTN_LORA)):
            tokens = await generate(frontend, f"lru-{index}", PROMPTS[0], name, loras)
            assert tokens == reference(name, ids), (index, name)
            assert frontend.held_adapters == [name]
        # attn was evicted for mlp, so its second request loaded it again.
        assert [load.name for load in client.adapter_load_log] == [ATTN_LORA, MLP_LORA, ATTN_LORA]
        assert frontend.held_adapters == [ATTN_LORA]
    finally:
        client.shutdown()


@pytest.mark.parametrize(
    ("name", "named", "why"),
    [
        (WIDE_LORA, "", "LoRA rank 32 is greater than max_lora_rank 16"),
        (TARGETS_MISSING, "", "c_attn"),
        (CORRUPT, "adapter_model.safetensors", "not a readable safetensors file"),
        (MISSING, "", "no such file or directory"),
    ],
)
async def test_a_bad_adapter_refuses_its_request_and_the_engine_serves_on(
    frontend: StageLLMFrontend,
    lora_client: StageLLMCoreClient,
    loras: dict[str, Path],
    reference: Callable[[str | None, list[int]], list[int]],
    name: str,
    named: str,
    why: str,
) -> None:
    refused = await frontend.add(server_request(f"bad-{name}", PROMPTS[0], name, loras))
    assert len(refused) == 1
    error = refused[0].error
    assert error is not None
    assert (error.code, error.param, refused[0].finish_reason) == (
        StageErrorCode.BAD_REQUEST,
        "model",
        "error",
    )
    assert str(loras[name] / named).rstrip("/") in error.message
    assert why in error.message
    assert frontend.in_flight == 0
    assert name not in frontend.held_adapters
    lora_client.check_health()
    ids = prompt_ids(lora_client, PROMPTS[0])
    good = await generate(frontend, f"after-{name}", PROMPTS[0], ATTN_LORA, loras)
    assert good == reference(ATTN_LORA, ids)
    assert await generate(frontend, f"base-after-{name}", PROMPTS[0], None, loras) == reference(
        None, ids
    )


@pytest.mark.parametrize(
    ("name", "why"),
    [(CORRUPT, "Error while deserializing header"), (WIDE_LORA, "greater than max_lora_rank")],
)
async def test_the_core_refuses_a_request_whose_adapter_does_not_load(
    lora_client: StageLLMCoreClient,
    loras: dict[str, Path],
    reference: Callable[[str | None, list[int]], list[int]],
    name: str,
    why: str,
) -> None:
    # Past the client's own load (a caller of the core's wire protocol): the core loads the
    # adapter before the request joins a batch, and refuses the request when that fails.
    lora = LoRARequest(f"raw-{name}", lora_int_id(f"raw-{name}"), str(loras[name]))
    request = lora_client.request_builder.build("raw-bad", prompt=PROMPTS[0], lora_request=lora)
    await lora_client.add_request_async(request)
    result = (await collect_results(lora_client, ["raw-bad"], timeout=DEADLINE_S))["raw-bad"]
    assert result.finish_reason == FinishReason.ERROR
    assert result.error is not None
    assert result.error.code == StageErrorCode.BAD_REQUEST
    assert str(loras[name]) in result.error.message
    assert why in result.error.message
    good = LoRARequest("raw-good", lora_int_id("raw-good"), str(loras[ATTN_LORA]))
    params = {"ignore_eos": True}
    request = lora_client.request_builder.build(
        "raw-good", prompt=PROMPTS[0], params=params, lora_request=good
    )
    await lora_client.add_request_async(request)
    result = (await collect_results(lora_client, ["raw-good"], timeout=DEADLINE_S))["raw-good"]
    assert result.error is None
    assert result.token_ids == reference(ATTN_LORA, prompt_ids(lora_client, PROMPTS[0]))


async def test_an_abort_during_the_adapters_load_answers_the_request_as_aborted(
    frontend: StageLLMFrontend, loras: dict[str, Path]
) -> None:
    adding = asyncio.create_task(
        frontend.add(server_request("aborted-loading", PROMPTS[0], ATTN_LORA, loras))
    )
    # One turn of the loop: the task runs until it waits on the adapter's load.
    await asyncio.sleep(0)
    assert frontend.in_flight == 1
    await frontend.abort(["aborted-loading"])
    (answer,) = await adding
    assert (answer.finished, answer.finish_reason, answer.error) == (True, "abort", None)
    assert frontend.in_flight == 0


async def test_a_stage_that_takes_no_adapters_refuses_them(
    llm_path: Path, lora_client: StageLLMCoreClient, loras: dict[str, Path]
) -> None:
    plain = stage()
    pipeline = PipelineConfig.model_validate({"model": str(llm_path), "stages": [plain]})
    assert pipeline.adapter_capacity(plain) == 0
    frontend = StageLLMFrontend(pipeline, plain, lora_client, StageConnectors({}))
    assert frontend.adapters is None
    loads = len(lora_client.adapter_load_log)
    (refused,) = await frontend.add(server_request("no-adapters", PROMPTS[0], ATTN_LORA, loras))
    assert refused.error is not None
    assert (refused.error.code, refused.error.param) == (StageErrorCode.BAD_REQUEST, "model")
    assert "takes no LoRA adapters" in refused.error.message
    assert len(lora_client.adapter_load_log) == loads


async def test_the_client_alone_runs_a_request_with_an_adapter(
    lora_client: StageLLMCoreClient,
    loras: dict[str, Path],
    reference: Callable[[str | None, list[int]], list[int]],
) -> None:
    params = {"ignore_eos": True}
    adapter = StageAdapter(MLP_LORA, str(loras[MLP_LORA]))
    await add_prompt(lora_client, "client-mlp", prompt=PROMPTS[2], params=params, adapter=adapter)
    missing = StageAdapter(MISSING, str(loras[MISSING]))
    await add_prompt(lora_client, "client-missing", prompt=PROMPTS[2], adapter=missing)
    results = await collect_results(lora_client, ["client-mlp", "client-missing"], DEADLINE_S)
    assert results["client-mlp"].error is None
    assert results["client-mlp"].token_ids == reference(
        MLP_LORA, prompt_ids(lora_client, PROMPTS[2])
    )
    refused = results["client-missing"].error
    assert refused is not None
    assert (refused.code, refused.param) == (StageErrorCode.BAD_REQUEST, "model")
    assert str(loras[MISSING]) in refused.message
