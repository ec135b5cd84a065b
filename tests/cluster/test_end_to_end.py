"""End to end, as a user: the operator from its image, a pipeline of real pods, the endpoint.

Everything runs on the real node (kubelet, containerd, kube-proxy; test_real_node.py):
`kubectl apply -k` of manifests/base (through an overlay that only puts the operator's pod
on that node), `kubectl apply -f` of the tiny CPU pipeline (its pods run the runtime image,
vLLM's CPU build and diffusers), the official openai client through `kubectl
port-forward`, `kubectl logs`, `kubectl delete`. Then rollouts under a closed loop of
requests: a config change that rolls every pod (and changes the connector between the
stages, which an old DiT cannot read from a new encoder), `kubectl delete pod` of one
replica, and a scale-down; no request may fail.

Skipped, saying why, where the real node cannot run (the `real_node` fixture).
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai
import pytest
import yaml
from PIL import Image

if TYPE_CHECKING:
    from conftest import Kube, RealNode

Eventually = Callable[..., Any]

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "manifests" / "base"
TINY_EXAMPLE = REPO / "manifests" / "examples" / "tiny-pipeline.yaml"
OPERATOR_IMAGE = "omni-operator/omni-operator:0.1.0"
RUNTIME_IMAGE = "omni-operator/omni-runtime:0.1.0"
OPERATOR_NAMESPACE = "omni-system"
PIPELINE = "tiny"
MODEL = "tiny-omni"
PIPELINE_LABEL = "omni.dev/pipeline"
COMPONENT_LABEL = "omni.dev/component"
CONFIG_HASH = "omni.dev/config-hash"
REVISION_ENV = "OMNI_PIPELINE_REVISION"
OWNED_KINDS = "deployments.apps,services,configmaps,serviceaccounts,roles,rolebindings,pdb"

# The real node has 2 cores (shared with the control plane and the tests); the example's
# requests (1 + 1 + 0.25 cores) are sized for a real CPU node and do not fit, so the test
# gives each pod a small request, with room for a surge pod of each Deployment during a
# rollout. Limits stay the example's: what the processes may use is not the test's business.
SMALL_REQUESTS = {
    "thinker": {"cpu": "250m", "memory": "2Gi"},
    "dit": {"cpu": "200m", "memory": "1Gi"},
    "router": {"cpu": "100m", "memory": "256Mi"},
}


@dataclass
class Figures:
    """What the tests measured, printed at the end of each (pytest -s shows it)."""

    values: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def mark(self, what: str) -> None:
        self.values[what] = round(time.monotonic() - self.started, 1)

    def show(self, title: str) -> None:
        print(f"\n--- {title} ---\n{json.dumps(self.values, indent=2)}")


# --- the operator, installed as a user does ---------------------------------------------


def write_overlay(directory: Path, node: RealNode) -> Path:
    """A kustomize overlay of manifests/base whose only change is where the operator's pod
    runs: the real node's label and taint (a user's cluster would need neither)."""
    directory.mkdir(parents=True, exist_ok=True)
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "omni-operator", "namespace": OPERATOR_NAMESPACE},
        "spec": {
            "template": {
                "spec": {
                    "nodeSelector": dict(node.node_selector),
                    "tolerations": [dict(node.toleration)],
                }
            }
        },
    }
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(BASE, directory)],
        "patches": [{"patch": yaml.safe_dump(patch)}],
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory


def operator_pods(kube: Kube) -> list[dict[str, Any]]:
    listed = kube.get_json(
        "pods", "-l", "app.kubernetes.io/component=operator", namespace=OPERATOR_NAMESPACE
    )
    return list(listed["items"])


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


@dataclass
class InstalledOperator:
    overlay: Path
    pod: str
    # From `kubectl apply -k` to the operator's pod Ready.
    ready_after_s: float


@pytest.fixture
def operator_installed(
    kube: Kube, real_node: RealNode, tmp_path: Path, eventually: Eventually
) -> Iterator[InstalledOperator]:
    """`kubectl apply -k` of the overlay, the operator's pod Running on the real node;
    `kubectl delete -k` afterwards, waiting until its pod is gone (a later test's operator
    must not overlap it: the base's runs --all-namespaces)."""
    real_node.load_image(OPERATOR_IMAGE)
    overlay = write_overlay(tmp_path / "overlay", real_node)
    t0 = time.monotonic()
    try:
        kube.kubectl("apply", "-k", str(overlay))
        kube.kubectl(
            "rollout",
            "status",
            "deployment/omni-operator",
            "--timeout=120s",
            namespace=OPERATOR_NAMESPACE,
            timeout=150,
        )

        def running() -> str:
            pods = [p for p in operator_pods(kube) if not p["metadata"].get("deletionTimestamp")]
            assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
            (pod,) = pods
            assert pod["status"].get("phase") == "Running", pod["status"]
            assert is_ready(pod), pod["status"].get("conditions")
            return str(pod["metadata"]["name"])

        pod = eventually(running, timeout=60, what="the operator's pod Running and Ready")
        yield InstalledOperator(overlay, pod, round(time.monotonic() - t0, 1))
    finally:
        logs = kube.kubectl(
            "logs",
            "deployment/omni-operator",
            "--tail=40",
            namespace=OPERATOR_NAMESPACE,
            check=False,
        )
        if logs.returncode == 0:  # a test that removed the operator itself printed its log
            print(f"--- operator log (tail) ---\n{logs.stdout}")
        kube.kubectl("delete", "-k", str(overlay), "--ignore-not-found", "--wait=true", timeout=180)
        eventually(lambda: base_gone(kube), timeout=120, what="the operator and its namespace gone")


def base_gone(kube: Kube) -> bool:
    """Nothing of manifests/base left: a later install must not meet a Terminating
    namespace, nor a second operator."""
    assert operator_pods(kube) == []
    namespace = kube.kubectl("get", "namespace", OPERATOR_NAMESPACE, check=False)
    assert namespace.returncode != 0, namespace.stdout
    crd = kube.kubectl("get", "crd", "omnipipelines.omni.dev", check=False)
    assert crd.returncode != 0, crd.stdout
    return True


def kopf_started(kube: Kube, pod: str) -> str:
    logs = kube.kubectl("logs", pod, namespace=OPERATOR_NAMESPACE).stdout
    # kopf logs its startup activity (our handler loads the in-cluster credentials) and its
    # login with them, then starts watching: a log without both never served anything.
    assert "Activity 'start' succeeded" in logs or "Startup" in logs, logs[-2000:]
    assert "Activity 'login' succeeded" in logs, logs[-2000:]
    return logs


# --- the pipeline -------------------------------------------------------------------------


def tiny_pipeline(
    node: RealNode, *, dit_replicas: int = 1, router_replicas: int = 1
) -> dict[str, Any]:
    """manifests/examples/tiny-pipeline.yaml, every pod placed on the real node with small
    requests (see SMALL_REQUESTS)."""
    body: dict[str, Any] = yaml.safe_load(TINY_EXAMPLE.read_text())
    placements = [stage["placement"] for stage in body["spec"]["stages"]]
    placements.append(body["spec"]["router"].setdefault("placement", {}))
    names = [stage["name"] for stage in body["spec"]["stages"]] + ["router"]
    for name, placement in zip(names, placements, strict=True):
        placement["nodeSelector"] = dict(node.node_selector)
        placement["tolerations"] = [dict(node.toleration)]
        placement.setdefault("resources", {})["requests"] = dict(SMALL_REQUESTS[name])
    for stage in body["spec"]["stages"]:
        if stage["name"] == "dit":
            stage["replicas"] = dit_replicas
    body["spec"]["router"]["replicas"] = router_replicas
    return body


def cpu_millis(quantity: str) -> int:
    return int(quantity[:-1]) if quantity.endswith("m") else int(float(quantity) * 1000)


def requests_fit_the_node(kube: Kube, node: RealNode, namespace: str) -> None:
    """The rendered pods' CPU requests, plus one surge pod per Deployment, fit the node's
    allocatable CPU beside what already runs there."""
    allocatable = kube.get_json("node", node.name)["status"]["allocatable"]
    wanted = 0
    for deployment in kube.get_json("deployments", namespace=namespace)["items"]:
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        cpu = container.get("resources", {}).get("requests", {}).get("cpu", "0")
        wanted += cpu_millis(cpu) * (deployment["spec"]["replicas"] + 1)
    others = kube.get_json(
        "pods", "--all-namespaces", f"--field-selector=spec.nodeName={node.name}"
    )["items"]
    elsewhere = sum(
        cpu_millis(c.get("resources", {}).get("requests", {}).get("cpu", "0"))
        for pod in others
        if pod["metadata"]["namespace"] != namespace
        for c in pod["spec"]["containers"]
    )
    assert wanted + elsewhere <= cpu_millis(allocatable["cpu"]), (
        f"{wanted}m (pipeline with a surge pod each) + {elsewhere}m (others) > "
        f"{allocatable['cpu']} allocatable on {node.name}"
    )


def get_table(kube: Kube, namespace: str) -> dict[str, str]:
    """`kubectl get omnipipelines` as a user reads it: column -> value of our pipeline."""
    out = kube.kubectl("get", "omnipipelines", namespace=namespace).stdout.splitlines()
    header, *rows = out
    columns = header.split()
    for row in rows:
        values = row.split()
        if values and values[0] == PIPELINE:
            return dict(zip(columns, values, strict=False))
    raise AssertionError(f"{PIPELINE} not in:\n" + "\n".join(out))


def pipeline_ready(kube: Kube, namespace: str) -> Callable[[], bool]:
    def check() -> bool:
        body = kube.get_json("omnipipeline", PIPELINE, namespace=namespace)
        status = body.get("status", {})
        assert status.get("observedGeneration") == body["metadata"]["generation"], status
        row = get_table(kube, namespace)
        assert row.get("PHASE") == "Ready", (row, json.dumps(status)[:1500])
        return True

    return check


def pipeline_pods(kube: Kube, namespace: str) -> list[dict[str, Any]]:
    listed = kube.get_json("pods", "-l", f"{PIPELINE_LABEL}={PIPELINE}", namespace=namespace)
    return list(listed["items"])


def owned(kube: Kube, namespace: str) -> list[str]:
    listed = kube.get_json(OWNED_KINDS, "-l", f"{PIPELINE_LABEL}={PIPELINE}", namespace=namespace)
    return sorted(f"{i['kind']}/{i['metadata']['name']}" for i in listed["items"])


def deployments_rolled(kube: Kube, namespace: str) -> dict[str, dict[str, Any]]:
    """Every Deployment of the pipeline done rolling: all replicas of the current template
    ready, none of an older one left (pods included: terminating ones must be gone)."""
    listed = kube.get_json(
        "deployments", "-l", f"{PIPELINE_LABEL}={PIPELINE}", namespace=namespace
    )["items"]
    assert listed, "no Deployments"
    for d in listed:
        name, wanted, status = d["metadata"]["name"], d["spec"]["replicas"], d.get("status", {})
        assert status.get("observedGeneration") == d["metadata"]["generation"], (name, status)
        for key in ("replicas", "updatedReplicas", "readyReplicas", "availableReplicas"):
            assert status.get(key, 0) == wanted, (name, key, status)
    pods = pipeline_pods(kube, namespace)
    expected = sum(d["spec"]["replicas"] for d in listed)
    names = [p["metadata"]["name"] for p in pods]
    assert len(pods) == expected, f"{len(pods)} pods, {expected} wanted: {names}"
    assert all(is_ready(p) for p in pods), names
    return {d["metadata"]["name"]: d for d in listed}


# --- reaching the endpoint ------------------------------------------------------------------


class PortForwards:
    """`kubectl port-forward` processes, each killed (and reaped) by close()."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, namespace: str, target: str, port: int) -> int:
        proc = subprocess.Popen(
            [
                self.kube.kubectl_path,
                f"--kubeconfig={self.kube.kubeconfig}",
                f"--namespace={namespace}",
                "port-forward",
                target,
                f":{port}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        # kubectl prints the local port once it listens (EOF if it fails).
        line = proc.stdout.readline()
        match = re.match(r"Forwarding from 127\.0\.0\.1:(\d+) -> \d+", line)
        if match is None:
            proc.kill()
            _, err = proc.communicate(timeout=10)
            raise AssertionError(f"kubectl port-forward {target} printed {line!r}; stderr: {err}")
        return int(match.group(1))

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.communicate(timeout=10)
        self.procs.clear()


@pytest.fixture
def port_forwards(kube: Kube) -> Iterator[PortForwards]:
    forwards = PortForwards(kube)
    try:
        yield forwards
    finally:
        forwards.close()


def png_size(url: str) -> tuple[int, int]:
    assert url.startswith("data:image/png;base64,"), url[:60]
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert image.format == "PNG"
    image.load()
    width, height = image.size
    return width, height


def ask_for_image(client: openai.OpenAI, height: int, width: int, steps: int) -> tuple[int, int]:
    """One chat request for an image; the (width, height) of the PNG that came back."""
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a red cat on a green hydrant"}],
        extra_body={
            "modalities": ["image"],
            "height": height,
            "width": width,
            "num_inference_steps": steps,
        },
    )
    content: Any = response.choices[0].message.content
    assert isinstance(content, list), content
    return png_size(content[0]["image_url"]["url"])


def startup_lines(kube: Kube, namespace: str, pod: dict[str, Any]) -> list[str]:
    """The lines of a pod's log that say it is serving."""
    logs = kube.kubectl("logs", pod["metadata"]["name"], namespace=namespace).stdout
    component = pod["metadata"]["labels"][COMPONENT_LABEL]
    if component == "router":
        found = re.findall(rf"router on http://\S+:8000/v1 \(model {MODEL}\)", logs)
    else:
        found = re.findall(r"stage \d+ '\w+' serving on \S+ \(revision \S+\)", logs)
    assert found, f"{pod['metadata']['name']}: no startup line in\n{logs[-3000:]}"
    return found


# --- 1. a user's first steps ---------------------------------------------------------------


@pytest.mark.timeout(1200)  # the first load of the 6.5 GB runtime image into containerd
def test_a_user_installs_the_operator_deploys_the_tiny_pipeline_gets_an_image_and_deletes_it(
    kube: Kube,
    real_node: RealNode,
    operator_installed: InstalledOperator,
    namespace: str,
    port_forwards: PortForwards,
    tmp_path: Path,
    eventually: Eventually,
) -> None:
    figures = Figures()
    figures.values["operator Ready after apply -k (s)"] = operator_installed.ready_after_s
    pod = kube.get_json("pod", operator_installed.pod, namespace=OPERATOR_NAMESPACE)
    assert pod["spec"]["nodeName"] == real_node.name
    assert pod["spec"]["serviceAccountName"] == "omni-operator"
    eventually(lambda: kopf_started(kube, operator_installed.pod), timeout=60, what="kopf up")

    # Cold, this copies the image into the node's containerd (minutes); warm, it is a check.
    t0 = time.monotonic()
    real_node.load_image(RUNTIME_IMAGE)
    figures.values["runtime image load (s)"] = round(time.monotonic() - t0, 1)
    figures.started += time.monotonic() - t0

    manifest = tmp_path / "tiny-pipeline.yaml"
    manifest.write_text(yaml.safe_dump(tiny_pipeline(real_node)))
    kube.kubectl("apply", "-f", str(manifest), namespace=namespace)
    eventually(
        lambda: len(kube.get_json("deployments", namespace=namespace)["items"]) == 3,
        timeout=60,
        what="the operator made the Deployments",
    )
    requests_fit_the_node(kube, real_node, namespace)
    eventually(pipeline_ready(kube, namespace), timeout=240, interval=1, what="tiny Ready")
    figures.mark("pipeline Ready (s)")
    row = get_table(kube, namespace)
    assert row["READY"] == "2/2", row
    assert row["ENDPOINT"] == f"http://{PIPELINE}.{namespace}.svc:8000", row

    pods = pipeline_pods(kube, namespace)
    assert {p["metadata"]["labels"][COMPONENT_LABEL] for p in pods} == {"stages", "router"}
    for p in pods:
        assert p["spec"]["nodeName"] == real_node.name, p["metadata"]["name"]
        (container,) = p["spec"]["containers"]
        assert container["image"] == RUNTIME_IMAGE
        assert p["status"]["phase"] == "Running"

    local = port_forwards.start(namespace, f"svc/{PIPELINE}", 8000)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{local}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert ask_for_image(client, height=96, width=128, steps=4) == (128, 96)
    figures.mark("first image (s)")

    for p in pods:
        lines = startup_lines(kube, namespace, p)
        print(f"{p['metadata']['name']}: {lines}")

    kube.kubectl("delete", "omnipipeline", PIPELINE, "--wait=true", namespace=namespace)

    def all_gone() -> bool:
        assert owned(kube, namespace) == []
        left = [p["metadata"]["name"] for p in pipeline_pods(kube, namespace)]
        assert left == [], left
        return True

    # Pods drain first (preStop, then SIGTERM within their grace period).
    eventually(all_gone, timeout=120, interval=1, what="everything the pipeline owned gone")
    figures.mark("pipeline deleted (s)")

    port_forwards.close()
    print(kube.kubectl("logs", operator_installed.pod, namespace=OPERATOR_NAMESPACE).stdout[-3000:])
    kube.kubectl("delete", "-k", str(operator_installed.overlay), "--wait=true", timeout=180)
    eventually(lambda: base_gone(kube), timeout=120, what="the operator and its namespace gone")
    figures.mark("operator removed (s)")
    figures.show("end to end")
