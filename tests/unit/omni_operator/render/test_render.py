"""Unit tests of omni_operator.render: the objects one OmniPipeline becomes.

The rendered objects of the two example pipelines (manifests/examples/) are compared with
golden files in golden/ beside this file. After a deliberate change to the renderer,
regenerate them and review the diff:

    OMNI_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -k golden \
        tests/unit/omni_operator/render/test_render.py
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_operator.api import (
    API_VERSION,
    DEFAULT_RUNTIME_IMAGE,
    KIND,
    OmniPipelineSpec,
    runtime_config,
)
from omni_operator.placement import check_spec
from omni_operator.reconciler import prune_set
from omni_operator.render import render
from omni_operator.render.config import config_data, config_hash
from omni_operator.render.names import (
    CHILD_KINDS,
    FIELD_MANAGER,
    LABEL_COMPONENT,
    LABEL_GROUP,
    LABEL_MANAGED_BY,
    LABEL_PIPELINE,
    LABEL_STAGES,
    endpoint_url,
    group_object_name,
    label_value,
    object_key,
    object_name,
    router_object_name,
)
from omni_operator.render.quantities import canonical_quantity, read_quantity, sum_quantities
from omni_operator.render.stages import STAGE_STARTUP_TIMEOUT_S
from omni_runtime.config import dump_pipeline, load_pipeline
from omni_runtime.pod_contract import ANNOTATION_CONFIG_HASH
from pipeline_specs import spec_of, stage_of

ROOT = Path(__file__).resolve().parents[4]
EXAMPLES = ROOT / "manifests" / "examples"
GOLDEN = Path(__file__).parent / "golden"
UPDATE_GOLDEN = os.environ.get("OMNI_UPDATE_GOLDEN") == "1"
NAMESPACE = "omni"
UID = "00000000-0000-4000-8000-000000000001"
IMAGE = DEFAULT_RUNTIME_IMAGE
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
GPU = "nvidia.com/gpu"


def _manifest(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    return data


def _example(name: str) -> tuple[str, OmniPipelineSpec]:
    data = _manifest(name)
    return data["metadata"]["name"], OmniPipelineSpec.model_validate(data["spec"])


def _render(spec: OmniPipelineSpec, name: str = "p") -> list[dict[str, Any]]:
    return render(name, NAMESPACE, UID, spec, default_image=IMAGE)


def _by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in objects}


def _deployments(objects: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    return (obj for obj in objects if obj["kind"] == "Deployment")


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in container["env"]}


def _config_hash(objects: list[dict[str, Any]]) -> set[str]:
    return {
        d["spec"]["template"]["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
        for d in _deployments(objects)
    }


# ----------------------------------------------------------------------------- golden


class _GoldenDumper(yaml.SafeDumper):
    """Multi-line strings (the pipeline.json) as literal blocks, readable in a diff."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_GoldenDumper.add_representer(str, _represent_str)


@pytest.mark.parametrize("example", ["bagel-pipeline.yaml", "tiny-pipeline.yaml"])
def test_golden(example: str) -> None:
    name, spec = _example(example)
    text = yaml.dump_all(_render(spec, name), Dumper=_GoldenDumper, sort_keys=True)
    golden = GOLDEN / example
    if UPDATE_GOLDEN:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"no {golden}; create it with OMNI_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), (
        f"render of {example} differs from {golden.name}; if intended, regenerate with "
        "OMNI_UPDATE_GOLDEN=1 and review the diff"
    )


def test_rendering_is_deterministic_and_json_able() -> None:
    name, spec = _example("bagel-pipeline.yaml")
    first = json.dumps(_render(spec, name))
    again = json.dumps(
        render(name, NAMESPACE, UID, spec.model_copy(deep=True), default_image=IMAGE)
    )
    assert first == again


# ------------------------------------------------------------------------- the examples


def test_bagel_example_is_the_seeds_config() -> None:
    _, spec = _example("bagel-pipeline.yaml")
    assert check_spec(spec) == []
    ours = dump_pipeline(runtime_config(spec))
    seed = dump_pipeline(
        load_pipeline(ROOT / "examples" / "bagel.yaml", model="ByteDance-Seed/BAGEL-7B-MoT")
    )
    # What the example adds to the seed's file: the router's port (the seed serves on 8091).
    assert ours.pop("router")["port"] == 8091
    seed.pop("router")
    assert ours == seed


