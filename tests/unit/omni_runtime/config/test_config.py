"""Unit tests of omni_runtime.config: the pipeline schema shared by runtime and operator."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_runtime.config import (
    PipelineConfig,
    PipelineConfigError,
    StageConfig,
    dump_pipeline,
    load_pipeline,
)
from omni_runtime.families import family_of_model_name

BAGEL_MODEL = "ByteDance-Seed/BAGEL-7B-MoT"

# vllm_omni/deploy/bagel.yaml exactly as printed in the seed pull request.
BAGEL_YAML = """\
async_chunk: false

stages:
  - stage_id: 0
    max_num_batched_tokens: 32768
    max_num_seqs: 3
    gpu_memory_utilization: 0.45
    trust_remote_code: true
    enable_prefix_caching: false
    devices: "0"
    default_sampling_params:
      temperature: 0.4
      top_p: 0.9
      top_k: 1
      max_tokens: 2048
      seed: 52
      detokenize: true
      repetition_penalty: 1.05

  - stage_id: 1
    max_num_batched_tokens: 32768
    max_num_seqs: 1
    enforce_eager: true
    trust_remote_code: true
    enable_prefix_caching: false
    devices: "0"
    input_connectors:
      from_stage_0: shared_memory_connector
    default_sampling_params:
      seed: 52

connectors:
  shared_memory_connector:
    name: SharedMemoryConnector

  rdma_connector:
    name: MooncakeTransferEngineConnector
    extra:
      host: "auto"
      zmq_port: 50051
      protocol: "rdma"
      device_name: ""
      memory_pool_size: 4294967296
      memory_pool_device: "cpu"
"""

BAGEL_CAMEL: dict[str, Any] = {
    "asyncChunk": False,
    "stages": [
        {
            "stageId": 0,
            "maxNumBatchedTokens": 32768,
            "maxNumSeqs": 3,
            "gpuMemoryUtilization": 0.45,
            "trustRemoteCode": True,
            "enablePrefixCaching": False,
            "devices": "0",
            "defaultSamplingParams": {
                "temperature": 0.4,
                "top_p": 0.9,
                "top_k": 1,
                "max_tokens": 2048,
                "seed": 52,
                "detokenize": True,
                "repetition_penalty": 1.05,
            },
        },
        {
            "stageId": 1,
            "maxNumBatchedTokens": 32768,
            "maxNumSeqs": 1,
            "enforceEager": True,
            "trustRemoteCode": True,
            "enablePrefixCaching": False,
            "devices": "0",
            "inputConnectors": {"from_stage_0": "shared_memory_connector"},
            "defaultSamplingParams": {"seed": 52},
        },
    ],
    "connectors": {
        "shared_memory_connector": {"name": "SharedMemoryConnector"},
        "rdma_connector": {
            "name": "MooncakeTransferEngineConnector",
            "extra": {
                "host": "auto",
                "zmq_port": 50051,
                "protocol": "rdma",
                "device_name": "",
                "memory_pool_size": 4294967296,
                "memory_pool_device": "cpu",
            },
        },
    },
}


def seed_mapping() -> dict[str, Any]:
    """The seed's bagel.yaml, parsed, as a fresh mapping a test may change."""
    data: dict[str, Any] = yaml.safe_load(BAGEL_YAML)
    return copy.deepcopy(data)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def errors_of(source: Any, **kwargs: Any) -> PipelineConfigError:
    with pytest.raises(PipelineConfigError) as caught:
        load_pipeline(source, **kwargs)
    return caught.value


# --- the seed's deploy YAML -------------------------------------------------------------


