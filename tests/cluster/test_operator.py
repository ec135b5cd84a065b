"""The operator against the real control plane: kopf in a process of its own, real kubectl.

Each test runs its own operator, watching only the test's namespace, so that killing it
(or a slow one) cannot touch another test. Pods are kwok's: they become Running and Ready
without a kubelet, which is what the status logic needs.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from operator_harness import CRD_FILE, OUR_KINDS, OperatorProcess, example

from omni_runtime.config.credentials import KEY_FILES

if TYPE_CHECKING:
    from conftest import Kube

Eventually = Callable[..., Any]
PIPELINE_LABEL = "omni.dev/pipeline"


@pytest.fixture(scope="module")
def crd(kube: Kube) -> Iterator[None]:
    kube.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    kube.wait_crd_established("omnipipelines.omni.dev")
    return


@pytest.fixture
def operator(kube: Kube, crd: None, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    op = OperatorProcess(kube.env(), namespace, tmp_path / "operator.log")
    op.start()
    try:
        yield op
    finally:
        op.stop()
        print(f"--- operator log (tail) ---\n{op.log_tail()}")


def pipeline(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    body: dict[str, Any] = kube.get_json("omnipipeline", name, namespace=namespace)
    return body


def children(kube: Kube, namespace: str, name: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object, of every object labelled as the pipeline's."""
    listed = kube.get_json(
        ",".join(OUR_KINDS), "-l", f"{PIPELINE_LABEL}={name}", namespace=namespace
    )
    return {(item["kind"], item["metadata"]["name"]): item for item in listed["items"]}


def phase_is(kube: Kube, namespace: str, name: str, phase: str) -> Callable[[], bool]:
    def check() -> bool:
        status = pipeline(kube, namespace, name).get("status", {})
        assert status.get("phase") == phase, f"status: {json.dumps(status)[:800]}"
        return True

    return check


def condition(body: dict[str, Any], type_: str) -> dict[str, Any]:
    for cond in body.get("status", {}).get("conditions", []):
        if cond["type"] == type_:
            return dict(cond)
    raise AssertionError(f"no {type_} condition in {body.get('status')}")


