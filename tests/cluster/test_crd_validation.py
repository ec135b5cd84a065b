"""The OmniPipeline CRD against a real apiserver: what `kubectl apply` admits and refuses.

The checked-in crds/omnipipelines.yaml is installed once for the module. Each invalid
pipeline of tests/pipeline_rules.py must be refused by `kubectl apply` with a message that
names the field and the actual cause, and by the operator's own check (parse_spec) too,
and each valid one admitted by both: the CRD's rules and the operator's cannot drift
(tests/unit/omni_operator/test_pipeline_rules.py checks the operator's side on every run); the
examples must be admitted; `kubectl explain` and `kubectl get` must show
what the CRD promises.
"""

from __future__ import annotations

import copy
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from omni_operator.reconciler import SpecRefused, parse_spec
from omni_runtime.config import dump_pipeline, load_pipeline
from pipeline_rules import INVALID, VALID, Manifest, RuleCase, ValidCase, base_pipeline, stage

if TYPE_CHECKING:
    from conftest import Kube

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "omnipipelines.yaml"
EXAMPLES = REPO / "manifests" / "examples"
CRD_NAME = "omnipipelines.omni.dev"


@pytest.fixture(scope="module")
def crd(kube: Kube) -> None:
    """The checked-in CRD, installed and Established. Left installed: other modules of the
    session use the same CRD, and the apply is idempotent."""
    kube.kubectl("apply", "-f", str(CRD_FILE))
    kube.wait_crd_established(CRD_NAME, timeout=30)


@pytest.fixture(scope="module")
def ns(kube: Kube, crd: None) -> Iterator[str]:
    """One namespace for the module: refused objects leave nothing behind in it."""
    name = f"t-crd-validation-{uuid.uuid4().hex[:6]}"
    kube.kubectl("create", "namespace", name)
    # Established is not yet "in kubectl's discovery": poll until the kind is served.
    deadline = time.monotonic() + 30
    while kube.kubectl("get", "omnipipelines", namespace=name, check=False).returncode != 0:
        assert time.monotonic() < deadline, "omnipipelines not served 30 s after Established"
        time.sleep(0.2)
    try:
        yield name
    finally:
        kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


def apply(kube: Kube, manifest: Manifest, namespace: str) -> subprocess.CompletedProcess[str]:
    return kube.kubectl(
        "apply", "-f", "-", input=json.dumps(manifest), namespace=namespace, check=False
    )


def test_base_pipeline_is_valid(kube: Kube, ns: str) -> None:
    # Every invalid case is this pipeline broken once, so this must pass for them to mean
    # anything.
    result = apply(kube, base_pipeline("base"), ns)
    assert result.returncode == 0, result.stderr
    stored = kube.get_json("omnipipeline", "base", namespace=ns)
    # Defaults come from the schema.
    assert stored["spec"]["router"]["port"] == 8000
    assert stored["spec"]["stages"][0]["replicas"] == 1


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_invalid_pipeline_is_refused(kube: Kube, ns: str, case: RuleCase) -> None:
    manifest = case.manifest(f"bad-{uuid.uuid4().hex[:6]}")
    result = apply(kube, manifest, ns)
    assert result.returncode != 0, f"accepted: {json.dumps(manifest['spec'])}"
    for text in case.cel:
        assert text in result.stderr, f"{text!r} not in:\n{result.stderr}"
    name = manifest["metadata"]["name"]
    missing = kube.kubectl("get", "omnipipeline", name, namespace=ns, check=False)
    assert "NotFound" in missing.stderr, missing.stdout
    if case.python is not None:
        with pytest.raises(SpecRefused) as refused:
            parse_spec(manifest["spec"])
        for text in case.python:
            assert text in str(refused.value), f"{text!r} not in: {refused.value}"


@pytest.mark.parametrize("case", VALID, ids=lambda c: c.id)
def test_valid_pipeline_is_admitted(kube: Kube, ns: str, case: ValidCase) -> None:
    manifest = case.manifest(f"ok-{uuid.uuid4().hex[:6]}")
    result = apply(kube, manifest, ns)
    assert result.returncode == 0, result.stderr
    parse_spec(manifest["spec"])


def test_equal_autoscaling_in_a_placement_group_is_admitted(kube: Kube, ns: str) -> None:
    manifest = base_pipeline("scaled")
    scaling = {"maxReplicas": 4, "latencyObjective": {"seconds": 8}}
    for index in (0, 1):
        stage(manifest, index)["autoscaling"] = dict(scaling)
    result = apply(kube, manifest, ns)
    assert result.returncode == 0, result.stderr
    stored = kube.get_json("omnipipeline", "scaled", namespace=ns)
    assert stored["spec"]["stages"][1]["autoscaling"] == {
        "mode": "planner",
        "maxReplicas": 4,
        "latencyObjective": {"percentile": 90, "seconds": 8},
    }