def test_seed_bagel_yaml_loads_as_printed(tmp_path: Path) -> None:
    config = load_pipeline(write(tmp_path, "bagel.yaml", BAGEL_YAML), model=BAGEL_MODEL)

    assert config.model == BAGEL_MODEL
    assert config.async_chunk is False
    thinker, dit = config.stages
    assert (thinker.stage_id, thinker.type, thinker.name) == (0, "llm", "thinker")
    assert (dit.stage_id, dit.type, dit.name) == (1, "diffusion", "dit")
    assert thinker.output == "text"
    assert dit.output is None
    assert thinker.devices == dit.devices == "0"
    assert thinker.gpu_ids == dit.gpu_ids == (0,)
    assert (thinker.max_num_seqs, dit.max_num_seqs) == (3, 1)
    assert thinker.max_num_batched_tokens == dit.max_num_batched_tokens == 32768
    assert thinker.gpu_memory_utilization == 0.45
    assert dit.gpu_memory_utilization is None
    assert (thinker.enforce_eager, dit.enforce_eager) == (None, True)
    assert thinker.trust_remote_code is True
    assert dit.trust_remote_code is True
    assert thinker.enable_prefix_caching is False
    assert thinker.input_connectors == {}
    assert dit.input_connectors == {"from_stage_0": "shared_memory_connector"}
    assert dit.input_stages == {0: "shared_memory_connector"}
    assert thinker.default_sampling_params == {
        "temperature": 0.4,
        "top_p": 0.9,
        "top_k": 1,
        "max_tokens": 2048,
        "seed": 52,
        "detokenize": True,
        "repetition_penalty": 1.05,
    }
    assert dit.default_sampling_params == {"seed": 52}
    assert set(config.connectors) == {"shared_memory_connector", "rdma_connector"}
    assert config.connectors["shared_memory_connector"].name == "SharedMemoryConnector"
    assert config.connectors["shared_memory_connector"].extra == {}
    rdma = config.connectors["rdma_connector"]
    assert rdma.name == "MooncakeTransferEngineConnector"
    assert rdma.extra == {
        "host": "auto",
        "zmq_port": 50051,
        "protocol": "rdma",
        "device_name": "",
        "memory_pool_size": 4294967296,
        "memory_pool_device": "cpu",
    }
    assert config.router.policy == "round-robin"
    assert config.router.port == 8000


def test_seed_mapping_loads_like_the_file(tmp_path: Path) -> None:
    from_file = load_pipeline(write(tmp_path, "bagel.yaml", BAGEL_YAML), model=BAGEL_MODEL)
    assert load_pipeline(seed_mapping(), model=BAGEL_MODEL) == from_file


def test_seed_loads_from_json_file(tmp_path: Path) -> None:
    path = write(tmp_path, "bagel.json", json.dumps(seed_mapping()))
    assert load_pipeline(path, model=BAGEL_MODEL) == load_pipeline(
        seed_mapping(), model=BAGEL_MODEL
    )


def test_camel_case_equals_snake_case() -> None:
    camel = load_pipeline(BAGEL_CAMEL, model=BAGEL_MODEL)
    snake = load_pipeline(seed_mapping(), model=BAGEL_MODEL)
    assert camel == snake
    assert camel.stages[1].input_connectors == {"from_stage_0": "shared_memory_connector"}


def test_loading_does_not_change_the_callers_mapping() -> None:
    data = seed_mapping()
    load_pipeline(data, model=BAGEL_MODEL)
    assert data == seed_mapping()


# --- dump ---------------------------------------------------------------------------------


def test_dump_is_camel_case_json_and_round_trips() -> None:
    config = load_pipeline(seed_mapping(), model=BAGEL_MODEL)
    dumped = dump_pipeline(config)

    assert json.loads(json.dumps(dumped)) == dumped
    assert load_pipeline(dumped) == config
    assert dumped["model"] == BAGEL_MODEL
    assert dumped["asyncChunk"] is False
    stage0, stage1 = dumped["stages"]
    assert stage0["stageId"] == 0
    assert "stage_id" not in stage0
    assert stage0["type"] == "llm"
    assert stage0["output"] == "text"
    assert stage0["maxNumSeqs"] == 3
    # Free-form dicts keep their keys as written; only field names are camelCase.
    assert stage0["defaultSamplingParams"]["top_p"] == 0.9
    assert dumped["connectors"]["rdma_connector"]["extra"]["zmq_port"] == 50051
    assert stage1["inputConnectors"] == {"from_stage_0": "shared_memory_connector"}
    # Unset optional fields are left out, not written as null.
    assert "output" not in stage1
    assert "maxModelLen" not in stage0
    assert dumped["router"] == {"port": 8000, "policy": "round-robin"}


def test_round_trip_keeps_null_values_in_free_dicts() -> None:
    data = seed_mapping()
    data["stages"][0]["default_sampling_params"]["stop"] = None
    config = load_pipeline(data, model=BAGEL_MODEL)
    dumped = dump_pipeline(config)
    assert dumped["stages"][0]["defaultSamplingParams"]["stop"] is None
    assert load_pipeline(dumped) == config


# --- model and topology ---------------------------------------------------------------------


def test_model_given_apart_overrides_the_files() -> None:
    data = {**seed_mapping(), "model": "/somewhere/else"}
    assert load_pipeline(data, model=BAGEL_MODEL).model == BAGEL_MODEL
    assert load_pipeline(data | {"model": "/models/bagel"}).model == "/models/bagel"