def events(kube: Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    listed = kube.get_json(
        "events",
        f"--field-selector=involvedObject.kind=OmniPipeline,involvedObject.name={name}",
        namespace=namespace,
    )
    return list(listed["items"])


def reasons(kube: Kube, namespace: str, name: str) -> list[str]:
    return [f"{e['reason']}: {e.get('message', '')}" for e in events(kube, namespace, name)]


def apply(kube: Kube, namespace: str, body: dict[str, Any]) -> None:
    kube.apply(body, namespace=namespace)


def deploy_tiny(kube: Kube, namespace: str, eventually: Eventually) -> tuple[dict[str, Any], str]:
    """The tiny example applied and Ready: its manifest and name."""
    body = example("tiny-pipeline.yaml")
    name: str = body["metadata"]["name"]
    apply(kube, namespace, body)
    # kwok readies the pods within seconds; CI runs this beside the integration suite on
    # two cores, where one run waited past 90 s.
    eventually(phase_is(kube, namespace, name, "Ready"), timeout=180, what=f"{name} Ready")
    return body, name


def test_bagel_example_deploys_with_gpu_requests_and_reports_ready(
    kube: Kube, namespace: str, operator: OperatorProcess, eventually: Eventually
) -> None:
    body = example("bagel-pipeline.yaml")
    name = body["metadata"]["name"]
    apply(kube, namespace, body)
    eventually(phase_is(kube, namespace, name, "Ready"), timeout=90, what="bagel Ready")

    objs = children(kube, namespace, name)
    kinds = sorted(kind for kind, _ in objs)
    assert kinds.count("ConfigMap") == 1
    assert kinds.count("Deployment") == 2, sorted(objs)  # thinker+DiT share GPU 0; router
    stage_deps = [
        o
        for (kind, _), o in objs.items()
        if kind == "Deployment" and o["metadata"]["labels"]["omni.dev/component"] == "stages"
    ]
    assert len(stage_deps) == 1
    pod = stage_deps[0]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] in (1, "1")
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert env["OMNI_CUDA_VISIBLE_DEVICES_0"] == "0"
    assert env["OMNI_CUDA_VISIBLE_DEVICES_1"] == "0"
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])
    for kind in ("Service", "ServiceAccount", "Role", "RoleBinding"):
        assert kind in kinds, f"no {kind} among {sorted(objs)}"
    for obj in objs.values():
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner["kind"] == "OmniPipeline"
        assert owner["name"] == name
        assert owner["controller"]

    # The pods really run (on kwok's GPU node, for the GPU group) and are Ready.
    pods = kube.get_json("pods", "-l", f"{PIPELINE_LABEL}={name}", namespace=namespace)
    assert len(pods["items"]) == 2
    for item in pods["items"]:
        ready = [c for c in item["status"]["conditions"] if c["type"] == "Ready"]
        assert ready
        assert ready[0]["status"] == "True"
        if item["metadata"]["labels"]["omni.dev/component"] == "stages":
            assert item["spec"]["nodeName"] == "kwok-gpu-0"

    got = pipeline(kube, namespace, name)
    status = got["status"]
    port = body["spec"].get("router", {}).get("port", 8000)
    assert status["endpoint"] == f"http://{name}.{namespace}.svc:{port}"
    assert status["ready"] == "2/2"
    assert status["observedGeneration"] == got["metadata"]["generation"]
    assert [(s["name"], s["replicas"], s["readyReplicas"]) for s in status["stages"]] == [
        ("thinker", 1, 1),
        ("dit", 1, 1),
    ]
    assert status["router"]["ready"] is True
    assert condition(got, "Ready")["status"] == "True"
    assert condition(got, "SpecValid")["status"] == "True"
    assert condition(got, "Degraded")["status"] == "False"
    assert condition(got, "Progressing")["status"] == "False"

    columns = kube.kubectl("get", "omnipipelines", namespace=namespace).stdout
    header, row = columns.strip().splitlines()
    assert header.split() == ["NAME", "READY", "PHASE", "ENDPOINT", "AGE"]
    assert row.split()[:4] == [name, "2/2", "Ready", status["endpoint"]]
    short = kube.kubectl("get", "omnip", namespace=namespace).stdout
    assert name in short

    said = reasons(kube, namespace, name)
    assert any(r.startswith("Created: created Deployment") for r in said), said
    assert any(r.startswith("Ready: phase") for r in said), said


def test_scaling_a_stage_changes_only_its_deployment(
    kube: Kube, namespace: str, operator: OperatorProcess, eventually: Eventually
) -> None:
    body, name = deploy_tiny(kube, namespace, eventually)
    before = {
        key: o["metadata"]["resourceVersion"] for key, o in children(kube, namespace, name).items()
    }

    scaled = copy.deepcopy(body)
    dit = next(s for s in scaled["spec"]["stages"] if s["name"] == "dit")
    dit["replicas"] = 2
    apply(kube, namespace, scaled)

    def dit_scaled() -> bool:
        got = pipeline(kube, namespace, name)
        stages = {s["name"]: s for s in got["status"].get("stages", [])}
        assert stages["dit"]["readyReplicas"] == 2, got["status"]
        assert got["status"]["phase"] == "Ready"
        return True

    eventually(dit_scaled, timeout=90, what="dit at 2 ready replicas")
    after = children(kube, namespace, name)
    changed = sorted(
        key for key, o in after.items() if before.get(key) != o["metadata"]["resourceVersion"]
    )
    dit_deployment = next(
        key
        for key, o in after.items()
        if key[0] == "Deployment" and o["metadata"]["labels"].get("omni.dev/stages") == "dit"
    )
    # The dit Deployment changed, and a PodDisruptionBudget appeared for its 2 replicas;
    # the config, the thinker and the router were not touched.
    new = sorted(set(after) - set(before))
    assert [kind for kind, _ in new] == ["PodDisruptionBudget"], new
    assert [key for key in changed if key not in new] == [dit_deployment], changed