def test_bagel_renders_one_gpu_pod_for_both_stages() -> None:
    name, spec = _example("bagel-pipeline.yaml")
    objects = _by_key(_render(spec, name))
    config_map = next(key for key in objects if key[0] == "ConfigMap")
    assert config_map[1] == f"bagel-config-{config_hash(config_data(spec, name))}"
    assert sorted(objects) == [
        config_map,
        ("Deployment", "bagel-router"),
        ("Deployment", "bagel-thinker-dit"),
        ("NetworkPolicy", "bagel-router"),
        ("NetworkPolicy", "bagel-stages"),
        ("Role", "bagel-router"),
        ("RoleBinding", "bagel-router"),
        ("Service", "bagel"),
        ("Service", "bagel-thinker-dit"),
        ("ServiceAccount", "bagel-router"),
    ]
    stages = objects[("Deployment", "bagel-thinker-dit")]
    container = _container(stages)
    assert container["resources"]["limits"][GPU] == "1"
    assert container["resources"]["requests"][GPU] == "1"
    assert container["resources"]["requests"]["cpu"] == "8"
    assert container["resources"]["requests"]["memory"] == "64Gi"
    env = _env(container)
    assert env["OMNI_CUDA_VISIBLE_DEVICES_0"] == "0"
    assert env["OMNI_CUDA_VISIBLE_DEVICES_1"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in env
    pod = stages["spec"]["template"]["spec"]
    assert {"name": "omni-shm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert stages["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    endpoint = objects[("Service", "bagel")]["spec"]["ports"]
    assert endpoint == [{"name": "http", "port": 8091, "targetPort": "http", "protocol": "TCP"}]


def test_tiny_example_loads_locally_and_runs_its_stages_apart() -> None:
    # The local serve reads the same file, without its Kubernetes-only fields.
    local = load_pipeline(EXAMPLES / "tiny-pipeline.yaml")
    name, spec = _example("tiny-pipeline.yaml")
    assert check_spec(spec) == []
    assert dump_pipeline(local) == dump_pipeline(runtime_config(spec))
    assert local.connectors["tcp_connector"].name == "TCPConnector"
    deployments = {d["metadata"]["name"]: d for d in _deployments(_render(spec, name))}
    assert sorted(deployments) == ["tiny-dit", "tiny-router", "tiny-thinker"]
    for group in ("tiny-thinker", "tiny-dit"):
        container = _container(deployments[group])
        assert _env(container)["CUDA_VISIBLE_DEVICES"] == ""
        assert GPU not in json.dumps(container)
        volumes = deployments[group]["spec"]["template"]["spec"]["volumes"]
        assert "omni-shm" not in {v["name"] for v in volumes}


# ------------------------------------------------------------------- ownership, labels


@pytest.mark.parametrize("example", ["bagel-pipeline.yaml", "tiny-pipeline.yaml"])
def test_every_child_is_owned_labelled_and_a_listed_kind(example: str) -> None:
    name, spec = _example(example)
    kinds = {(kind.api_version, kind.kind) for kind in CHILD_KINDS}
    objects = _render(spec, name)
    for obj in objects:
        meta = obj["metadata"]
        assert (obj["apiVersion"], obj["kind"]) in kinds
        assert meta["namespace"] == NAMESPACE
        assert meta["ownerReferences"] == [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": name,
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"][LABEL_PIPELINE] == name
        assert meta["labels"][LABEL_MANAGED_BY] == FIELD_MANAGER
        assert meta["labels"]["app.kubernetes.io/part-of"] == name
        assert meta["labels"][LABEL_COMPONENT] in ("config", "stages", "router")
        assert DNS_LABEL.fullmatch(meta["name"])
    assert len({object_key(obj) for obj in objects}) == len(objects)


def test_stage_groups_carry_their_group_and_stages() -> None:
    spec = spec_of([stage_of(0, "0"), stage_of(1, "0"), stage_of(2)])
    objects = _by_key(_render(spec))
    labels = objects[("Deployment", "p-s0-s1")]["spec"]["template"]["metadata"]["labels"]
    assert labels[LABEL_GROUP] == "s0-s1"
    assert labels[LABEL_STAGES] == "s0.s1"
    assert objects[("Service", "p-s2")]["metadata"]["labels"][LABEL_STAGES] == "s2"


@pytest.mark.parametrize("example", ["bagel-pipeline.yaml", "tiny-pipeline.yaml"])
def test_selectors_select_their_own_pods_only(example: str) -> None:
    name, spec = _example(example)
    objects = _render(spec, name)
    templates = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in _deployments(objects)
    }
    for deployment in _deployments(objects):
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= templates[deployment["metadata"]["name"]].items()
    for obj in objects:
        if obj["kind"] not in ("Service", "PodDisruptionBudget"):
            continue
        spec_selector = obj["spec"]["selector"]
        selector = spec_selector.get("matchLabels", spec_selector)
        matching = [n for n, labels in templates.items() if selector.items() <= labels.items()]
        expected = (
            router_object_name(name)
            if obj["metadata"]["name"] == name
            else (obj["metadata"]["name"])
        )
        assert matching == [expected], obj["metadata"]["name"]


def test_every_child_carries_its_pipelines_label() -> None:
    """The handlers map a child's event back to its pipeline by this label alone, a long
    name's shortened as label values must be."""
    spec = spec_of([stage_of(0)])
    long_name = "p" * 100
    for name in ("p", long_name):
        value = label_value(name)
        assert len(value) <= 63
        assert all(
            obj["metadata"]["labels"][LABEL_PIPELINE] == value for obj in _render(spec, name)
        )


# ----------------------------------------------------------------- pods and containers


def test_stage_command_runs_the_groups_stages_on_their_ports() -> None:
    spec = spec_of([stage_of(0, "0"), stage_of(2, "0"), stage_of(1)])
    container = _container(_by_key(_render(spec))[("Deployment", "p-s0-s2")])
    assert container["name"] == "stages"
    assert container["command"] == ["omni-runtime"]
    assert container["args"] == [
        "stage",
        "-f",
        "/etc/omni/pipeline.json",
        "--stages",
        "0,2",
        "--port",
        "0=52000",
        "--port",
        "2=52002",
        "--health-port",
        "8081",
        "--startup-timeout",
        str(STAGE_STARTUP_TIMEOUT_S),
    ]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"stage-0": 52000, "stage-2": 52002, "health": 8081}
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert container["startupProbe"]["httpGet"]["path"] == "/livez"
    # The kubelet waits out each stage's own startup timeout, one stage after the other.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > 2 * STAGE_STARTUP_TIMEOUT_S


def test_headless_service_has_a_port_per_stage() -> None:
    spec = spec_of([stage_of(0, "0"), stage_of(3, "0")])
    service = _by_key(_render(spec))[("Service", "p-s0-s3")]["spec"]
    assert service["clusterIP"] == "None"
    assert service["publishNotReadyAddresses"] is False
    assert service["ports"] == [
        {"name": "stage-0", "port": 52000, "targetPort": 52000, "protocol": "TCP"},
        {"name": "stage-3", "port": 52003, "targetPort": 52003, "protocol": "TCP"},
    ]


def test_router_discovers_every_stage_through_its_groups_service() -> None:
    spec = spec_of(
        [stage_of(0, "0"), stage_of(1), stage_of(2, "0")],
        router={"port": 9000, "serviceType": "NodePort"},
    )
    objects = _by_key(_render(spec))
    deployment = objects[("Deployment", "p-router")]
    container = _container(deployment)
    assert container["args"] == [
        "router",
        "-f",
        "/etc/omni/pipeline.json",
        "--port",
        "9000",
        "--discover-namespace",
        "$(OMNI_NAMESPACE)",
        "--stage-service",
        "0=p-s0-s2",
        "--stage-service",
        "1=p-s1",
        "--stage-service",
        "2=p-s0-s2",
    ]
    assert _env(container)["OMNI_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "p-router"
    assert pod["automountServiceAccountToken"] is True
    assert objects[("Service", "p")]["spec"]["type"] == "NodePort"
    role = objects[("Role", "p-router")]
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = objects[("RoleBinding", "p-router")]
    assert binding["roleRef"]["name"] == "p-router"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "p-router", "namespace": NAMESPACE}
    ]