def test_missing_model_is_asked_for() -> None:
    error = errors_of(seed_mapping())
    assert [path for path, _ in error.issues] == ["model"]
    assert "model path or hub id" in error.issues[0][1]


@pytest.mark.parametrize(
    "model",
    [
        "ByteDance-Seed/BAGEL-7B-MoT",
        "/models/bagel-7b-mot",
        "/models/bagel-7b-mot/",
        "bagel",
        r"C:\models\Bagel-7B",
    ],
)
def test_bagel_topology_matches_by_last_path_component(model: str) -> None:
    family = family_of_model_name(model)
    assert family is not None
    assert family.name == "bagel"
    config = load_pipeline(seed_mapping(), model=model)
    assert [(s.type, s.name) for s in config.stages] == [("llm", "thinker"), ("diffusion", "dit")]


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-7B-Instruct", "/models/qwen-image/sdxl", ""])
def test_other_models_have_no_topology(model: str) -> None:
    assert family_of_model_name(model) is None


def test_unknown_model_without_types_asks_for_type() -> None:
    error = errors_of(seed_mapping(), model="stabilityai/sdxl-turbo")
    paths = [path for path, _ in error.issues]
    assert paths == ["stages[0].type", "stages[1].type"]
    for _, message in error.issues:
        assert "set type to one of: llm, diffusion" in message


def test_unknown_model_with_types_loads_and_names_default_to_stage_id() -> None:
    data = seed_mapping()
    data["stages"][0]["type"] = "llm"
    data["stages"][1]["type"] = "diffusion"
    config = load_pipeline(data, model="stabilityai/sdxl-turbo")
    assert [(s.type, s.name) for s in config.stages] == [
        ("llm", "stage-0"),
        ("diffusion", "stage-1"),
    ]


def test_explicit_type_and_name_win_over_the_topology() -> None:
    data = seed_mapping()
    data["stages"][0].update(type="llm", name="planner")
    data["stages"][1].update(name="painter")
    config = load_pipeline(data, model=BAGEL_MODEL)
    assert [(s.type, s.name) for s in config.stages] == [
        ("llm", "planner"),
        ("diffusion", "painter"),
    ]


def test_a_bagel_pipeline_is_its_thinker_then_its_dit() -> None:
    data = seed_mapping()
    data["stages"][0].update(type="diffusion")
    data["stages"][1].update(type="llm")
    with pytest.raises(PipelineConfigError, match="a bagel pipeline is two stages"):
        load_pipeline(data, model=BAGEL_MODEL)
    assert load_pipeline(seed_mapping(), model=BAGEL_MODEL).family == "bagel"


def test_only_a_bagel_thinker_thinks() -> None:
    data = seed_mapping()
    data["stages"][0]["think"] = True
    thinking = load_pipeline(data, model=BAGEL_MODEL)
    assert thinking.stages[0].think is True
    data["stages"][1]["think"] = True
    with pytest.raises(PipelineConfigError, match=r"stages\[1\]\.think: only the encoder"):
        load_pipeline(data, model=BAGEL_MODEL)
    other = {
        "model": "m",
        "stages": [{"stageId": 0, "name": "llm", "type": "llm", "think": True}],
    }
    with pytest.raises(PipelineConfigError, match=r"stages\[0\]\.think: only the encoder"):
        load_pipeline(other)


# --- field normalisation -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "normalised", "gpu_ids"),
    [
        ("0", "0", (0,)),
        (" 0 , 1 ", "0,1", (0, 1)),
        ("3,1", "3,1", (3, 1)),
        ("01", "1", (1,)),
        (2, "2", (2,)),
        ("cpu", "cpu", ()),
        ("CPU", "cpu", ()),
        ("", "cpu", ()),
    ],
)
def test_devices_are_normalised(devices: object, normalised: str, gpu_ids: tuple[int, ...]) -> None:
    data = seed_mapping()
    data["stages"][0]["devices"] = devices
    stage = load_pipeline(data, model=BAGEL_MODEL).stages[0]
    assert stage.devices == normalised
    assert stage.gpu_ids == gpu_ids


