"""End to end, as a user: the operator from its image, a pipeline of real pods, the endpoint.

Everything runs on the real node (kubelet, containerd, kube-proxy; test_real_node.py):
`kubectl apply -k` of manifests/base (through an overlay that only puts the operator's pod
on that node), `kubectl apply -f` of the tiny CPU pipeline (its pods run the runtime image,
vLLM's CPU build and diffusers), the official openai client through `kubectl
port-forward`, `kubectl logs`, `kubectl delete`. Then, under a closed loop of requests,
`kubectl delete pod` of one replica, a scale-down, a config change that rolls every pod
(and changes the connector between the stages, which an old DiT cannot read from a new
encoder), then an image change; no request may fail.

Skipped, saying why, where the real node cannot run (the `real_node` fixture).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx2
import openai
import pytest
import yaml
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from conftest import Kube, PortForwards, RealNode

Eventually = Callable[..., Any]

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "manifests" / "base"
TINY_EXAMPLE = REPO / "manifests" / "examples" / "tiny-pipeline.yaml"
API_KEY = "sk-omni-e2e"
OPERATOR_IMAGE = "omni-operator/omni-operator:0.1.0"
RUNTIME_IMAGE = "omni-operator/omni-runtime:0.1.0"
ROLLOUT_IMAGE = "omni-operator/omni-runtime:0.1.0-rollout"
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


# As the rest of the suite runs vLLM (tests/conftest.py): one unpinned OpenMP thread, so
# that the pods' engines do not spin on the cores the tests beside them run on.
SINGLE_THREADED_VLLM = (
    {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"},
    {"name": "OMP_NUM_THREADS", "value": "1"},
)


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
    """A kustomize overlay of manifests/base whose changes are where the operator's pod runs
    (the real node's label and taint; a user's cluster would need neither) and how often its
    planner looks."""
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
                    # The planner looks every 2 s instead of 15, so that the autoscaling
                    # test's figures are the pods', not the wait between looks.
                    "containers": [
                        {
                            "name": "operator",
                            "env": [{"name": "OMNI_PLANNER_INTERVAL_SECONDS", "value": "2"}],
                        }
                    ],
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


def tiny_pipeline(node: RealNode, *, dit_replicas: int = 1) -> dict[str, Any]:
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
        placement["env"] = [dict(var) for var in SINGLE_THREADED_VLLM]
    for stage in body["spec"]["stages"]:
        if stage["name"] == "dit":
            stage["replicas"] = dit_replicas
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

    # The router asks for an API key, from a Secret the user made; the stages admit only
    # the router's CURVE key, from the Secret the operator made.
    kube.kubectl(
        "create", "secret", "generic", "tiny-api-keys", f"--from-literal=api-key={API_KEY}",
        namespace=namespace,
    )  # fmt: skip
    body = tiny_pipeline(real_node)
    body["spec"]["router"]["apiKeySecretRef"] = {"name": "tiny-api-keys"}
    manifest = tmp_path / "tiny-pipeline.yaml"
    manifest.write_text(yaml.safe_dump(body))
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
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{local}/v1", api_key=API_KEY)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert ask_for_image(client, height=96, width=128, steps=4) == (128, 96)
    stranger = openai.OpenAI(
        base_url=f"http://127.0.0.1:{local}/v1", api_key="sk-wrong", max_retries=0
    )
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
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


# --- 2 and 3. rollouts under load: no request lost, no revisions mixed -----------------------

# A TCP relay in a pod of its own, which no rollout of the pipeline replaces: a user's
# clients reach the Service through something in the cluster that follows its endpoints (an
# Ingress, a load balancer); here each connection goes to the Service's ClusterIP, and
# kube-proxy picks a ready router pod, terminating ones excluded. The test's clients reach
# the relay from the node's network (RealNode.unix_socket_to), not through `kubectl
# port-forward`, which exits at the first connection a rollout resets.
RELAY = """
import asyncio, sys
target = (sys.argv[1], int(sys.argv[2]))
async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()
async def handle(reader, writer):
    try:
        up_reader, up_writer = await asyncio.open_connection(*target)
    except OSError:
        writer.close()
        return
    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