def test_removing_a_stage_prunes_its_children(
    kube: Kube, namespace: str, operator: OperatorProcess, eventually: Eventually
) -> None:
    body, name = deploy_tiny(kube, namespace, eventually)
    before = children(kube, namespace, name)
    dit_objects = {
        key for key, o in before.items() if o["metadata"]["labels"].get("omni.dev/stages") == "dit"
    }
    assert {kind for kind, _ in dit_objects} == {"Deployment", "Service"}

    smaller = copy.deepcopy(body)
    smaller["spec"]["stages"] = [s for s in smaller["spec"]["stages"] if s["name"] != "dit"]
    smaller["spec"]["connectors"] = {}
    apply(kube, namespace, smaller)

    def pruned() -> bool:
        now = children(kube, namespace, name)
        assert not dit_objects & set(now), sorted(dit_objects & set(now))
        assert pipeline(kube, namespace, name)["status"]["ready"] == "1/1"
        return True

    eventually(pruned, timeout=60, what="dit's Deployment and Service pruned")
    assert any(r.startswith("Pruned:") for r in reasons(kube, namespace, name))


def test_a_config_change_rolls_every_pod(
    kube: Kube, namespace: str, operator: OperatorProcess, eventually: Eventually
) -> None:
    body, name = deploy_tiny(kube, namespace, eventually)
    pods_before = {
        p["metadata"]["name"]
        for p in kube.get_json("pods", "-l", f"{PIPELINE_LABEL}={name}", namespace=namespace)[
            "items"
        ]
    }
    (config_before,) = [
        o for (kind, _), o in children(kube, namespace, name).items() if kind == "ConfigMap"
    ]

    changed = copy.deepcopy(body)
    dit = next(s for s in changed["spec"]["stages"] if s["name"] == "dit")
    dit.setdefault("defaultSamplingParams", {})["num_inference_steps"] = 3
    apply(kube, namespace, changed)

    def rolled() -> bool:
        pods = kube.get_json("pods", "-l", f"{PIPELINE_LABEL}={name}", namespace=namespace)
        running = {
            p["metadata"]["name"]
            for p in pods["items"]
            if not p["metadata"].get("deletionTimestamp")
        }
        assert running, "no pods"
        assert not running & pods_before, f"old pods left: {running & pods_before}"
        assert pipeline(kube, namespace, name)["status"]["phase"] == "Ready"
        return True

    eventually(rolled, timeout=120, what="every pod replaced after the config change")
    # Each configuration has a ConfigMap of its own, named by its hash, which the pods mount.
    after = children(kube, namespace, name)
    mounted = {
        v["configMap"]["name"]
        for (kind, _), d in after.items()
        if kind == "Deployment"
        for v in d["spec"]["template"]["spec"]["volumes"]
        if "configMap" in v
    }
    (new_name,) = mounted
    assert new_name != config_before["metadata"]["name"]
    config_after = after[("ConfigMap", new_name)]
    assert config_after["data"] != config_before["data"]
    assert '"num_inference_steps": 3' in config_after["data"]["pipeline.json"].replace(
        '":3', '": 3'
    )


def test_delete_garbage_collects_every_child(
    kube: Kube, namespace: str, operator: OperatorProcess, eventually: Eventually
) -> None:
    _body, name = deploy_tiny(kube, namespace, eventually)
    assert children(kube, namespace, name)
    kube.kubectl("delete", "omnipipeline", name, "--wait=true", namespace=namespace)

    def all_gone() -> bool:
        left = children(kube, namespace, name)
        assert not left, sorted(left)
        pods = kube.get_json("pods", "-l", f"{PIPELINE_LABEL}={name}", namespace=namespace)
        assert not pods["items"], [p["metadata"]["name"] for p in pods["items"]]
        return True

    eventually(all_gone, timeout=90, what="garbage collection of the children")