def test_enough_invalid_cases() -> None:
    assert len(INVALID) >= 18


def test_known_topology_gives_stage_types(kube: Kube, ns: str) -> None:
    manifest = base_pipeline("topology")
    manifest["spec"]["model"] = "ByteDance-Seed/BAGEL-7B-MoT"
    for index in (0, 1):
        del stage(manifest, index)["type"]
        del stage(manifest, index)["name"]
    result = apply(kube, manifest, ns)
    assert result.returncode == 0, result.stderr
    # A stage id the topology does not know still needs its type.
    manifest["spec"]["stages"].append({"stageId": 2, "devices": "cpu"})
    result = apply(kube, manifest, ns)
    assert result.returncode != 0
    assert "stage 2 has no type" in result.stderr, result.stderr


def test_the_seeds_bagel_yaml_is_admitted(kube: Kube, ns: str) -> None:
    # examples/bagel.yaml as an OmniPipeline: the thinker at 0.45 and the DiT unset on GPU 0.
    pipeline = load_pipeline(REPO / "examples" / "bagel.yaml", model="ByteDance-Seed/BAGEL-7B-MoT")
    spec = dump_pipeline(pipeline)
    assert [s.get("gpuMemoryUtilization") for s in spec["stages"]] == [0.45, None]
    manifest = {
        "apiVersion": "omni.dev/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "seed-bagel"},
        "spec": spec,
    }
    result = apply(kube, manifest, ns)
    assert result.returncode == 0, result.stderr


def example_files() -> list[Any]:
    return [
        pytest.param(
            EXAMPLES / name,
            id=name,
            marks=pytest.mark.skipif(
                not (EXAMPLES / name).exists(), reason=f"manifests/examples/{name} not written"
            ),
        )
        for name in (
            "bagel-pipeline.yaml",
            "tiny-pipeline.yaml",
            "qwen-image-pipeline.yaml",
            "qwen-image-edit-pipeline.yaml",
            "qwen-image-edit-plus-pipeline.yaml",
            "z-image-turbo-pipeline.yaml",
            "qwen3-omni-pipeline.yaml",
            "z-image-adapters-pipeline.yaml",
        )
    ]


@pytest.mark.parametrize("path", example_files())
def test_example_is_admitted(kube: Kube, ns: str, path: Path) -> None:
    documents = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    pipelines = [d for d in documents if d.get("kind") == "OmniPipeline"]
    assert pipelines, f"{path} has no OmniPipeline"
    for pipeline in pipelines:
        pipeline = copy.deepcopy(pipeline)
        pipeline["metadata"].pop("namespace", None)
        result = apply(kube, pipeline, ns)
        assert result.returncode == 0, result.stderr
        name = pipeline["metadata"]["name"]
        stored = kube.get_json("omnipipeline", name, namespace=ns)
        assert [s["stageId"] for s in stored["spec"]["stages"]] == [
            s["stageId"] for s in pipeline["spec"]["stages"]
        ]


def test_explain_documents_stage_fields(kube: Kube, ns: str) -> None:
    text = kube.kubectl("explain", "omnipipeline.spec.stages").stdout
    for field in ("devices", "inputConnectors", "placement", "replicas", "stageId"):
        assert f"  {field}\t" in text or f"  {field} " in text, f"{field} missing:\n{text}"
    # Descriptions come from the pydantic models' fields.
    assert "comma-separated GPU ids" in text, text
    assert "from_stage_<id>" in text, text
    assert "Where this stage's pods run." in text, text
    nested = kube.kubectl("explain", "omnipipeline.spec.stages.placement.resources").stdout
    assert "nvidia.com/gpu is set by the operator" in nested, nested


def test_printer_columns_show_status(kube: Kube, ns: str) -> None:
    assert apply(kube, base_pipeline("shown"), ns).returncode == 0
    status = {"ready": "2/2", "phase": "Ready", "endpoint": f"http://shown.{ns}.svc:8000"}
    kube.kubectl(
        "patch",
        "omnipipeline",
        "shown",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
        namespace=ns,
    )
    table = kube.kubectl("get", "omnipipelines", "shown", namespace=ns).stdout
    header, *rows = [line.split() for line in table.strip().splitlines()]
    assert header == ["NAME", "READY", "PHASE", "ENDPOINT", "AGE"], table
    assert len(rows) == 1, table
    assert rows[0][:4] == ["shown", "2/2", "Ready", status["endpoint"]], table
    # The short name and the category find it too.
    assert "shown" in kube.kubectl("get", "omnip", namespace=ns).stdout
    assert "shown" in kube.kubectl("get", "omni", namespace=ns).stdout