async def main():
    server = await asyncio.start_server(handle, "0.0.0.0", 8000)
    print("relaying to %s:%d" % target, flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


def relay_pod(node: RealNode, cluster_ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "endpoint-relay"},
        "spec": node.pod_spec(
            terminationGracePeriodSeconds=1,
            containers=[
                {
                    "name": "relay",
                    # Python is what the image already has; the relay is the test's, not
                    # the product's.
                    "image": RUNTIME_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["python", "-c", RELAY, cluster_ip, "8000"],
                    "ports": [{"containerPort": 8000}],
                    "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1},
                    "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
                }
            ],
        ),
    }


@dataclass
class LoopCounts:
    sent: int = 0
    answered: int = 0
    failed: int = 0
    # HTTP attempts the openai client made (its own retries included), and how each ended.
    attempts: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    # The body of each attempt that was not a 200 (the client may have retried it).
    refusals: list[str] = field(default_factory=list)


class ClosedLoop:
    """Clients that each send their next request when the last one is answered, with the
    official client as a user has it (max_retries=2: it retries connection errors, 408,
    429 and 5xx). Every attempt and every response status is counted through httpx hooks,
    so a failure the client's retries hid is still seen."""

    # Two: a request is in flight at every drain, and the node's 2 cores are left to the
    # pods that a rollout starts (each request runs both stages and the router).
    def __init__(self, base_url: str, clients: int = 2, uds: str | None = None) -> None:
        self.base_url = base_url
        # Where every connection goes, whatever base_url's host (RealNode.unix_socket_to).
        self.uds = uds
        self.counts = LoopCounts()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def __enter__(self) -> ClosedLoop:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            # A request in flight finishes (or times out: the client's timeout below).
            thread.join(timeout=150)

    def snapshot(self) -> LoopCounts:
        with self.lock:
            return copy.deepcopy(self.counts)

    def _count(self, **changes: int) -> None:
        with self.lock:
            for key, value in changes.items():
                setattr(self.counts, key, getattr(self.counts, key) + value)

    def _on_request(self, request: Any) -> None:
        self._count(attempts=1)

    def _on_response(self, response: Any) -> None:
        with self.lock:
            statuses = self.counts.statuses
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code != 200:
            # Read here: the client's retry discards the response unread.
            body = response.read().decode(errors="replace")
            with self.lock:
                self.counts.refusals.append(f"{response.status_code}: {body}"[:500])

    def _run(self) -> None:
        # The client's own httpx (openai pins a fork of it, httpx2), with hooks added.
        http = openai.DefaultHttpxClient(
            event_hooks={"request": [self._on_request], "response": [self._on_response]},
            timeout=120,
            transport=httpx2.HTTPTransport(uds=self.uds) if self.uds else None,
        )
        client = openai.OpenAI(base_url=self.base_url, api_key="unused", http_client=http)
        with http:
            while not self.stop.is_set():
                self._count(sent=1)
                try:
                    size = ask_for_image(client, height=64, width=64, steps=2)
                    assert size == (64, 64), size
                except Exception as e:  # every failure is counted, whatever its kind
                    with self.lock:
                        self.counts.failed += 1
                        self.counts.errors.append(f"{type(e).__name__}: {e}"[:500])
                else:
                    self._count(answered=1)


def exec_metrics(kube: Kube, namespace: str, pod: str) -> str | None:
    """GET /metrics inside a router pod (its own Python), or None if it is gone."""
    script = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/metrics').read().decode())"
    res = kube.kubectl(
        "exec",
        pod,
        "-c",
        "router",
        "--",
        "python",
        "-c",
        script,
        namespace=namespace,
        check=False,
        timeout=30,
    )
    return res.stdout if res.returncode == 0 else None