def test_stage_defaults() -> None:
    stage = StageConfig.model_validate({"stageId": 4, "type": "llm"})
    assert stage.name == "stage-4"
    assert stage.devices == "cpu"
    assert stage.gpu_ids == ()
    assert (stage.replicas, stage.tensor_parallel_size, stage.data_parallel_size) == (1, 1, 1)
    assert stage.output == "text"
    assert stage.trust_remote_code is False
    assert stage.engine_args == {}


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("round-robin", "round-robin"),
        ("least-outstanding-requests", "least-outstanding-requests"),
        ("least_outstanding_requests", "least-outstanding-requests"),
        ("sticky", "sticky"),
    ],
)
def test_router_policies(policy: str, expected: str) -> None:
    data = seed_mapping() | {"router": {"policy": policy, "port": 9000}}
    router = load_pipeline(data, model=BAGEL_MODEL).router
    assert (router.policy, router.port) == (expected, 9000)


def test_engine_args_pass_through() -> None:
    data = seed_mapping()
    data["stages"][0]["engine_args"] = {"kv_cache_dtype": "fp8", "max_logprobs": 5}
    stage = load_pipeline(data, model=BAGEL_MODEL).stages[0]
    assert stage.engine_args == {"kv_cache_dtype": "fp8", "max_logprobs": 5}


def test_pipeline_may_sit_under_a_pipeline_key(tmp_path: Path) -> None:
    wrapped = yaml.safe_dump({"model": BAGEL_MODEL, "pipeline": seed_mapping()})
    config = load_pipeline(write(tmp_path, "wrapped.yaml", wrapped))
    assert config == load_pipeline(seed_mapping(), model=BAGEL_MODEL)

    broken = seed_mapping()
    broken["stages"][0]["replicas"] = -1
    error = errors_of({"pipeline": broken}, model=BAGEL_MODEL)
    assert [path for path, _ in error.issues] == ["pipeline.stages[0].replicas"]


def omni_pipeline(spec: object, **fields: object) -> dict[str, Any]:
    return {
        "apiVersion": "omni.example/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "bagel", "namespace": "default"},
        "spec": spec,
        **fields,
    }


def test_an_omnipipeline_resource_loads_its_spec(tmp_path: Path) -> None:
    spec = {"model": BAGEL_MODEL, **seed_mapping()}
    path = write(tmp_path, "bagel-pipeline.yaml", yaml.safe_dump(omni_pipeline(spec)))
    assert load_pipeline(path) == load_pipeline(seed_mapping(), model=BAGEL_MODEL)
    # What `kubectl get -o yaml` prints has a status too.
    assert load_pipeline(omni_pipeline(spec, status={"phase": "Ready"})) == load_pipeline(path)

    spec["stages"][0]["replicas"] = -1
    error = errors_of(omni_pipeline(spec))
    assert [path for path, _ in error.issues] == ["spec.stages[0].replicas"]


@pytest.mark.parametrize(
    ("document", "issue"),
    [
        (
            omni_pipeline({}, kind="Deployment"),
            ("kind", "expected OmniPipeline, got 'Deployment'"),
        ),
        (omni_pipeline(None), ("spec", "expected the pipeline mapping, got nothing")),
        (omni_pipeline(["stages"]), ("spec", "expected the pipeline mapping, got a list")),
        (
            omni_pipeline({}, extra=1),
            ("extra", "unknown field; allowed: apiVersion, kind, metadata, spec, status"),
        ),
    ],
)
def test_a_malformed_resource_is_refused_by_field(
    document: dict[str, Any], issue: tuple[str, str]
) -> None:
    assert errors_of(document, model=BAGEL_MODEL).issues == [issue]


# --- invalid pipelines ----------------------------------------------------------------------