def test_stage_keys_are_only_in_their_owned_secret_and_the_pods_mount_them(
    kube: Kube, namespace: str, operator: OperatorProcess, eventually: Eventually
) -> None:
    _body, name = deploy_tiny(kube, namespace, eventually)
    found = children(kube, namespace, name)
    secret = found[("Secret", f"{name}-stage-keys")]
    (owner,) = secret["metadata"]["ownerReferences"]
    assert owner["uid"] == pipeline(kube, namespace, name)["metadata"]["uid"]
    keys = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    assert sorted(keys) == sorted(KEY_FILES)
    policies = {n for kind, n in found if kind == "NetworkPolicy"}
    assert policies == {f"{name}-stages", f"{name}-router"}
    # No key anywhere else: ConfigMaps, Deployments (env, args), Events.
    elsewhere = json.dumps(
        [o for (kind, _), o in found.items() if kind != "Secret"] + events(kube, namespace, name)
    )
    assert not [key for key, value in keys.items() if value in elsewhere]


def test_a_spec_the_crd_admits_but_the_operator_refuses_changes_nothing(
    kube: Kube, namespace: str, operator: OperatorProcess, eventually: Eventually
) -> None:
    # A shared-memory connector from a to c: a shares GPU 0 with b, c shares GPU 1 with d,
    # so a and c are in different placement groups ({a, b} and {c, d}). The CRD's rules
    # see pairs of stages and cannot tell, as neither a nor c is alone on its GPUs.
    body = example("tiny-pipeline.yaml", metadata_name="chain")
    llm, dit = body["spec"]["stages"]
    stages = [
        {**llm, "stageId": 0, "name": "a", "devices": "0", "output": "hidden_states"},
        {**dit, "stageId": 1, "name": "b", "devices": "0", "inputConnectors": {}},
        {
            **dit,
            "stageId": 2,
            "name": "c",
            "devices": "1",
            "inputConnectors": {"from_stage_0": "shm"},
        },
        {**dit, "stageId": 3, "name": "d", "devices": "1", "inputConnectors": {}},
    ]
    body["spec"]["stages"] = stages
    body["spec"]["connectors"] = {"shm": {"name": "SharedMemoryConnector"}}
    apply(kube, namespace, body)

    def refused() -> bool:
        got = pipeline(kube, namespace, "chain")
        assert got.get("status", {}).get("phase") == "Failed", got.get("status")
        spec_valid = condition(got, "SpecValid")
        assert spec_valid["status"] == "False"
        assert "spec.stages[2].inputConnectors.from_stage_0" in spec_valid["message"]
        assert "SharedMemoryConnector" in spec_valid["message"]
        return True

    eventually(refused, timeout=60, what="SpecValid=False")
    assert not children(kube, namespace, "chain")
    assert any(r.startswith("InvalidSpec:") for r in reasons(kube, namespace, "chain"))


def test_operator_killed_mid_reconcile_converges_after_restart(
    kube: Kube, namespace: str, operator: OperatorProcess, eventually: Eventually
) -> None:
    body = example("tiny-pipeline.yaml")
    name = body["metadata"]["name"]
    apply(kube, namespace, body)
    # Killed as soon as the first child exists: the rest is not applied yet (or only
    # partly), and kopf's own bookkeeping is mid-way.
    eventually(
        lambda: children(kube, namespace, name), timeout=60, interval=0.05, what="first child"
    )
    operator.kill()
    partial = children(kube, namespace, name)
    operator.start()
    eventually(phase_is(kube, namespace, name, "Ready"), timeout=90, what="Ready after restart")

    objs = children(kube, namespace, name)
    assert set(partial) <= set(objs)
    deployments = sorted(n for kind, n in objs if kind == "Deployment")
    assert deployments == sorted([f"{name}-dit", f"{name}-router", f"{name}-thinker"])
    services = sorted(n for kind, n in objs if kind == "Service")
    assert services == sorted([name, f"{name}-dit", f"{name}-thinker"])
    replicasets = kube.get_json(
        "replicasets", "-l", f"{PIPELINE_LABEL}={name}", namespace=namespace
    )
    assert len(replicasets["items"]) == 3, [r["metadata"]["name"] for r in replicasets["items"]]
    got = pipeline(kube, namespace, name)
    assert got["status"]["ready"] == "2/2"
    assert got["status"]["observedGeneration"] == got["metadata"]["generation"]


