"""Unit tests of omni_operator.crd: the generated CRD is current, structural and documented.

What the apiserver makes of it (cost limits, the rules' verdicts and messages) is tested
against a real control plane in tests/cluster/test_crd_validation.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from omni_operator import api, crd
from omni_runtime.config.connectors import KNOWN_CONNECTORS
from omni_runtime.config.stages import GPU_SHARE_EPSILON, VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
from omni_runtime.config.topologies import STAGE_TYPES

REPO = Path(__file__).resolve().parents[3]
CHECKED_IN = REPO / "crds" / "omnipipelines.yaml"
Schema = dict[str, Any]


@pytest.fixture(scope="module")
def generated() -> dict[str, Any]:
    return crd.build_crd()


@pytest.fixture(scope="module")
def root(generated: dict[str, Any]) -> Schema:
    schema: Schema = generated["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def walk(schema: Schema, path: str = "") -> Iterator[tuple[str, Schema]]:
    """Every subschema with its path (".stages[].devices", ".connectors{}.name")."""
    yield path, schema
    for name, prop in schema.get("properties", {}).items():
        yield from walk(prop, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def test_checked_in_crd_is_current() -> None:
    assert CHECKED_IN.exists(), (
        "crds/omnipipelines.yaml is missing: run python -m omni_operator.crd"
    )
    assert CHECKED_IN.read_text(encoding="utf-8") == crd.render_yaml(crd.build_crd()), (
        "crds/omnipipelines.yaml is stale: regenerate it with `python -m omni_operator.crd`"
    )


def test_check_flag_reports_a_stale_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "crd.yaml"
    assert crd.main(["--output", str(output)]) == 0
    assert crd.main(["--output", str(output), "--check"]) == 0
    output.write_text(output.read_text().replace("group: omni.dev", "group: omni.example"))
    assert crd.main(["--output", str(output), "--check"]) == 1
    err = capsys.readouterr().err
    assert "is stale: regenerate it with `python -m omni_operator.crd`" in err, err
    # A unified diff of what changed.
    assert "-  group: omni.example\n" in err, err
    assert "+  group: omni.dev\n" in err, err
    assert crd.main(["--output", str(tmp_path / "absent.yaml"), "--check"]) == 1


def test_names_and_version(generated: dict[str, Any]) -> None:
    assert generated["apiVersion"] == "apiextensions.k8s.io/v1"
    assert generated["metadata"]["name"] == "omnipipelines.omni.dev"
    spec = generated["spec"]
    assert spec["group"] == "omni.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "OmniPipeline",
        "listKind": "OmniPipelineList",
        "plural": "omnipipelines",
        "singular": "omnipipeline",
        "shortNames": ["omnip"],
        "categories": ["omni"],
    }
    [version] = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}


def test_printer_columns(generated: dict[str, Any]) -> None:
    columns = generated["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [(c["name"], c["type"], c["jsonPath"]) for c in columns] == [
        ("Ready", "string", ".status.ready"),
        ("Phase", "string", ".status.phase"),
        ("Endpoint", "string", ".status.endpoint"),
        ("Age", "date", ".metadata.creationTimestamp"),
    ]


def test_every_property_has_a_description(root: Schema) -> None:
    # metadata is the apiserver's own, which forbids describing it.
    undocumented = [
        path
        for path, node in walk(root)
        if path
        and not path.startswith(".metadata")
        and not node.get("description")
        # List items and map values are described by their list or map.
        and not path.endswith(("[]", "{}"))
    ]
    assert undocumented == []


def test_schema_is_structural(root: Schema) -> None:
    for path, node in walk(root):
        where = path or "<root>"
        for key in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "title", "nullable"):
            assert key not in node, f"{where}: {key}"
        free = node.get("x-kubernetes-preserve-unknown-fields") or node.get(
            "x-kubernetes-int-or-string"
        )
        assert free or node.get("type"), f"{where}: no type"
        if "properties" in node:
            assert "additionalProperties" not in node, f"{where}: properties and a map"
        if "additionalProperties" in node:
            assert isinstance(node["additionalProperties"], dict), where
        if node.get("x-kubernetes-list-type") == "map":
            keys = node["x-kubernetes-list-map-keys"]
            assert set(keys) <= set(node["items"].get("required", [])), where
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(bound, True) is True, f"{where}: {bound} must be the 3.0 flag"


def test_rules_say_what_failed(root: Schema) -> None:
    rules = [
        (path, rule)
        for path, node in walk(root)
        for rule in node.get("x-kubernetes-validations", [])
    ]
    assert len(rules) >= 10
    for path, rule in rules:
        assert rule.get("message") or rule.get("messageExpression"), f"{path}: {rule['rule']}"
        assert rule.get("fieldPath", ".").startswith("."), path
        # A Duplicate reason makes the apiserver drop the message.
        assert rule.get("reason") in (None, "FieldValueInvalid"), path


def test_lists_maps_and_strings_in_rules_are_bounded(root: Schema) -> None:
    spec = root["properties"]["spec"]
    stage = spec["properties"]["stages"]["items"]["properties"]
    assert spec["properties"]["stages"]["maxItems"] == crd.MAX_STAGES
    assert spec["properties"]["connectors"]["maxProperties"] == crd.MAX_CONNECTORS
    assert stage["inputConnectors"]["maxProperties"] == crd.MAX_INPUT_CONNECTORS
    assert stage["devices"]["maxLength"] == crd.MAX_DEVICES_LENGTH
    assert stage["name"]["maxLength"] == 63
    assert stage["stageId"]["maximum"] == 65535 - 52000


def test_types_defaults_and_bounds_come_from_the_models(root: Schema) -> None:
    spec = root["properties"]["spec"]
    stage = spec["properties"]["stages"]["items"]
    props = stage["properties"]
    assert spec["required"] == ["model", "stages"]
    # name and type are filled in by the runtime's model (topology, stage-<id>).
    assert stage["required"] == ["stageId"]
    assert props["type"]["enum"] == list(STAGE_TYPES)
    assert props["output"]["enum"] == ["text", "hidden_states"]
    assert props["replicas"] == {**props["replicas"], "type": "integer", "default": 1, "minimum": 0}
    assert props["devices"]["type"] == "string"
    assert props["devices"]["default"] == "cpu"
    gpu_memory = props["gpuMemoryUtilization"]
    assert (gpu_memory["type"], gpu_memory["minimum"], gpu_memory["exclusiveMinimum"]) == (
        "number",
        0,
        True,
    )
    assert gpu_memory["maximum"] == 1
    assert props["tensorParallelSize"]["exclusiveMinimum"] is True
    connector = spec["properties"]["connectors"]["additionalProperties"]
    assert connector["properties"]["name"]["enum"] == list(KNOWN_CONNECTORS)
    assert connector["required"] == ["name"]
    router = spec["properties"]["router"]
    assert router["default"] == {}
    assert router["properties"]["port"] == {
        **router["properties"]["port"],
        "minimum": 1,
        "maximum": 65535,
        "default": 8000,
    }
    assert router["properties"]["serviceType"]["enum"] == list(get_args(api.ServiceType))
    assert spec["properties"]["imagePullPolicy"]["enum"] == list(get_args(api.PullPolicy))


def test_gpu_memory_rules_count_unset_shares_as_the_runtime_does(root: Schema) -> None:
    rules = [
        rule
        for rule in root["properties"]["spec"]["x-kubernetes-validations"]
        if "is over-subscribed" in rule.get("messageExpression", "")
    ]
    # One per GPU id of a 16-GPU node, each naming its id in its message.
    assert len(rules) == crd.CEL_CHECKED_GPUS == 16
    for gpu, rule in enumerate(rules):
        assert f"matches('(^|,){gpu}(,|$)')" in rule["rule"]
        assert f'"GPU {gpu} is over-subscribed' in rule["messageExpression"]
        # An unset llm share is vLLM's default; an unset diffusion share counts as nothing.
        assert f"t.type == 'llm' ? {VLLM_DEFAULT_GPU_MEMORY_UTILIZATION!r} : 0.0" in rule["rule"]
        assert rule["rule"].endswith(f"<= {1 + GPU_SHARE_EPSILON!r}")
        assert rule["fieldPath"] == ".stages"


def test_free_form_fields_keep_what_is_written(root: Schema) -> None:
    spec = root["properties"]["spec"]
    stage = spec["properties"]["stages"]["items"]["properties"]
    placement = stage["placement"]["properties"]
    for node in (
        stage["defaultSamplingParams"],
        stage["engineArgs"],
        spec["properties"]["connectors"]["additionalProperties"]["properties"]["extra"],
        placement["affinity"],
        placement["volumes"]["items"],
        placement["env"]["items"]["properties"]["valueFrom"],
    ):
        assert node["type"] == "object"
        assert node["x-kubernetes-preserve-unknown-fields"] is True
    # String maps stay typed; quantities are int-or-string.
    assert placement["nodeSelector"]["additionalProperties"] == {"type": "string"}
    requests = placement["resources"]["properties"]["requests"]["additionalProperties"]
    assert requests == {"x-kubernetes-int-or-string": True, "pattern": api.QUANTITY_PATTERN}
    assert stage["inputConnectors"]["additionalProperties"]["type"] == "string"


def test_status_lists_merge_by_key(root: Schema) -> None:
    status = root["properties"]["status"]["properties"]
    assert status["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    assert status["stages"]["x-kubernetes-list-map-keys"] == ["stageId"]
    assert status["phase"]["enum"] == list(get_args(api.Phase))


def test_optional_is_absent_not_null() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {
                "anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}],
                "default": None,
                "description": "A.",
            },
            "q": {"anyOf": [{"type": "string"}, {"type": "integer"}], "description": "Q."},
        },
    }
    converted = crd.to_structural(schema)
    assert converted["properties"]["a"] == {"type": "string", "minLength": 1, "description": "A."}
    assert converted["properties"]["q"] == {"x-kubernetes-int-or-string": True, "description": "Q."}


def test_what_has_no_structural_form_is_refused() -> None:
    with pytest.raises(crd.SchemaError, match="anyOf"):
        crd.to_structural({"anyOf": [{"type": "string"}, {"type": "boolean"}]})
    with pytest.raises(crd.SchemaError, match="oneOf"):
        crd.to_structural({"oneOf": [{"type": "string"}]})


def test_generated_yaml_parses_back(generated: dict[str, Any]) -> None:
    text = crd.render_yaml(generated)
    assert text.startswith("# Generated by `python -m omni_operator.crd`")
    assert yaml.safe_load(text) == generated
