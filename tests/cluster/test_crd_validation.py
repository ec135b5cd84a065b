"""The OmniPipeline CRD against a real apiserver: what `kubectl apply` admits and refuses.

The checked-in crds/omnipipelines.yaml is installed once for the module. Each invalid
pipeline must be refused by `kubectl apply` with a message that names the field and the
actual cause; the examples must be admitted; `kubectl explain` and `kubectl get` must show
what the CRD promises.
"""

from __future__ import annotations

import copy
import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from omni_runtime.config import dump_pipeline, load_pipeline

if TYPE_CHECKING:
    from conftest import Kube

Manifest = dict[str, Any]

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "omnipipelines.yaml"
EXAMPLES = REPO / "manifests" / "examples"
CRD_NAME = "omnipipelines.omni.dev"


def base_pipeline(name: str = "p") -> Manifest:
    """A valid pipeline that each case below breaks in exactly one way: a thinker and a DiT
    sharing GPU 0 (one placement group) joined by shared memory."""
    return {
        "apiVersion": "omni.dev/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": name},
        "spec": {
            "model": "/models/tiny",
            "stages": [
                {"stageId": 0, "name": "thinker", "type": "llm", "devices": "0"},
                {
                    "stageId": 1,
                    "name": "dit",
                    "type": "diffusion",
                    "devices": "0",
                    "inputConnectors": {"from_stage_0": "shm"},
                },
            ],
            "connectors": {
                "shm": {"name": "SharedMemoryConnector"},
                "tcp": {"name": "TCPConnector"},
            },
        },
    }


def stage(manifest: Manifest, index: int) -> dict[str, Any]:
    result: dict[str, Any] = manifest["spec"]["stages"][index]
    return result


Breaker = Callable[[Manifest], object]


def _set(index: int, **fields: object) -> Breaker:
    return lambda m: stage(m, index).update(fields)


def _spec(**fields: object) -> Breaker:
    return lambda m: m["spec"].update(fields)


def _del_spec(field: str) -> Breaker:
    return lambda m: m["spec"].pop(field)


def _both(*breakers: Breaker) -> Breaker:
    return lambda m: [b(m) for b in breakers]