def _set_pod_ready(kube: Kube, namespace: str, pod: str, ready: bool) -> None:
    value = "True" if ready else "False"
    patch = {
        "status": {
            "conditions": [
                {"type": "Ready", "status": value},
                {"type": "ContainersReady", "status": value},
            ]
        }
    }
    kube.kubectl(
        "patch", "pod", pod, "--subresource=status", "-p", json.dumps(patch), namespace=namespace
    )


def test_an_unready_or_deleted_stage_pod_degrades_the_pipeline_until_it_is_back(
    kube: Kube, namespace: str, operator: OperatorProcess, eventually: Eventually
) -> None:
    _body, name = deploy_tiny(kube, namespace, eventually)
    pods = kube.get_json(
        "pods", "-l", f"{PIPELINE_LABEL}={name},omni.dev/stages=dit", namespace=namespace
    )
    (dit_pod,) = (p["metadata"]["name"] for p in pods["items"])

    _set_pod_ready(kube, namespace, dit_pod, ready=False)
    eventually(phase_is(kube, namespace, name, "Degraded"), timeout=60, what="Degraded")
    got = pipeline(kube, namespace, name)
    assert got["status"]["ready"] == "1/2"
    degraded = condition(got, "Degraded")
    assert degraded["status"] == "True"
    assert "stage dit: 0/1 ready" in degraded["message"]
    assert condition(got, "Ready")["status"] == "False"

    _set_pod_ready(kube, namespace, dit_pod, ready=True)
    eventually(phase_is(kube, namespace, name, "Ready"), timeout=60, what="Ready again")

    # A deleted pod is replaced (kwok makes the new one Ready at once); the pipeline went
    # through Degraded meanwhile, which its events keep even if the window was short.
    kube.kubectl("delete", "pod", dit_pod, "--wait=false", namespace=namespace)
    eventually(phase_is(kube, namespace, name, "Ready"), timeout=60)
    said = reasons(kube, namespace, name)
    assert any(r.startswith("Degraded: phase Ready -> Degraded") for r in said), said
    assert any(r.startswith("Ready: phase Degraded -> Ready") for r in said), said


def test_a_child_deleted_by_hand_is_put_back(
    kube: Kube, namespace: str, operator: OperatorProcess, eventually: Eventually
) -> None:
    _body, name = deploy_tiny(kube, namespace, eventually)
    service = children(kube, namespace, name)[("Service", name)]
    kube.kubectl("delete", "service", name, "--wait=true", namespace=namespace)

    def restored() -> bool:
        now = children(kube, namespace, name).get(("Service", name))
        assert now is not None, "router Service not back"
        assert now["metadata"]["uid"] != service["metadata"]["uid"]
        return True

    eventually(restored, timeout=60, what="the router Service put back")
    assert operator.alive()


def test_an_object_the_apiserver_refuses_fails_the_pipeline_until_the_spec_is_fixed(
    kube: Kube, namespace: str, operator: OperatorProcess, eventually: Eventually
) -> None:
    # Neither the CRD nor the operator checks label-key syntax in nodeSelector; the
    # apiserver refuses the Deployment. Retrying the same spec cannot help.
    body = example("tiny-pipeline.yaml")
    name = body["metadata"]["name"]
    broken = copy.deepcopy(body)
    broken["spec"]["stages"][1]["placement"]["nodeSelector"] = {"not a label key!": "x"}
    apply(kube, namespace, broken)

    def failed() -> bool:
        got = pipeline(kube, namespace, name)
        assert got.get("status", {}).get("phase") == "Failed", got.get("status")
        message = condition(got, "SpecValid")["message"]
        assert "the apiserver refused Deployment tiny-dit" in message, message
        assert "not a label key!" in message, message
        return True

    eventually(failed, timeout=60, what="Failed with the apiserver's reason")
    assert any(
        r.startswith("ApplyFailed: Deployment tiny-dit") for r in reasons(kube, namespace, name)
    )

    apply(kube, namespace, body)
    eventually(phase_is(kube, namespace, name, "Ready"), timeout=90, what="Ready once fixed")
    assert condition(pipeline(kube, namespace, name), "SpecValid")["status"] == "True"