def test_pods_run_unprivileged_on_a_read_only_root() -> None:
    spec = spec_of([stage_of(0, "0"), stage_of(1)])
    for deployment in _deployments(_render(spec)):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "fsGroup": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        assert pod["terminationGracePeriodSeconds"] == 45  # 5 s preStop + 30 s drain + 10
        assert pod["enableServiceLinks"] is False
        container = _container(deployment)
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/tmp"] == "omni-tmp"
        assert mounts["/var/lib/omni"] == "omni-home"
        assert mounts["/etc/omni"] == "omni-config"
        assert _env(container)["HOME"] == "/var/lib/omni"
        assert _env(container)["HF_HOME"] == "/var/lib/omni/hf"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["omni-config"] == {
            "name": "omni-config",
            "configMap": {"name": f"p-config-{config_hash(config_data(spec, 'p'))}"},
        }
        if deployment["metadata"]["name"] != "p-router":
            assert pod["automountServiceAccountToken"] is False
            assert "serviceAccountName" not in pod


def test_config_map_holds_the_runtime_pipeline() -> None:
    spec = spec_of([stage_of(0, placement={"image": "x:1"})], router={"replicas": 2})
    config = _by_key(_render(spec))[
        ("ConfigMap", f"p-config-{config_hash(config_data(spec, 'p'))}")
    ]
    assert config["immutable"] is True
    loaded = load_pipeline(json.loads(config["data"]["pipeline.json"]))
    assert dump_pipeline(loaded) == dump_pipeline(runtime_config(spec))
    assert "placement" not in config["data"]["pipeline.json"]