# (case id, how it breaks the base pipeline, substrings kubectl's stderr must contain: the
# field's path and the cause)
INVALID: list[tuple[str, Breaker, list[str]]] = [
    (
        "duplicate-stage-id",
        _set(1, stageId=0, inputConnectors={}),
        [
            "spec.stages[1]: Duplicate value",
            '"stageId":0',
            "stage ids must be unique: 2 stages have stageId 0",
        ],
    ),
    (
        "duplicate-stage-name",
        _set(1, name="thinker"),
        ["spec.stages", "stage names must be unique", "stages 0 and 1 are both named thinker"],
    ),
    (
        "input-from-missing-stage",
        _set(1, inputConnectors={"from_stage_7": "shm"}),
        ["spec.stages", "stage 1's inputConnectors.from_stage_7: no stage has id 7"],
    ),
    (
        "input-from-later-stage",
        _both(_set(0, inputConnectors={"from_stage_1": "tcp"}), _set(1, inputConnectors={})),
        [
            "spec.stages[0].inputConnectors",
            "stage 0 cannot take input from a later stage (from_stage_1)",
        ],
    ),
    (
        "input-from-itself",
        _set(1, inputConnectors={"from_stage_1": "tcp"}),
        ["spec.stages[1].inputConnectors", "stage 1 cannot take input from itself"],
    ),
    (
        "input-key-form",
        _set(1, inputConnectors={"stage_0": "tcp"}),
        ["spec.stages[1].inputConnectors", "keys must have the form from_stage_<id>", "stage_0"],
    ),
    (
        "unknown-connector-name",
        _set(1, inputConnectors={"from_stage_0": "nvlink"}),
        ["spec.stages", "stage 1's inputConnectors.from_stage_0: unknown connector 'nvlink'"],
    ),
    (
        "unknown-connector-class",
        lambda m: m["spec"]["connectors"]["shm"].update(name="NvlinkConnector"),
        ["spec.connectors.shm.name", 'Unsupported value: "NvlinkConnector"', "TCPConnector"],
    ),
    (
        "shared-memory-across-gpus",
        _set(1, devices="1"),
        [
            "spec.stages",
            "stage 1 (devices '1') takes input from stage 0 (devices '0') through connector "
            "'shm', a SharedMemoryConnector, which only works between stages of one "
            "placement group",
        ],
    ),
    (
        "shared-memory-from-cpu",
        _set(0, devices="cpu"),
        ["spec.stages", "stage 1 (devices '0') takes input from stage 0 (devices 'cpu')"],
    ),
    (
        "unequal-replicas-in-group",
        _set(1, replicas=2),
        [
            "spec.stages",
            "stages 0 and 1 share a GPU, so they run in one pod (a placement group) and must "
            "have equal replicas, not 1 and 2",
        ],
    ),
    (
        "devices-syntax",
        _set(0, devices="gpu0"),
        ["spec.stages[0].devices", "devices must be 'cpu'", "not 'gpu0'"],
    ),
    (
        "devices-repeated-id",
        _both(_set(0, devices="0,0"), _set(1, devices="0,0")),
        ["spec.stages[0].devices", "devices lists GPU id 0 more than once in '0,0'"],
    ),
    (
        "negative-replicas",
        _both(_set(0, replicas=-1), _set(1, replicas=-1)),
        ["spec.stages[0].replicas", "should be greater than or equal to 0"],
    ),
    (
        "replicas-as-string",
        _set(0, replicas="2"),
        ["spec.stages[0].replicas", "must be of type integer"],
    ),
    (
        "gpu-memory-utilization-above-one",
        _set(0, gpuMemoryUtilization=1.5),
        ["spec.stages[0].gpuMemoryUtilization", "should be less than or equal to 1"],
    ),
    (
        "gpu-memory-utilization-zero",
        _set(0, gpuMemoryUtilization=0),
        ["spec.stages[0].gpuMemoryUtilization", "should be greater than 0"],
    ),
    (
        "router-port-zero",
        _spec(router={"port": 0}),
        ["spec.router.port", "should be greater than or equal to 1"],
    ),
    (
        "router-port-too-high",
        _spec(router={"port": 70000}),
        ["spec.router.port", "should be less than or equal to 65535"],
    ),
    (
        "unknown-stage-type",
        _set(1, type="vae"),
        ["spec.stages[1].type", 'Unsupported value: "vae"', '"llm", "diffusion"'],
    ),
    (
        "unknown-field",
        _set(0, gpus=1),
        ['unknown field "spec.stages[0].gpus"'],
    ),
    (
        "stage-name-not-dns-label",
        _set(0, name="Thinker_1"),
        ["spec.stages[0].name", "name 'Thinker_1' is not a DNS label"],
    ),
    ("missing-model", _del_spec("model"), ["spec.model", "Required value"]),
    ("missing-stages", _del_spec("stages"), ["spec.stages", "Required value"]),
    (
        "no-stages",
        _spec(stages=[]),
        ["spec.stages", "should have at least 1 items"],
    ),
    (
        "output-on-diffusion-stage",
        _set(1, output="text"),
        ["spec.stages[1].output", "only llm stages have an output kind"],
    ),
    (
        "gpu-in-placement-resources",
        _set(0, placement={"resources": {"limits": {"nvidia.com/gpu": 1}}}),
        [
            "spec.stages[0].placement.resources.limits",
            "nvidia.com/gpu is set by the operator from the stages' devices",
        ],
    ),
    (
        "resource-quantity-not-a-quantity",
        _set(0, placement={"resources": {"requests": {"cpu": "lots"}}}),
        ["spec.stages[0].placement.resources.requests.cpu", "should match"],
    ),
    (
        "tensor-parallel-size-zero",
        _set(0, tensorParallelSize=0),
        ["spec.stages[0].tensorParallelSize", "should be greater than 0"],
    ),
    (
        "router-policy",
        _spec(router={"policy": "random"}),
        ["spec.router.policy", 'Unsupported value: "random"', '"round-robin"'],
    ),
    (
        "stage-type-missing",
        lambda m: stage(m, 0).pop("type"),
        [
            "spec.stages",
            "stage 0 has no type, and no known topology of model '/models/tiny' gives it one",
        ],
    ),
    (
        # The topology is found by the last part of the model path only.
        "stage-type-missing-topology-in-directory",
        _both(_spec(model="/models/bagel/tiny"), lambda m: stage(m, 1).pop("type")),
        ["spec.stages", "stage 1 has no type, and no known topology of model"],
    ),
    (
        "gpu-over-subscribed",
        _both(_set(0, gpuMemoryUtilization=0.6), _set(1, gpuMemoryUtilization=0.6)),
        [
            "spec.stages",
            "GPU 0 is over-subscribed: the gpuMemoryUtilization of the stages on it "
            "(stages [0, 1]) sum to 1.2, more than 1; lower them so that they sum to at most 1",
            "an llm stage without gpuMemoryUtilization counts as vLLM's default, 0.92",
        ],
    ),
    (
        # The thinker leaves its share unset: vLLM reserves its default, 0.92.
        "gpu-over-subscribed-by-an-unset-llm-share",
        _set(1, gpuMemoryUtilization=0.1),
        ["spec.stages", "GPU 0 is over-subscribed", "sum to 1.02, more than 1"],
    ),
    (
        # A whole number is still a number in the rule.
        "gpu-over-subscribed-by-a-whole-gpu",
        _both(_set(0, gpuMemoryUtilization=1), _set(1, gpuMemoryUtilization=0.5)),
        ["spec.stages", "GPU 0 is over-subscribed", "(stages [0, 1]) sum to 1.5"],
    ),
    (
        # Stage 0 over GPUs 0 and 1 is summed with each; only GPU 1 is over.
        "gpu-over-subscribed-on-the-second-gpu",
        _both(
            _set(0, devices="0,1", gpuMemoryUtilization=0.6),
            _set(1, devices="1", gpuMemoryUtilization=0.5),
        ),
        ["spec.stages", "GPU 1 is over-subscribed", "(stages [0, 1]) sum to 1.1, more than 1"],
    ),
    (
        # The thinker and the DiT share GPU 0: one Deployment, scaled as one.
        "autoscaling-unequal-in-a-placement-group",
        _both(_set(0, autoscaling={"maxReplicas": 4}), _set(1, autoscaling={"maxReplicas": 8})),
        ["spec.stages", "stages 0 and 1 share a GPU", "give them equal autoscaling"],
    ),
    (
        "autoscaling-planner-without-a-maximum",
        _both(_set(0, autoscaling={"minReplicas": 2}), _set(1, autoscaling={"minReplicas": 2})),
        ["spec.stages[0].autoscaling.maxReplicas", "mode planner needs maxReplicas"],
    ),
    (
        "autoscaling-maximum-below-minimum",
        _both(
            _set(0, autoscaling={"minReplicas": 3, "maxReplicas": 2}),
            _set(1, autoscaling={"minReplicas": 3, "maxReplicas": 2}),
        ),
        ["spec.stages[0].autoscaling.maxReplicas", "maxReplicas (2) is below minReplicas (3)"],
    ),
    (
        "autoscaling-external-with-planner-fields",
        _both(
            _set(0, autoscaling={"mode": "external", "maxReplicas": 2}),
            _set(1, autoscaling={"mode": "external", "maxReplicas": 2}),
        ),
        ["spec.stages[0].autoscaling", "mode external leaves replicas to another autoscaler"],
    ),
    (
        "pipeline-name-not-dns-1035",
        lambda m: m["metadata"].update(name="1-bagel"),
        ["metadata.name", "'1-bagel' names the pipeline's Service", "starting with a letter"],
    ),
]


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