# (changes to the seed mapping as (dotted path, value), the field path the error must name,
# and a fragment of its message that says what is allowed)
INVALID: list[tuple[str, list[tuple[str, Any]], str, str]] = [
    (
        "duplicate-stage-id",
        [("stages.1.stage_id", 0), ("stages.1.input_connectors", {})],
        "stages[1].stageId",
        "stage id 0 is already used by stages[0]; stage ids must be unique",
    ),
    (
        "connector-key-format",
        [("stages.1.input_connectors", {"stage0": "shared_memory_connector"})],
        "stages[1].inputConnectors.stage0",
        "from_stage_<id>",
    ),
    (
        "unknown-upstream-stage",
        [
            ("stages.0.stage_id", 2),
            ("stages.1.stage_id", 3),
            ("stages.0.type", "llm"),
            ("stages.1.type", "diffusion"),
        ],
        "stages[1].inputConnectors.from_stage_0",
        "no stage has id 0; stage ids: 2, 3",
    ),
    (
        "unknown-connector",
        [("stages.1.input_connectors.from_stage_0", "tcp_connector")],
        "stages[1].inputConnectors.from_stage_0",
        "defined connectors: shared_memory_connector, rdma_connector",
    ),
    (
        "no-connectors-defined",
        [("connectors", {})],
        "stages[1].inputConnectors.from_stage_0",
        "defined connectors: none",
    ),
    (
        "fed-by-itself",
        [("stages.1.input_connectors", {"from_stage_1": "shared_memory_connector"})],
        "stages[1].inputConnectors.from_stage_1",
        "lower id",
    ),
    (
        "fed-by-later-stage",
        [("stages.0.input_connectors", {"from_stage_1": "shared_memory_connector"})],
        "stages[0].inputConnectors.from_stage_1",
        "lower id",
    ),
    ("devices-word", [("stages.0.devices", "gpu0")], "stages[0].devices", "comma-separated"),
    ("devices-empty-id", [("stages.0.devices", "0,,1")], "stages[0].devices", "'cpu'"),
    ("devices-negative", [("stages.0.devices", "-1")], "stages[0].devices", "GPU ids"),
    ("devices-negative-int", [("stages.0.devices", -1)], "stages[0].devices", "GPU ids"),
    ("devices-list", [("stages.0.devices", [0, 1])], "stages[0].devices", "'0,1'"),
    ("devices-repeated", [("stages.0.devices", "0,1,0")], "stages[0].devices", "list each GPU"),
    ("replicas-negative", [("stages.0.replicas", -1)], "stages[0].replicas", "0"),
    ("replicas-bool", [("stages.0.replicas", True)], "stages[0].replicas", "integer"),
    (
        "gpu-memory-zero",
        [("stages.0.gpu_memory_utilization", 0)],
        "stages[0].gpuMemoryUtilization",
        "(0, 1]",
    ),
    (
        "gpu-memory-above-one",
        [("stages.0.gpu_memory_utilization", 1.5)],
        "stages[0].gpuMemoryUtilization",
        "(0, 1]",
    ),
    (
        "gpu-memory-text",
        [("stages.0.gpu_memory_utilization", "half")],
        "stages[0].gpuMemoryUtilization",
        "(0, 1]",
    ),
    ("unknown-stage-type", [("stages.1.type", "rnn")], "stages[1].type", "'llm' or 'diffusion'"),
    (
        "output-on-diffusion",
        [("stages.1.output", "text")],
        "stages[1].output",
        "only llm stages",
    ),
    (
        "unknown-output",
        [("stages.0.output", "logits")],
        "stages[0].output",
        "'text' or 'hidden_states'",
    ),
    ("unknown-stage-key", [("stages.0.max_num_seq", 3)], "stages[0].max_num_seq", "maxNumSeqs"),
    ("both-spellings", [("stages.0.stageId", 0)], "stages[0].stageId", "keep one"),
    ("tp-zero", [("stages.0.tensor_parallel_size", 0)], "stages[0].tensorParallelSize", "0"),
    ("dp-zero", [("stages.0.data_parallel_size", 0)], "stages[0].dataParallelSize", "0"),
    ("max-seqs-zero", [("stages.0.max_num_seqs", 0)], "stages[0].maxNumSeqs", "greater than 0"),
    ("dtype", [("stages.0.dtype", "fp8")], "stages[0].dtype", "'bfloat16'"),
    ("stage-name", [("stages.0.name", "Thinker_1")], "stages[0].name", "lower-case"),
    ("duplicate-name", [("stages.1.name", "thinker")], "stages[1].name", "must be unique"),
    (
        "engine-args-shadow-field",
        [("stages.0.engine_args", {"max_num_seqs": 8})],
        "stages[0].engineArgs.max_num_seqs",
        "set maxNumSeqs on the stage",
    ),
    ("stage-id-negative", [("stages.0.stage_id", -1)], "stages[0].stageId", "0"),
    ("no-stages", [("stages", [])], "stages", "at least 1"),
    (
        "connector-without-name",
        [("connectors.shared_memory_connector", {"extra": {}})],
        "connectors.shared_memory_connector.name",
        "SharedMemoryConnector",
    ),
    (
        "connector-unknown-key",
        [("connectors.rdma_connector.options", {})],
        "connectors.rdma_connector.options",
        "allowed: name, extra",
    ),
    ("router-port", [("router", {"port": 70000})], "router.port", "65535"),
    ("router-policy", [("router", {"policy": "random"})], "router.policy", "'sticky'"),
    ("unknown-top-level-key", [("stagez", [])], "stagez", "allowed: model, asyncChunk, family"),
]


def changed(changes: list[tuple[str, Any]]) -> dict[str, Any]:
    data = seed_mapping()
    for dotted, value in changes:
        *parents, last = dotted.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = value
    return data