class MetricsWatch:
    """The last /metrics of every router pod, scraped over and over: router pods roll too,
    and each one's counters go with it."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.last: dict[str, str] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MetricsWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
        self.scrape()

    def scrape(self) -> None:
        pods = self.kube.get_json(
            "pods",
            "-l",
            f"{PIPELINE_LABEL}={PIPELINE},{COMPONENT_LABEL}=router",
            namespace=self.namespace,
        )["items"]
        for pod in pods:
            if pod.get("status", {}).get("phase") != "Running":
                continue
            text = exec_metrics(self.kube, self.namespace, pod["metadata"]["name"])
            if text:
                self.last[pod["metadata"]["name"]] = text

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                self.scrape()
            except (AssertionError, subprocess.TimeoutExpired):
                continue  # a pod went away mid-scrape; the next round sees the others

    def totals(self, name: str, *labels: str) -> dict[tuple[str, ...], float]:
        """Sample ``name`` summed over the router pods, keyed by the values of ``labels``."""
        found: dict[tuple[str, ...], float] = {}
        for text in self.last.values():
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == name:
                        key = tuple(sample.labels.get(label, "") for label in labels)
                        found[key] = found.get(key, 0.0) + sample.value
        return found


def stage_revisions(kube: Kube, namespace: str) -> dict[str, set[str]]:
    """Stage pod (not terminating) -> the revision it advertises, by Deployment."""
    found: dict[str, set[str]] = {}
    for pod in pipeline_pods(kube, namespace):
        if pod["metadata"]["labels"][COMPONENT_LABEL] != "stages":
            continue
        (container,) = pod["spec"]["containers"]
        env = {v["name"]: v.get("value", "") for v in container["env"]}
        group = pod["metadata"]["labels"]["omni.dev/placement-group"]
        found.setdefault(group, set()).add(env[REVISION_ENV])
    return found


def progress(loop: ClosedLoop, at_least: int, since: int) -> Callable[[], bool]:
    def check() -> bool:
        counts = loop.snapshot()
        assert counts.failed == 0, counts.errors
        return counts.answered >= since + at_least

    return check


@dataclass
class Serving:
    """The tiny pipeline Ready on the real node, its endpoint reached through the relay."""

    body: dict[str, Any]
    relay_ip: str
    revision: str


def serve_through_a_relay(
    kube: Kube,
    real_node: RealNode,
    namespace: str,
    eventually: Eventually,
    figures: Figures,
    dit_autoscaling: dict[str, Any] | None = None,
) -> Serving:
    real_node.load_image(RUNTIME_IMAGE)
    body = tiny_pipeline(real_node, dit_replicas=1 if dit_autoscaling else 2)
    if dit_autoscaling is not None:
        dit = next(s for s in body["spec"]["stages"] if s["name"] == "dit")
        dit["autoscaling"] = dict(dit_autoscaling)
    kube.apply(body, namespace=namespace)
    eventually(pipeline_ready(kube, namespace), timeout=240, interval=1, what="tiny Ready")
    deployments_rolled(kube, namespace)
    requests_fit_the_node(kube, real_node, namespace)
    figures.mark("pipeline Ready (s)")
    cluster_ip = kube.get_json("service", PIPELINE, namespace=namespace)["spec"]["clusterIP"]
    kube.apply(relay_pod(real_node, cluster_ip), namespace=namespace)
    kube.kubectl(
        "wait",
        "--for=condition=Ready",
        "pod/endpoint-relay",
        "--timeout=60s",
        namespace=namespace,
        timeout=90,
    )
    relay_ip = kube.get_json("pod", "endpoint-relay", namespace=namespace)["status"]["podIP"]
    (revision,) = set().union(*stage_revisions(kube, namespace).values())
    return Serving(body, relay_ip, revision)


def record_loop(
    figures: Figures, loop: ClosedLoop, metrics: MetricsWatch, title: str
) -> tuple[LoopCounts, dict[tuple[str, ...], float], dict[tuple[str, ...], float]]:
    counts = loop.snapshot()
    retries = metrics.totals("omni_router_retries_total", "stage", "reason")
    by_revision = metrics.totals("omni_router_revision_requests_total", "revision")
    served = metrics.totals("omni_stage_served_total", "stage", "revision")
    figures.values.update(
        sent=counts.sent,
        answered=counts.answered,
        failed=counts.failed,
        http_attempts=counts.attempts,
        client_retries=counts.attempts - counts.sent,
        http_statuses=counts.statuses,
        refusals=counts.refusals,
        router_retries={"/".join(k): v for k, v in retries.items()},
        requests_by_revision={k[0]: v for k, v in by_revision.items()},
        served_by_stage_and_revision={"/".join(k): v for k, v in served.items()},
    )
    figures.show(title)
    return counts, by_revision, served


def assert_nothing_lost(counts: LoopCounts) -> None:
    assert counts.failed == 0, counts.errors
    assert counts.answered == counts.sent
    # Behind the client's retries, no attempt failed but with a 503 ("service unavailable,
    # try again", which the official client retries); a mixed pair would be a 500.
    assert set(counts.statuses) <= {200, 503}, (counts.statuses, counts.refusals)


@pytest.fixture
def second_runtime_tag(real_node: RealNode) -> Iterator[str]:
    """The runtime image under a second name on the node: a new image as far as the pod
    templates go (a rollout), the same files (no second multi-GB import)."""
    podman_tag = shutil.which("podman")
    assert podman_tag is not None, "podman is not on PATH"
    subprocess.run([podman_tag, "tag", RUNTIME_IMAGE, ROLLOUT_IMAGE], check=True, timeout=60)
    try:
        real_node.load_image(ROLLOUT_IMAGE)
        yield ROLLOUT_IMAGE
    finally:
        # With the image and the name: `podman untag NAME` alone removes every name.
        subprocess.run([podman_tag, "untag", RUNTIME_IMAGE, ROLLOUT_IMAGE], check=False, timeout=60)


def rolled_to(
    kube: Kube, namespace: str, old_pods: set[str], revision: str | None = None
) -> Callable[[], bool]:
    """Every pod of the pipeline replaced (none of ``old_pods`` left, every Deployment
    caught up, the pipeline Ready) and its stage pods on one revision (``revision``, where
    given)."""

    def check() -> bool:
        names = {p["metadata"]["name"] for p in pipeline_pods(kube, namespace)}
        assert not names & old_pods, f"old pods left: {sorted(names & old_pods)}"
        deployments_rolled(kube, namespace)
        pipeline_ready(kube, namespace)()
        revisions = set().union(*stage_revisions(kube, namespace).values())
        if revision is not None:
            assert revisions == {revision}, revisions
        return len(revisions) == 1

    return check


def dit_pods(kube: Kube, namespace: str) -> list[str]:
    return [
        p["metadata"]["name"]
        for p in pipeline_pods(kube, namespace)
        if p["metadata"]["labels"].get("omni.dev/placement-group") == "dit"
    ]


def answers_go_on(loop: ClosedLoop, eventually: Eventually, after: str) -> None:
    eventually(
        progress(loop, 2, loop.snapshot().answered),
        timeout=120,
        interval=0.5,
        what=f"answers after the {after}",
    )


@pytest.mark.timeout(1500)  # every pod rolls twice, one is deleted; 2 shared cores
def test_rollouts_a_pod_delete_and_a_scale_down_under_a_closed_loop_lose_no_request(
    kube: Kube,
    real_node: RealNode,
    operator_installed: InstalledOperator,
    namespace: str,
    eventually: Eventually,
    second_runtime_tag: str,
) -> None:
    """Under one closed loop of clients, on one pipeline (the DiT at 2 replicas, then 1):

    - ``kubectl delete pod`` of one DiT replica, then a scale-down of the DiT to 1: the
      replica going away drains (stops being ready, finishes or hands back what it holds,
      the router retries hand-backs elsewhere) and nothing else rolls;
    - a config rollout that also changes the hand-off between the stages, so that a
      request pairing an old DiT with a new thinker (or the reverse) would fail. Each
      placement group's Deployment rolls on its own; the stage pods' readiness gate
      (omni_operator/revision_gate.py) keeps the old revision whole until the new one is,
      and the router never pairs two revisions in one request;
    - an image rollout: every pod again, the revision (the config) unchanged.

    The rollouts run with one replica per Deployment: each replaces its pods one surge pod
    at a time (render/pods.py), so a second replica would only make every rollout two pod starts
    long without testing anything the first does not. The clients see every request
    answered, with no HTTP error behind their retries."""
    figures = Figures()
    serving = serve_through_a_relay(kube, real_node, namespace, eventually, figures)
    old_revision = serving.revision
    with (
        real_node.unix_socket_to(serving.relay_ip, 8000) as relay,
        MetricsWatch(kube, namespace) as metrics,
        ClosedLoop("http://endpoint-relay/v1", uds=relay) as loop,
    ):
        eventually(progress(loop, 3, 0), timeout=120, interval=0.5, what="the loop warmed up")

        # `kubectl delete pod` of one DiT replica.
        before = dit_pods(kube, namespace)
        assert len(before) == 2, before
        t0 = time.monotonic()
        kube.kubectl("delete", "pod", before[0], "--wait=false", namespace=namespace)

        def replaced() -> bool:
            names = {p["metadata"]["name"] for p in pipeline_pods(kube, namespace)}
            assert before[0] not in names, "the deleted pod is still there"
            deployments_rolled(kube, namespace)
            return True

        eventually(replaced, timeout=180, interval=1, what="the deleted DiT pod replaced")
        figures.values["pod delete -> replaced (s)"] = round(time.monotonic() - t0, 1)
        answers_go_on(loop, eventually, "pod delete")

        # Scale the DiT down, 2 -> 1: one pod drains and goes, nothing else rolls.
        others = {
            p["metadata"]["name"]
            for p in pipeline_pods(kube, namespace)
            if p["metadata"]["labels"].get("omni.dev/placement-group") != "dit"
        }
        changed = copy.deepcopy(serving.body)
        dit = next(s for s in changed["spec"]["stages"] if s["name"] == "dit")
        dit["replicas"] = 1
        t0 = time.monotonic()
        kube.apply(changed, namespace=namespace)

        def scaled_down() -> bool:
            rolled = deployments_rolled(kube, namespace)
            assert rolled[f"{PIPELINE}-dit"]["spec"]["replicas"] == 1
            pipeline_ready(kube, namespace)()
            return True

        eventually(scaled_down, timeout=180, interval=1, what="the DiT scaled down to 1")
        figures.values["scale down (s)"] = round(time.monotonic() - t0, 1)
        left = {
            p["metadata"]["name"]
            for p in pipeline_pods(kube, namespace)
            if p["metadata"]["labels"].get("omni.dev/placement-group") != "dit"
        }
        assert left == others, "a scale change rolled other pods"
        # A pure scale change keeps the revision.
        assert set().union(*stage_revisions(kube, namespace).values()) == {old_revision}
        answers_go_on(loop, eventually, "scale-down")

        # The config rollout: the DiT now reads the thinker's hidden states from a
        # connector of another name, which an old DiT does not have (a mixed pair is a 500,
        # counted even where the client retried it).
        changed["spec"]["connectors"] = {"tcp_next": {"name": "TCPConnector"}}
        dit["inputConnectors"] = {"from_stage_0": "tcp_next"}
        dit["defaultSamplingParams"]["seed"] = 53
        old_pods = {p["metadata"]["name"] for p in pipeline_pods(kube, namespace)}
        answered = loop.snapshot().answered
        t0 = time.monotonic()
        kube.apply(changed, namespace=namespace)
        eventually(
            rolled_to(kube, namespace, old_pods),
            timeout=420,
            interval=1,
            what="every pod on the new config",
        )
        figures.values["config rollout (s)"] = round(time.monotonic() - t0, 1)
        (new_revision,) = set().union(*stage_revisions(kube, namespace).values())
        assert new_revision != old_revision
        # The newer config orders after the older (the operator's generation), so that
        # routers prefer it as soon as it is complete.
        assert revision_order(new_revision) > revision_order(old_revision)
        answers_go_on(loop, eventually, "config rollout")
        figures.values["answered during the config rollout"] = loop.snapshot().answered - answered

        # The image rollout.
        changed["spec"]["image"] = second_runtime_tag
        old_pods = {p["metadata"]["name"] for p in pipeline_pods(kube, namespace)}
        answered = loop.snapshot().answered
        t0 = time.monotonic()
        kube.apply(changed, namespace=namespace)
        eventually(
            rolled_to(kube, namespace, old_pods, new_revision),
            timeout=420,
            interval=1,
            what="every pod on the new image",
        )
        figures.values["image rollout (s)"] = round(time.monotonic() - t0, 1)
        images = {
            c["image"] for p in pipeline_pods(kube, namespace) for c in p["spec"]["containers"]
        }
        assert images == {second_runtime_tag}, images
        answers_go_on(loop, eventually, "image rollout")
        figures.values["answered during the image rollout"] = loop.snapshot().answered - answered
    figures.values["revisions"] = {"old": old_revision, "new": new_revision}
    counts, by_revision, served = record_loop(figures, loop, metrics, "rollouts under a loop")
    assert_nothing_lost(counts)
    # Both revisions served requests: the loop really ran across the switch.
    assert by_revision.get((old_revision,), 0) > 0, by_revision
    assert by_revision.get((new_revision,), 0) > 0, by_revision
    for (revision,), completed in by_revision.items():
        # Each completed request ran its last stage once, on its own revision.
        assert served.get(("dit", revision), 0) >= completed, (revision, served)
        assert served.get(("thinker", revision), 0) >= completed, (revision, served)


# The DiT between 1 and 2 pods (what the node's 2 cores hold beside the rest), one request
# per pod, and back down 15 s after the need is gone.
DIT_AUTOSCALING = {
    "minReplicas": 1,
    "maxReplicas": 2,
    "targetInFlight": 1,
    "scaleDownWindowSeconds": 15,
}


def dit_scaling(kube: Kube, namespace: str) -> dict[str, Any]:
    status = kube.get_json("omnipipeline", PIPELINE, namespace=namespace).get("status", {})
    dit = next((s for s in status.get("stages", []) if s["name"] == "dit"), {})
    scaling: dict[str, Any] = dit.get("autoscaling") or {}
    return scaling


def dit_deployment_at(kube: Kube, namespace: str, replicas: int) -> Callable[[], bool]:
    def check() -> bool:
        body = kube.get_json("deployment", f"{PIPELINE}-dit", namespace=namespace)
        assert body["spec"].get("replicas") == replicas, body["spec"].get("replicas")
        assert body.get("status", {}).get("readyReplicas") == replicas, body.get("status")
        return True

    return check


@pytest.mark.timeout(900)
def test_the_planner_adds_a_dit_pod_for_a_load_step_and_removes_it_after(
    kube: Kube,
    real_node: RealNode,
    operator_installed: InstalledOperator,
    namespace: str,
    eventually: Eventually,
) -> None:
    """Autoscaling on real pods: the operator, from its own pod, finds the router pod
    through its Service's EndpointSlices, reads its /metrics, and sizes the DiT. A closed
    loop of clients is a load step; the figure is its reaction: from the first request to
    a second DiT pod Ready (the planner's look, the Deployment, the pod's start and model
    load, the readiness gate). When the loop stops, the DiT goes back to one pod after the
    scale-down window; no request fails meanwhile."""
    figures = Figures()
    serving = serve_through_a_relay(
        kube, real_node, namespace, eventually, figures, dit_autoscaling=DIT_AUTOSCALING
    )

    def idle() -> bool:
        scaling = dit_scaling(kube, namespace)
        assert scaling.get("desiredReplicas") == 1, scaling
        assert "(min 1, max 2)" in scaling.get("reason", ""), scaling
        return True

    eventually(idle, timeout=120, interval=1, what="the planner's first look")
    with (
        real_node.unix_socket_to(serving.relay_ip, 8000) as relay,
        ClosedLoop("http://endpoint-relay/v1", uds=relay) as loop,
    ):
        t0 = time.monotonic()
        eventually(
            dit_deployment_at(kube, namespace, 2),
            timeout=300,
            interval=1,
            what="a second DiT pod Ready",
        )
        figures.values["load step -> 2nd DiT pod Ready (s)"] = round(time.monotonic() - t0, 1)
        answers_go_on(loop, eventually, "scale-up")
    counts = loop.snapshot()
    t0 = time.monotonic()
    eventually(
        dit_deployment_at(kube, namespace, 1),
        timeout=180,
        interval=1,
        what="the DiT back to one pod",
    )
    figures.values["load stop -> DiT back to 1 (s)"] = round(time.monotonic() - t0, 1)
    for reason in ("ScaledUp", "ScaledDown"):
        listed = kube.get_json(
            "events",
            f"--field-selector=involvedObject.kind=OmniPipeline,reason={reason}",
            namespace=namespace,
        )
        messages = [e.get("message", "") for e in listed["items"]]
        assert any(f"Deployment {PIPELINE}-dit" in m for m in messages), (reason, messages)
    figures.values.update(answered=counts.answered, failed=counts.failed)
    figures.show("autoscaling on the real node")
    assert counts.failed == 0, counts.errors


def revision_order(revision: str) -> int:
    order, _, _ = revision.partition("-")
    return int(order)


# --- 5. video jobs through the operator's pods and its Redis ---------------------------------

VIDEO_MODEL = "tiny-wan"
# Debian's redis-server on the same locally made base as the project's images: no registry
# is reachable here for the official image the operator defaults to. The pod runs it the
# way it runs that one (redis-server on the PATH, a config file, arguments).
REDIS_IMAGE = "omni-operator.test/redis-server:bookworm"
REDIS_CONTAINERFILE = """\
FROM docker.io/library/python:3.11-slim-bookworm
RUN apt-get update \\
    && apt-get install -y --no-install-recommends redis-server \\
    && rm -rf /var/lib/apt/lists/*
"""
# A clip that keeps the tiny DiT busy for tens of seconds in its one-thread pod, long
# enough to delete the router that runs it mid-way.
LONG_CLIP = {"num_frames": 33, "num_inference_steps": 120, "seed": 5}


@pytest.fixture
def redis_image(real_node: RealNode, tmp_path: Path) -> str:
    podman = shutil.which("podman")
    assert podman is not None, "podman is not on PATH"
    conf = subprocess.run(
        ["bash", str(REPO / "scripts" / "images.sh"), "--containers-conf"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    (tmp_path / "Containerfile").write_text(REDIS_CONTAINERFILE)
    # podman's layer cache makes a warm build a check.
    subprocess.run(
        [podman, "build", "--pull=never", "--format", "docker", "-t", REDIS_IMAGE, str(tmp_path)],
        check=True, capture_output=True, text=True, timeout=600,
        env={**os.environ, "CONTAINERS_CONF": conf},
    )  # fmt: skip
    real_node.load_image(REDIS_IMAGE)
    return REDIS_IMAGE


def tiny_video_pipeline(node: RealNode, redis: str) -> dict[str, Any]:
    """The tiny Wan2.2 (one diffusion stage) behind two routers that share their jobs
    through the Redis the operator runs, every pod on the real node."""

    def placement(cpu: str, memory: str) -> dict[str, Any]:
        return {
            "nodeSelector": dict(node.node_selector),
            "tolerations": [dict(node.toleration)],
            "resources": {"requests": {"cpu": cpu, "memory": memory}},
            "env": [dict(var) for var in SINGLE_THREADED_VLLM],
        }

    return {
        "apiVersion": "omni.dev/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": PIPELINE},
        "spec": {
            "model": "$OMNI_TINY_MODELS/wan2.2",
            "family": "wan2.2",
            "stages": [
                {
                    "stageId": 0,
                    "name": "dit",
                    "type": "diffusion",
                    "devices": "cpu",
                    "placement": placement("300m", "1Gi"),
                }
            ],
            "router": {
                "replicas": 2,
                "servedModelName": VIDEO_MODEL,
                "placement": placement("100m", "256Mi"),
                "videos": {"maxActiveJobs": 4, "jobsPerRouter": 1},
                "videoStore": {
                    "image": redis,
                    "imagePullPolicy": "Never",
                    "memory": "256Mi",
                    "cpu": "50m",
                    "nodeSelector": dict(node.node_selector),
                    "tolerations": [dict(node.toleration)],
                },
            },
        },
    }


@pytest.mark.timeout(1500)  # a cold load of the runtime image, then a clip run twice
def test_a_video_job_outlives_the_router_pod_that_runs_it(
    kube: Kube,
    real_node: RealNode,
    operator_installed: InstalledOperator,
    namespace: str,
    port_forwards: PortForwards,
    redis_image: str,
    eventually: Eventually,
) -> None:
    """A video job through the operator's pods: two routers, the Redis the operator runs
    for them (its password made by the operator, in a Secret), the DiT. The router pod
    that runs the job is deleted mid-clip; the job completes on the other one and its MP4
    is fetched through the pipeline's Service."""
    import av

    from omni_runtime.router.job_store import RedisJobStore

    figures = Figures()
    real_node.load_image(RUNTIME_IMAGE)
    kube.apply(tiny_video_pipeline(real_node, redis_image), namespace=namespace)
    eventually(pipeline_ready(kube, namespace), timeout=300, interval=1, what="tiny Ready")
    requests_fit_the_node(kube, real_node, namespace)
    store = kube.get_json("deployment", f"{PIPELINE}-video-store", namespace=namespace)
    assert store["status"].get("readyReplicas") == 1, store["status"]
    figures.mark("pipeline and its Redis Ready (s)")

    # The operator made the password; the routers have it from the Secret, not the config.
    secret = kube.get_json("secret", f"{PIPELINE}-video-store", namespace=namespace)
    password = base64.b64decode(secret["data"]["password"]).decode()
    config_maps = kube.get_json("configmaps", namespace=namespace)["items"]
    assert not [c for c in config_maps if password in json.dumps(c)]
    redis_port = port_forwards.start(namespace, f"svc/{PIPELINE}-video-store", 6379)

    cluster_ip = kube.get_json("service", PIPELINE, namespace=namespace)["spec"]["clusterIP"]
    kube.apply(relay_pod(real_node, cluster_ip), namespace=namespace)
    kube.kubectl(
        "wait", "--for=condition=Ready", "pod/endpoint-relay", "--timeout=60s",
        namespace=namespace, timeout=90,
    )  # fmt: skip
    relay_ip = kube.get_json("pod", "endpoint-relay", namespace=namespace)["status"]["podIP"]

    async def holder(job_id: str) -> tuple[str, str | None, int]:
        jobs = RedisJobStore(
            f"redis://127.0.0.1:{redis_port}/0",
            prefix=f"omni-videos:{VIDEO_MODEL}",
            password=password,
        )
        try:
            job = await jobs.get(job_id)
        finally:
            await jobs.close()
        assert job is not None, job_id
        return job.status, job.owner, job.progress

    with real_node.unix_socket_to(relay_ip, 8000) as relay:
        http = openai.DefaultHttpxClient(transport=httpx2.HTTPTransport(uds=relay), timeout=60)
        client = openai.OpenAI(base_url="http://endpoint-relay/v1", api_key="-", http_client=http)
        video = client.videos.create(
            model=VIDEO_MODEL,
            prompt="a paper boat on a pond",
            size="256x256",  # type: ignore[arg-type]
            extra_body=LONG_CLIP,
        )

        def running() -> str:
            status, owner, progress = asyncio.run(holder(video.id))
            assert status == "in_progress", status
            assert owner is not None
            assert progress > 0, progress
            return owner

        owner = eventually(running, timeout=180, interval=0.5, what="the job under way")
        figures.mark("job under way (s)")
        # The owner is <pod>-<pid>-<random>: the router pod that runs it.
        pod = owner.rsplit("-", 2)[0]
        routers = [
            p["metadata"]["name"]
            for p in pipeline_pods(kube, namespace)
            if p["metadata"]["labels"][COMPONENT_LABEL] == "router"
        ]
        assert pod in routers, (owner, routers)
        kube.kubectl("delete", "pod", pod, "--wait=false", namespace=namespace)

        def finished() -> Any:
            job = client.videos.retrieve(video.id)
            assert job.status in ("completed", "failed"), (job.status, job.progress)
            return job

        done = eventually(finished, timeout=600, interval=1, what="the job finished")
        figures.mark("job completed (s)")
        assert done.status == "completed", done.error
        status, last_owner, progress = asyncio.run(holder(video.id))
        assert (status, progress) == ("completed", 100)
        # Finished by another router than the one deleted.
        assert last_owner is not None
        assert not last_owner.startswith(f"{pod}-"), last_owner
        mp4 = client.videos.download_content(video.id).read()
        http.close()
    with av.open(io.BytesIO(mp4)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == LONG_CLIP["num_frames"]
    assert frames[0].shape == (256, 256, 3)
    figures.values["clip (bytes)"] = len(mp4)

    kube.kubectl("delete", "omnipipeline", PIPELINE, "--wait=true", namespace=namespace)
    eventually(
        lambda: owned(kube, namespace) == [] and pipeline_pods(kube, namespace) == [],
        timeout=120, interval=1, what="the pipeline's objects, its Redis included, gone",
    )  # fmt: skip
    figures.show("a video job across a router pod's deletion")