@pytest.mark.parametrize(
    ("breaker", "expected"),
    [pytest.param(breaker, expected, id=case) for case, breaker, expected in INVALID],
)
def test_invalid_pipeline_is_refused(
    kube: Kube, ns: str, breaker: Breaker, expected: list[str]
) -> None:
    manifest = base_pipeline(f"bad-{uuid.uuid4().hex[:6]}")
    breaker(manifest)
    result = apply(kube, manifest, ns)
    assert result.returncode != 0, f"accepted: {json.dumps(manifest['spec'])}"
    for text in expected:
        assert text in result.stderr, f"{text!r} not in:\n{result.stderr}"
    name = manifest["metadata"]["name"]
    missing = kube.kubectl("get", "omnipipeline", name, namespace=ns, check=False)
    assert "NotFound" in missing.stderr, missing.stdout


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


def test_shared_memory_through_a_stage_in_between_is_admitted(kube: Kube, ns: str) -> None:
    # Stages 0 (GPU 0) and 1 (GPU 1) share no GPU, but stage 2 uses both, so all three are
    # one placement group and shared memory between 0 and 1 works.
    manifest = base_pipeline("bridged")
    stage(manifest, 0)["gpuMemoryUtilization"] = 0.5
    stage(manifest, 1)["devices"] = "1"
    manifest["spec"]["stages"].append(
        {
            "stageId": 2,
            "name": "bridge",
            "type": "llm",
            "devices": "0,1",
            "gpuMemoryUtilization": 0.4,
        }
    )
    result = apply(kube, manifest, ns)
    assert result.returncode == 0, result.stderr


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


@pytest.mark.parametrize(
    "shares",
    [
        # Shares that fill GPU 0 exactly, in floating point a hair above 1 or not.
        {0: 0.45, 1: 0.55},
        {0: 0.1, 1: 0.9},
        # Without a share the DiT is not counted: it takes what the thinker leaves.
        {0: 0.92},
        {0: 1},
    ],
    ids=str,
)
def test_gpu_shares_that_fit_are_admitted(kube: Kube, ns: str, shares: dict[int, float]) -> None:
    manifest = base_pipeline(f"fits-{uuid.uuid4().hex[:6]}")
    for index, share in shares.items():
        stage(manifest, index)["gpuMemoryUtilization"] = share
    result = apply(kube, manifest, ns)
    assert result.returncode == 0, result.stderr


def test_gpu_shares_on_different_gpus_are_not_summed(kube: Kube, ns: str) -> None:
    manifest = base_pipeline("apart")
    manifest["spec"]["stages"] = [
        {"stageId": 0, "name": "a", "type": "llm", "devices": "0", "gpuMemoryUtilization": 0.9},
        {"stageId": 1, "name": "b", "type": "llm", "devices": "1", "gpuMemoryUtilization": 0.9},
        # CPU stages share no GPU, whatever they declare.
        {"stageId": 2, "name": "c", "type": "llm", "devices": "cpu", "gpuMemoryUtilization": 0.9},
        {"stageId": 3, "name": "d", "type": "llm", "devices": "cpu", "gpuMemoryUtilization": 0.9},
    ]
    result = apply(kube, manifest, ns)
    assert result.returncode == 0, result.stderr


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
            "z-image-turbo-pipeline.yaml",
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