@pytest.mark.parametrize(
    ("changes", "path", "allowed"),
    [pytest.param(changes, path, allowed, id=name) for name, changes, path, allowed in INVALID],
)
def test_invalid_pipeline_names_the_field(
    changes: list[tuple[str, Any]], path: str, allowed: str
) -> None:
    error = errors_of(changed(changes), model=BAGEL_MODEL)

    messages = [message for issue_path, message in error.issues if issue_path == path]
    assert messages, f"no issue at {path}: {error.issues}"
    assert any(allowed in message for message in messages), messages
    assert f"{path}: " in str(error)


def test_every_problem_is_reported_at_once() -> None:
    error = errors_of(
        changed(
            [
                ("stages.0.devices", "gpu"),
                ("stages.0.replicas", -2),
                ("stages.1.dtype", "fp4"),
            ]
        ),
        model=BAGEL_MODEL,
    )
    assert [path for path, _ in error.issues] == [
        "stages[0].replicas",
        "stages[0].devices",
        "stages[1].dtype",
    ]


def test_error_text_is_one_line_per_issue_without_pydantic_dump() -> None:
    error = errors_of(changed([("stages.0.devices", "gpu"), ("stages.1.stage_id", "one")]))
    assert isinstance(error, ValueError)
    lines = str(error).splitlines()
    assert len(lines) == len(error.issues) == 3
    assert lines == [f"{path}: {message}" for path, message in error.issues]
    assert "pydantic" not in str(error)
    assert "validation error" not in str(error)


def test_error_survives_copying() -> None:
    error = errors_of(changed([("stages.0.devices", "gpu")]), model=BAGEL_MODEL)
    copied = copy.deepcopy(error)
    assert copied.issues == error.issues
    assert str(copied) == str(error)


# --- files ------------------------------------------------------------------------------------


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "broken.yaml", "stages:\n  - stage_id: 0\n   devices: [0\n")
    error = errors_of(path, model=BAGEL_MODEL)
    assert error.source == str(path)
    [(where, message)] = error.issues
    assert where == str(path)
    assert "line 3" in message


def test_json_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "broken.json", '{\n  "stages": [\n}\n')
    [(where, message)] = errors_of(path, model=BAGEL_MODEL).issues
    assert where == str(path)
    assert "line 3" in message


def test_yaml_key_given_twice_is_refused(tmp_path: Path) -> None:
    text = BAGEL_YAML.replace('    devices: "0"\n', '    devices: "0"\n    devices: "1"\n', 1)
    path = write(tmp_path, "twice.yaml", text)
    [(where, message)] = errors_of(path, model=BAGEL_MODEL).issues
    assert where == str(path)
    assert "'devices' is given twice" in message
    assert "line 11" in message


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("- stage_id: 0\n", "got a list"), ("just text\n", "got a string"), ("", "empty")],
)
def test_non_mapping_file_is_refused(tmp_path: Path, text: str, fragment: str) -> None:
    path = write(tmp_path, "odd.yaml", text)
    [(where, message)] = errors_of(path, model=BAGEL_MODEL).issues
    assert where == str(path)
    assert fragment in message


def test_missing_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    [(where, message)] = errors_of(path, model=BAGEL_MODEL).issues
    assert where == str(path)
    assert "cannot read" in message


# --- GPU memory admission ----------------------------------------------------------------

REPO = Path(__file__).resolve().parents[4]
Share = tuple[str, str, float | None]


def gpu_pipeline(*stages: Share) -> dict[str, Any]:
    """A pipeline of stages stage-<i> given as (type, devices, gpuMemoryUtilization or None
    for unset)."""
    return {
        "model": "m",
        "stages": [
            {
                "stageId": index,
                "type": stage_type,
                "devices": devices,
                **({"gpuMemoryUtilization": share} if share is not None else {}),
            }
            for index, (stage_type, devices, share) in enumerate(stages)
        ],
    }


def gpu_messages(*stages: Share) -> list[str]:
    """The over-subscription messages for the pipeline of ``stages``, all at ``stages``."""
    error = errors_of(gpu_pipeline(*stages))
    assert {path for path, _ in error.issues} == {"stages"}, error.issues
    return [message for _, message in error.issues]


def test_an_over_subscribed_gpu_is_refused_naming_the_gpu_stages_shares_and_sum() -> None:
    (message,) = gpu_messages(("llm", "0", 0.6), ("llm", "0", 0.6))
    assert message.startswith("GPU 0 is over-subscribed: ")
    assert "sum to 1.2, more than 1" in message
    assert "stage-0 (stages[0]) 0.6, stage-1 (stages[1]) 0.6" in message
    assert "lower them so that they sum to at most 1" in message