def test_gpu_counts_and_visible_devices_per_group() -> None:
    spec = spec_of([stage_of(0, "4,6"), stage_of(1, "6"), stage_of(2, "3"), stage_of(3)])
    deployments = {d["metadata"]["name"]: d for d in _deployments(_render(spec))}
    big = _container(deployments["p-s0-s1"])
    assert big["resources"] == {"requests": {GPU: "2"}, "limits": {GPU: "2"}}
    assert _env(big)["OMNI_CUDA_VISIBLE_DEVICES_0"] == "0,1"
    assert _env(big)["OMNI_CUDA_VISIBLE_DEVICES_1"] == "1"
    small = _container(deployments["p-s2"])
    assert small["resources"]["limits"][GPU] == "1"
    assert _env(small)["OMNI_CUDA_VISIBLE_DEVICES_2"] == "0"
    cpu = deployments["p-s3"]
    assert "resources" not in _container(cpu)
    assert "tolerations" not in cpu["spec"]["template"]["spec"]
    assert cpu["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": "25%"}
    assert deployments["p-router"]["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == "25%"


@pytest.mark.parametrize(
    ("stages", "shm"),
    [
        ([stage_of(0, "0"), stage_of(1, "0", inputConnectors={"from_stage_0": "shm"})], True),
        ([stage_of(0, "0"), stage_of(1, "0", inputConnectors={"from_stage_0": "tcp"})], False),
        ([stage_of(0, "0,1", tensorParallelSize=2)], True),
        ([stage_of(0, "0,1", dataParallelSize=2)], True),
        ([stage_of(0, "0")], False),
    ],
)
def test_dev_shm_only_where_shared_memory_is_used(stages: list[dict[str, Any]], shm: bool) -> None:
    deployment = next(_deployments(_render(spec_of(stages))))
    volumes = {v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"] for m in _container(deployment)["volumeMounts"]}
    assert ("omni-shm" in volumes) is shm
    assert ("/dev/shm" in mounts) is shm


def test_placement_is_merged_over_a_group() -> None:
    gpu_taint = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    spot = {"key": "spot", "operator": "Equal", "value": "yes", "effect": "NoSchedule"}
    affinity: dict[str, Any] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}
    }
    spec = spec_of(
        [
            stage_of(
                0,
                "0",
                placement={
                    "nodeSelector": {"b": "2"},
                    "tolerations": [spot, gpu_taint],
                    "env": [{"name": "X", "value": "1"}],
                    "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "c"}}],
                    "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
                    "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
                },
            ),
            stage_of(
                1,
                "0",
                placement={
                    "nodeSelector": {"a": "1"},
                    "tolerations": [spot],
                    "affinity": affinity,
                    "env": [
                        {"name": "Y", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
                    ],
                    "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "c"}}],
                    "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
                    "resources": {"requests": {"cpu": "1", "memory": "512Mi"}},
                },
            ),
        ],
        image="base:1",
        imagePullPolicy="Always",
    )
    assert check_spec(spec) == []
    deployment = next(_deployments(_render(spec)))
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    assert container["image"] == "base:1"
    assert container["imagePullPolicy"] == "Always"
    assert pod["nodeSelector"] == {"a": "1", "b": "2"}
    assert pod["tolerations"] == [spot, gpu_taint]
    assert pod["affinity"] == affinity
    assert [v["name"] for v in pod["volumes"]].count("models") == 1
    assert [m["mountPath"] for m in container["volumeMounts"]].count("/models") == 1
    assert container["resources"]["requests"] == {"cpu": "1500m", "memory": "1536Mi", GPU: "1"}
    # The operator's variables first, then the placement's.
    names = [var["name"] for var in container["env"]]
    assert names[-2:] == ["X", "Y"]
    assert names.index("HOME") < names.index("X")


def test_an_unchecked_reserved_variable_never_overrides_the_operators() -> None:
    spec = spec_of(
        [
            stage_of(
                0, placement={"env": [{"name": "HOME", "value": "/"}, {"name": "Z", "value": "z"}]}
            )
        ]
    )
    assert check_spec(spec)  # refused before rendering, normally
    container = _container(next(_deployments(_render(spec))))
    homes = [var for var in container["env"] if var["name"] == "HOME"]
    assert homes == [{"name": "HOME", "value": "/var/lib/omni"}]
    assert _env(container)["Z"] == "z"


def test_image_defaults_from_stage_to_spec_to_the_operator() -> None:
    stages = [stage_of(0, placement={"image": "own:1"}), stage_of(1)]
    with_spec = {
        d["metadata"]["name"]: _container(d)["image"]
        for d in _deployments(_render(spec_of(stages, image="spec:1")))
    }
    assert with_spec == {"p-s0": "own:1", "p-s1": "spec:1", "p-router": "spec:1"}
    bare = {
        d["metadata"]["name"]: _container(d)["image"]
        for d in _deployments(_render(spec_of(stages)))
    }
    assert bare["p-s1"] == IMAGE
    assert bare["p-router"] == IMAGE
    # A GPU pod that names no image runs the runtime's CUDA build; CPU pods keep the other.
    gpu = spec_of([stage_of(0, "0"), stage_of(1)])
    images = {
        d["metadata"]["name"]: _container(d)["image"]
        for d in _deployments(
            render("p", NAMESPACE, UID, gpu, default_image=IMAGE, default_gpu_image="cuda:1")
        )
    }
    assert images == {"p-s0": "cuda:1", "p-s1": IMAGE, "p-router": IMAGE}


def test_limits_are_summed_and_requests_default_to_limits() -> None:
    spec = spec_of(
        [
            stage_of(0, "0", placement={"resources": {"limits": {"memory": "2Gi", "cpu": 2}}}),
            stage_of(
                1,
                "0",
                placement={
                    "resources": {
                        "requests": {"memory": "1Gi"},
                        "limits": {"memory": "3Gi", "cpu": "500m"},
                    }
                },
            ),
        ]
    )
    resources = _container(next(_deployments(_render(spec))))["resources"]
    assert resources["limits"] == {"cpu": "2500m", "memory": "5Gi", GPU: "1"}
    assert resources["requests"] == {"cpu": "2500m", "memory": "3Gi", GPU: "1"}


# ------------------------------------------------------------------------ PDB, replicas


def test_pdb_only_where_replicas_exceed_one() -> None:
    spec = spec_of(
        [stage_of(0, "0", replicas=2), stage_of(1, replicas=1), stage_of(2, replicas=0)],
        router={"replicas": 3},
    )
    objects = _render(spec)
    pdbs = {o["metadata"]["name"]: o for o in objects if o["kind"] == "PodDisruptionBudget"}
    assert sorted(pdbs) == ["p-router", "p-s0"]
    assert pdbs["p-s0"]["spec"]["maxUnavailable"] == 1
    assert pdbs["p-s0"]["apiVersion"] == "policy/v1"
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d in _deployments(objects)}
    assert replicas == {"p-s0": 2, "p-s1": 1, "p-s2": 0, "p-router": 3}
    assert all(d["spec"]["revisionHistoryLimit"] == 3 for d in _deployments(objects))