def test_an_over_subscription_is_refused_by_file_as_serve_and_validate_load_it(
    tmp_path: Path,
) -> None:
    broken = seed_mapping()
    broken["stages"][1]["gpu_memory_utilization"] = 0.6
    path = write(tmp_path, "bagel.yaml", yaml.safe_dump(broken))
    error = errors_of(path, model=BAGEL_MODEL)
    assert str(error) == (
        "stages: GPU 0 is over-subscribed: the gpuMemoryUtilization of the stages on it sum "
        "to 1.05, more than 1 (thinker (stages[0]) 0.45, dit (stages[1]) 0.6); lower them so "
        "that they sum to at most 1"
    )


@pytest.mark.parametrize("shares", [(0.45, 0.55), (0.1, 0.2, 0.7), (0.5, 0.5), (1.0,)])
def test_shares_that_fill_a_gpu_exactly_are_admitted(shares: tuple[float, ...]) -> None:
    # 0.1 + 0.2 + 0.7 is a hair above 1 in floating point.
    config = load_pipeline(gpu_pipeline(*(("llm", "0", share) for share in shares)))
    assert [stage.gpu_share for stage in config.stages] == list(shares)


def test_stages_on_different_gpus_are_not_summed() -> None:
    load_pipeline(gpu_pipeline(("llm", "0", 0.9), ("llm", "1", 0.9)))
    # A stage over two GPUs takes its share of each.
    load_pipeline(gpu_pipeline(("llm", "0,1", 0.5), ("llm", "1", 0.5), ("diffusion", "0", 0.5)))
    (message,) = gpu_messages(("llm", "0,1", 0.6), ("llm", "1", 0.5), ("diffusion", "0", 0.4))
    assert message.startswith("GPU 1 is over-subscribed")
    assert "stage-0 (stages[0]) 0.6, stage-1 (stages[1]) 0.5" in message
    assert "stage-2" not in message


def test_each_over_subscribed_gpu_is_reported() -> None:
    messages = gpu_messages(("llm", "0,1", 0.6), ("llm", "0", 0.6), ("llm", "1", 0.6))
    assert [m.split(":")[0] for m in messages] == [
        "GPU 0 is over-subscribed",
        "GPU 1 is over-subscribed",
    ]


@pytest.mark.parametrize("cpu", ["cpu", ""])
def test_cpu_stages_are_ignored(cpu: str) -> None:
    config = load_pipeline(
        gpu_pipeline(("llm", cpu, 0.9), ("llm", cpu, 0.9), ("llm", cpu, None), ("llm", "0", 0.9))
    )
    assert [stage.gpu_share for stage in config.stages] == [None, None, None, 0.9]


def test_an_unset_llm_share_counts_as_vllms_default() -> None:
    (message,) = gpu_messages(("llm", "0", None), ("llm", "0", None))
    assert "sum to 1.84, more than 1" in message
    assert "stage-0 (stages[0]) unset: vLLM's default 0.92" in message
    (message,) = gpu_messages(("llm", "0", None), ("diffusion", "0", 0.1))
    assert "sum to 1.02" in message
    load_pipeline(gpu_pipeline(("llm", "0", None), ("diffusion", "0", 0.08)))
    # Alone on its GPU, vLLM's default fits.
    load_pipeline(gpu_pipeline(("llm", "0", None), ("llm", "1", 0.9)))


def test_an_unset_diffusion_share_is_not_counted() -> None:
    # The DiT takes what the LLM stages leave, as the seed's BAGEL config has it.
    load_pipeline(gpu_pipeline(("llm", "0", 0.45), ("diffusion", "0", None)))
    load_pipeline(gpu_pipeline(("llm", "0", None), ("diffusion", "0", None)))
    (message,) = gpu_messages(("llm", "0", 0.6), ("llm", "0", 0.6), ("diffusion", "0", None))
    assert "sum to 1.2" in message
    assert "stage-2 (stages[2]) unset: an uncapped diffusion stage, not counted" in message


def test_the_seeds_bagel_yaml_is_admitted() -> None:
    config = load_pipeline(REPO / "examples" / "bagel.yaml", model=BAGEL_MODEL)
    thinker, dit = config.stages
    assert (thinker.gpu_ids, thinker.gpu_share) == ((0,), 0.45)
    assert (dit.gpu_ids, dit.gpu_share) == ((0,), None)