# --------------------------------------------------------------------------- config hash


def test_config_hash_changes_with_the_config_only() -> None:
    base: dict[str, Any] = {
        "stages": [stage_of(0, defaultSamplingParams={"seed": 1})],
        "router": {"replicas": 1},
    }
    before = _config_hash(_render(spec_of(**copy.deepcopy(base))))
    assert len(before) == 1
    assert re.fullmatch(r"[0-9a-f]{16}", next(iter(before)))

    scaled = copy.deepcopy(base)
    scaled["router"]["replicas"] = 4
    scaled["stages"][0]["replicas"] = 3
    assert _config_hash(_render(spec_of(**scaled))) == before

    placed = copy.deepcopy(base)
    placed["stages"][0]["placement"] = {"image": "other:2"}
    assert _config_hash(_render(spec_of(**placed))) == before

    changed = copy.deepcopy(base)
    changed["stages"][0]["defaultSamplingParams"]["seed"] = 2
    assert _config_hash(_render(spec_of(**changed))) != before


# ------------------------------------------------------------------------------- names


def test_long_names_are_cut_and_hashed_into_valid_unique_names() -> None:
    spec = spec_of([stage_of(0, name="a" * 40), stage_of(1, name="b" * 40)])
    one, two = "x" * 60 + "-one", "x" * 60 + "-two"
    names_one = {obj["metadata"]["name"] for obj in _render(spec, one)}
    names_two = {obj["metadata"]["name"] for obj in _render(spec, two)}
    assert not names_one & names_two
    for obj in _render(spec, one):
        assert DNS_LABEL.fullmatch(obj["metadata"]["name"]), obj["metadata"]["name"]
        for value in obj["metadata"]["labels"].values():
            assert len(value) <= 63
    assert group_object_name("short", "a" * 40) == "short-" + "a" * 40
    assert len(group_object_name("p" * 30, "a" * 40)) == 63