@pytest.mark.parametrize(
    "path",
    sorted((REPO / "examples").glob("*.yaml"))
    + sorted((REPO / "manifests/examples").glob("*.yaml")),
    ids=lambda path: f"{path.parent.name}/{path.name}",
)
def test_every_example_is_admitted(path: Path) -> None:
    model = {"model": BAGEL_MODEL} if path.name == "bagel.yaml" else {}
    assert load_pipeline(path, **model).stages


# --- dependencies ---------------------------------------------------------------------------


def test_schema_imports_no_ml_libraries() -> None:
    import omni_runtime

    source_root = Path(omni_runtime.__file__).resolve().parents[1]
    probe = (
        "import sys, omni_runtime.config\n"
        "heavy = {'torch', 'vllm', 'diffusers', 'transformers', 'numpy', 'zmq', 'msgspec'}\n"
        "print(sorted(heavy & {name.split('.')[0] for name in sys.modules}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(source_root)},
    )
    assert result.stdout.strip() == "[]"


def test_pipeline_config_is_exported() -> None:
    config = load_pipeline(seed_mapping(), model=BAGEL_MODEL)
    assert isinstance(config, PipelineConfig)
    assert config.stage(1).name == "dit"
    with pytest.raises(KeyError):
        config.stage(7)


def test_a_stage_finds_its_hand_off_connector_in_its_own_config() -> None:
    """The stage, not the router, reads which connector it hands its output with: during
    a rollout the router's config may be another revision's."""
    pipeline = PipelineConfig.model_validate(
        {
            "model": "m",
            "stages": [
                {"stageId": 0, "type": "llm", "output": "hidden_states"},
                {"stageId": 1, "type": "llm", "output": "hidden_states",
                 "inputConnectors": {"from_stage_0": "tcp_a"}},
                {"stageId": 2, "type": "diffusion", "inputConnectors": {"from_stage_1": "shm"}},
            ],
            "connectors": {
                "tcp_a": {"name": "TCPConnector"},
                "shm": {"name": "SharedMemoryConnector"},
            },
        }
    )  # fmt: skip
    assert pipeline.output_connector(0) == "tcp_a"
    assert pipeline.output_connector(1) == "shm"
    assert pipeline.output_connector(2) is None


def test_a_manifest_with_its_claim_loads_its_one_pipeline(tmp_path: Path) -> None:
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "c"}}
    pipeline = {
        "apiVersion": "omni.dev/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "p"},
        "spec": {"model": "m", "stages": [{"stageId": 0, "type": "llm"}]},
    }
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump_all([claim, pipeline]))
    assert load_pipeline(path).model == "m"
    path.write_text(yaml.safe_dump_all([claim, pipeline, pipeline]))
    with pytest.raises(PipelineConfigError, match="3 YAML documents and 2 OmniPipeline"):
        load_pipeline(path)


def test_adapter_capacity_follows_declarations_and_max_loras() -> None:
    spec = {
        "model": "m",
        "stages": [
            {"stageId": 0, "name": "chat", "type": "llm"},
            {"stageId": 1, "name": "dit", "type": "diffusion", "maxLoras": 2},
            {"stageId": 2, "name": "other", "type": "llm"},
        ],
        "adapters": [{"name": "pirate", "stage": "chat", "source": "/loras/pirate"}],
    }
    pipeline = PipelineConfig.model_validate(spec)
    assert [pipeline.adapter_capacity(s) for s in pipeline.stages] == [4, 2, 0]
    # Unset adapters stay out of the dump, so a pipeline without any keeps its revision.
    assert "adapters" not in dump_pipeline(
        PipelineConfig.model_validate({**spec, "adapters": None})
    )


@pytest.mark.parametrize(
    ("adapter", "where", "says"),
    [
        ({"source": "https://example.com/a.safetensors"}, "adapters[0].source", "not a URL"),
        ({"scale": 0.5}, "adapters[0].scale", "leave scale at 1"),
        ({"name": "m"}, "adapters[0].name", "served model name"),
    ],
)
def test_llm_adapters_take_no_url_or_scale(adapter: dict[str, Any], where: str, says: str) -> None:
    spec = {
        "model": "m",
        "stages": [{"stageId": 0, "name": "chat", "type": "llm"}],
        "adapters": [{"name": "pirate", "stage": "chat", "source": "/loras/pirate", **adapter}],
    }
    with pytest.raises(ValueError, match="adapters") as refused:
        PipelineConfig.model_validate(spec)
    assert where in str(refused.value)
    assert says in str(refused.value)