@pytest.mark.parametrize(
    ("parts", "expected"),
    [(("bagel", "router"), "bagel-router"), (("a1",), "a1")],
)
def test_valid_names_are_kept(parts: tuple[str, ...], expected: str) -> None:
    assert object_name(*parts) == expected


@pytest.mark.parametrize("name", ["my.pipeline", "1pipeline", "Big"])
def test_names_that_are_no_dns_label_become_one(name: str) -> None:
    result = object_name(name)
    assert DNS_LABEL.fullmatch(result)
    assert result != object_name(name + "x")


def test_label_values_are_kept_or_cut() -> None:
    assert label_value("thinker.dit") == "thinker.dit"
    cut = label_value("s" * 80)
    assert len(cut) <= 63
    assert re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", cut)
    assert cut != label_value("s" * 81)


def test_endpoint_url_names_the_router_service() -> None:
    assert endpoint_url("bagel", "ml", 8091) == "http://bagel.ml.svc:8091"


# ------------------------------------------------------------------------------ pruning


def _child(kind: str, name: str, *, pipeline: str = "p", uid: str | None = UID) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "labels": {LABEL_PIPELINE: pipeline, LABEL_MANAGED_BY: "omni-operator"},
    }
    if uid is not None:
        meta["ownerReferences"] = [{"kind": KIND, "name": pipeline, "uid": uid}]
    api_version = "apps/v1" if kind == "Deployment" else "v1"
    return {"apiVersion": api_version, "kind": kind, "metadata": meta}


def test_prune_set_is_what_is_ours_and_no_longer_desired() -> None:
    desired = _render(spec_of([stage_of(0)]))
    stale_deployment = _child("Deployment", "p-old")
    stale_service = _child("Service", "p-old")
    orphan = _child("Deployment", "p-orphan", uid=None)  # its owner link removed
    existing = [
        *copy.deepcopy(desired),
        stale_service,
        stale_deployment,
        orphan,
        _child("Deployment", "p-theirs", uid="another-uid"),
        _child("Deployment", "q-old", pipeline="q"),
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "p-unmanaged", "labels": {LABEL_PIPELINE: "p"}},
        },
    ]
    pruned = prune_set(desired, existing)
    assert [object_key(o) for o in pruned] == [
        object_key(stale_deployment),
        object_key(orphan),
        object_key(stale_service),
    ]


def test_a_desired_object_of_another_kind_with_the_same_name_is_still_pruned() -> None:
    desired = _render(spec_of([stage_of(0)]))
    # A Service p-s0 is desired; a ConfigMap p-s0 is not.
    stale = _child("ConfigMap", "p-s0")
    assert prune_set(desired, [stale]) == [stale]


def test_prune_set_of_nothing_desired_is_empty() -> None:
    assert prune_set([], [_child("Deployment", "p-old")]) == []


def test_removing_a_stage_prunes_its_group() -> None:
    two = _render(spec_of([stage_of(0), stage_of(1, inputConnectors={"from_stage_0": "tcp"})]))
    one = _render(spec_of([stage_of(0)]))
    pruned = {object_key(o) for o in prune_set(one, two)}
    assert pruned == {("apps/v1", "Deployment", "p-s1"), ("v1", "Service", "p-s1")}


# --------------------------------------------------------------------------- quantities


@pytest.mark.parametrize(
    ("text", "value", "binary"),
    [
        ("500m", Decimal("0.5"), False),
        ("2", Decimal(2), False),
        (3, Decimal(3), False),
        ("1.5Gi", Decimal(3 * 2**29), True),
        ("1e3", Decimal(1000), False),
        ("1E", Decimal(10**18), False),
        ("100n", Decimal("1e-7"), False),
        (".5k", Decimal(500), False),
    ],
)
def test_quantities_parse_exactly(text: str | int, value: Decimal, binary: bool) -> None:
    parsed = read_quantity(text)
    assert parsed is not None
    assert (parsed.value, parsed.binary) == (value, binary)


# The official client's parser takes some of these ('1 Gi', 'NaN', '1_000'); the CRD's
# pattern does not, and neither does the renderer.
@pytest.mark.parametrize(
    "text", ["", "1.2.3", "5Gb", "lots", "1 Gi", "NaN", "Infinity", "1_000", "1K", True]
)
def test_non_quantities_do_not_parse(text: str | bool) -> None:
    assert read_quantity(text) is None


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (["500m", "1"], "1500m"),
        (["1Gi", "512Mi"], "1536Mi"),
        (["1Gi", "1Gi"], "2Gi"),
        (["1000", "1000"], "2k"),
        (["1Gi", "500M"], "1573741824"),
        (["100m", "1e-1"], "200m"),
        (["1", "1u"], "1000001u"),
        (["1.0", "1"], "2"),
        (["1.000Gi", "1Gi"], "2Gi"),
        (["1500", "1"], "1501"),
        # Exact far beyond float's 17 digits.
        (["123456789012345678901", "1n"], "123456789012345678901000000001n"),
        (["5Gi", "not-a-quantity"], "5Gi"),
        (["only"], "only"),
        ([2], "2"),
    ],
)
def test_quantities_sum_canonically(values: list[str | int], expected: str) -> None:
    assert sum_quantities(values) == expected


def test_format_rounds_up_below_a_nano() -> None:
    assert canonical_quantity(Decimal("1e-10"), binary=False) == "1n"
    assert canonical_quantity(Decimal(0), binary=True) == "0"
    assert canonical_quantity(Decimal(1000), binary=True) == "1k"
    assert canonical_quantity(Decimal(-2048), binary=True) == "-2Ki"


def test_each_config_has_a_configmap_of_its_own_and_the_one_in_use_outlives_it_once() -> None:
    # A ConfigMap changed in place is rewritten under the old pods (an old container that
    # restarts would read the new config under its old revision): each revision's pods
    # mount that revision's configuration.
    old_spec = spec_of([stage_of(0), stage_of(1)])
    new_spec = spec_of([stage_of(0), stage_of(1, defaultSamplingParams={"seed": 3})])
    old, new = _render(old_spec), _render(new_spec)

    def config_maps(objects: list[dict[str, Any]]) -> set[str]:
        return {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}

    assert config_maps(old) != config_maps(new)
    for objects, spec in ((old, old_spec), (new, new_spec)):
        wanted = f"p-config-{config_hash(config_data(spec, 'p'))}"
        for deployment in (o for o in objects if o["kind"] == "Deployment"):
            volumes = deployment["spec"]["template"]["spec"]["volumes"]
            assert {"name": "omni-config", "configMap": {"name": wanted}} in volumes

    # Live: the old objects. The old ConfigMap is what the Deployments still mount (their
    # old ReplicaSets' pods read it while the rollout runs): kept, for now.
    assert prune_set(new, old) == []
    # Once the Deployments mount the new one, the old goes.
    live = [o for o in old if o["kind"] == "ConfigMap"] + new
    assert [o["metadata"]["name"] for o in prune_set(new, live)] == sorted(config_maps(old))


def test_the_video_stores_password_reaches_the_router_from_its_secret() -> None:
    spec = spec_of(
        [{"stageId": 0, "name": "dit", "type": "diffusion"}],
        family="wan2.2",
        router={
            "videos": {"storeUrl": "redis://redis.demo.svc:6379/0"},
            "videoStorePasswordSecretRef": {"name": "redis-auth"},
        },
    )
    objects = _by_key(_render(spec))
    container = _container(objects[("Deployment", "p-router")])
    assert _env(container)["OMNI_VIDEO_STORE_PASSWORD"] == {
        "secretKeyRef": {"name": "redis-auth", "key": "password"}
    }
    # The ConfigMap's pipeline has the store's URL and no word of the Secret.
    config = next(o for (kind, _), o in objects.items() if kind == "ConfigMap")
    pipeline = next(iter(config["data"].values()))
    assert "redis://redis.demo.svc:6379/0" in pipeline
    assert "redis-auth" not in pipeline


def test_adapters_example_mounts_its_claim_where_its_sources_are() -> None:
    documents = list(yaml.safe_load_all((EXAMPLES / "z-image-adapters-pipeline.yaml").read_text()))
    claim = next(d for d in documents if d["kind"] == "PersistentVolumeClaim")
    manifest = next(d for d in documents if d["kind"] == "OmniPipeline")
    spec = OmniPipelineSpec.model_validate(manifest["spec"])
    objects = _by_key(_render(spec, "z-image-loras"))
    pod = objects[("Deployment", "z-image-loras-encoder-dit")]["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "loras")
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    mounts = {m["mountPath"]: m for m in _container_of(pod)["volumeMounts"]}
    assert mounts["/loras"]["readOnly"] is True
    # Every adapter that is a path in the pod lies under the claim's mount.
    paths = [a.source for a in spec.adapters or () if a.source.startswith("/")]
    assert paths
    assert all(path.startswith("/loras/") for path in paths)
    # The stages' config carries the adapters as declared: each replica loads from it.
    config = next(o for k, o in objects.items() if k[0] == "ConfigMap")
    loaded = load_pipeline(json.loads(config["data"]["pipeline.json"]))
    assert [a.name for a in loaded.adapters or ()] == ["ink-wash", "pixel-art", "film-grain"]
    assert loaded.adapter_capacity(loaded.stage(1)) == 4


def _container_of(pod: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = pod["containers"][0]
    return container
