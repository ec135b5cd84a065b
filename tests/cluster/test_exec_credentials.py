"""A kubeconfig whose user is an ``exec`` credential plugin, as on EKS, GKE or AKS.

The plugin (exec_credential_plugin.py) hands out the local control plane's static bearer
token (controlplane.py's ``token``); the kubeconfig has no client certificate, so that token
is all that can authenticate. Through it: the operator's client (who the apiserver says we
are, an apply), a whole operator process (kopf's login and the operator's own calls both
through it, a pipeline taken to Ready), and the router's EndpointSlice discovery.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from operator_harness import CRD_FILE, OperatorProcess, endpoint_slice, example

from omni_runtime.kube import KubeApiError, KubeClient, load_kube_config
from omni_testkit.port_leases import lease_port

if TYPE_CHECKING:
    from conftest import Kube

Eventually = Callable[..., Any]
HERE = Path(__file__).resolve().parent
PLUGIN = HERE / "exec_credential_plugin.py"
TOKEN_USER = "omni-test-token-admin"  # controlplane.py's TOKEN_USER
CLI = [sys.executable, "-m", "omni_runtime.entrypoints.cli"]


@dataclass(frozen=True)
class ExecKubeconfig:
    path: Path
    calls: Path  # one JSON line per plugin run: the ExecCredential request it was given

    def runs(self) -> list[Any]:
        if not self.calls.exists():
            return []
        return [json.loads(line) for line in self.calls.read_text().splitlines()]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return {**base, "KUBECONFIG": str(self.path)}


def exec_kubeconfig(kube: Kube, where: Path, token_file: Path) -> ExecKubeconfig:
    admin = yaml.safe_load(kube.kubeconfig.read_text())
    cluster = admin["clusters"][0]["cluster"]
    calls = where.with_suffix(".calls")
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(PLUGIN), str(token_file), str(calls)],
            "interactiveMode": "Never",
        }
    }
    where.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "test", "cluster": cluster}],
                "users": [{"name": "via-plugin", "user": user}],
                "contexts": [
                    {"name": "plugin", "context": {"cluster": "test", "user": "via-plugin"}}
                ],
                "current-context": "plugin",
            }
        )
    )
    return ExecKubeconfig(where, calls)


@pytest.fixture
def via_plugin(kube: Kube, tmp_path: Path) -> ExecKubeconfig:
    token = kube.kubeconfig.parent / "token"
    if not kube.local or not token.is_file():
        pytest.skip("needs the local control plane's static token (controlplane.py)")
    return exec_kubeconfig(kube, tmp_path / "exec.kubeconfig", token)


async def test_the_client_authenticates_as_the_plugins_token(
    kube: Kube, namespace: str, via_plugin: ExecKubeconfig, tmp_path: Path
) -> None:
    config = load_kube_config(str(via_plugin.path), environ={})
    # The plugin ran once, given the request the protocol prescribes.
    (request,) = via_plugin.runs()
    assert request["kind"] == "ExecCredential"
    assert request["apiVersion"] == "client.authentication.k8s.io/v1"
    assert config.configuration.cert_file is None  # no certificate to fall back on
    async with KubeClient(config) as client:
        review = await client.request(
            "POST",
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        )
        assert review["status"]["userInfo"]["username"] == TOKEN_USER
        cm = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "via-plugin", "namespace": namespace},
            "data": {"a": "1"},
        }
        applied = await client.apply(cm, field_manager="omni-operator")
        assert applied["data"] == {"a": "1"}
    assert kube.get_json("configmap", "via-plugin", namespace=namespace)["data"] == {"a": "1"}

    # The same plugin with a token the apiserver does not know: refused, so the plugin's
    # token is what got us in above.
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-a-token\n")
    refused = exec_kubeconfig(kube, tmp_path / "wrong.kubeconfig", wrong)
    async with KubeClient(load_kube_config(str(refused.path), environ={})) as client:
        with pytest.raises(KubeApiError) as error:
            await client.list(f"/api/v1/namespaces/{namespace}/configmaps")
    assert error.value.status == 401


@pytest.fixture
def crd(kube: Kube) -> None:
    kube.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    kube.wait_crd_established("omnipipelines.omni.dev")


def test_the_operator_logs_in_and_works_through_the_plugin(
    kube: Kube,
    crd: None,
    namespace: str,
    via_plugin: ExecKubeconfig,
    tmp_path: Path,
    eventually: Eventually,
) -> None:
    op = OperatorProcess(via_plugin.env(kube.env()), namespace, tmp_path / "operator.log")
    op.start()
    try:
        body = example("tiny-pipeline.yaml")
        name = body["metadata"]["name"]
        kube.apply(body, namespace=namespace)

        def ready() -> bool:
            got = kube.get_json("omnipipeline", name, namespace=namespace)
            return got.get("status", {}).get("phase") == "Ready"

        # Ready needs both: kopf's watch of Deployments, and the operator's applies and
        # status writes.
        eventually(ready, timeout=90, what=f"{name} Ready\n{op.log_tail()}")
        deployments = kube.get_json(
            "deployments",
            "-l",
            f"omni.dev/pipeline={name}",
            "--show-managed-fields",
            namespace=namespace,
        )
        managers = {
            f["manager"] for d in deployments["items"] for f in d["metadata"]["managedFields"]
        }
        assert "omni-operator" in managers
        assert via_plugin.runs(), "the operator never ran the exec plugin"
        assert "Initial authentication has finished" in op.log_tail(400)
    finally:
        op.stop()
    assert op.proc is not None
    assert op.proc.returncode == 0, op.log_tail()


def test_the_operator_with_a_failing_plugin_says_so_in_one_line(
    kube: Kube, namespace: str, tmp_path: Path, eventually: Eventually
) -> None:
    if not kube.local:
        pytest.skip("only on the local control plane")
    broken = exec_kubeconfig(kube, tmp_path / "broken.kubeconfig", tmp_path / "no-such-token")
    log = tmp_path / "operator.log"
    op = OperatorProcess(broken.env(kube.env()), namespace, log)
    with pytest.raises(AssertionError, match="operator exited"):
        op.start(timeout=60)
    text = log.read_text()
    assert str(broken.path) in text
    assert "exec: process returned 1" in text
    assert "Traceback" not in text, text


# --- the router ------------------------------------------------------------------------


@pytest.fixture
def pipeline_file(tmp_path: Path) -> Path:
    # The router never opens the model: it only names it.
    path = tmp_path / "pipeline.json"
    pipeline = {
        "model": str(tmp_path / "tiny-dit"),
        "stages": [{"stageId": 0, "name": "dit", "type": "diffusion"}],
        "router": {"servedModelName": "tiny-dit"},
    }
    path.write_text(json.dumps(pipeline))
    return path


@pytest.fixture
def router_log(
    kube: Kube, namespace: str, via_plugin: ExecKubeconfig, pipeline_file: Path, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    log = tmp_path / "router.log"
    env = {k: v for k, v in kube.env().items() if not k.startswith("OMNI_STAGE_SERVICE_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                *CLI, "router", "-f", str(pipeline_file), "--host", "127.0.0.1",
                "--port", str(lease_port()), "--discover-namespace", namespace,
                "--stage-service", "0=stages",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=via_plugin.env(env),
        )  # fmt: skip
    try:
        yield proc, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_router_discovery_works_through_the_plugin_and_stops_cleanly(
    kube: Kube,
    namespace: str,
    via_plugin: ExecKubeconfig,
    router_log: tuple[subprocess.Popen[bytes], Path],
    eventually: Eventually,
) -> None:
    proc, log = router_log

    def logged(text: str) -> bool:
        assert proc.poll() is None, f"router exited {proc.returncode}:\n{log.read_text()}"
        return text in log.read_text()

    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "stages", "namespace": namespace},
            "spec": {"clusterIP": "None", "ports": [{"name": "stage-0", "port": 52000}]},
        }
    )
    eventually(lambda: logged("stage 0 (dit): 0 replica(s)"), timeout=60, what="first list")
    assert via_plugin.runs(), "the router never ran the exec plugin"
    # A documentation address: nothing answers there, and nothing needs to.
    kube.apply(endpoint_slice(namespace, ("192.0.2.7", 52007), ready=True))
    # Seen through the watch (the list came before the slice existed).
    eventually(
        lambda: logged("stage 0 (dit): 1 replica(s): 192.0.2.7:52007"),
        timeout=30,
        what="the slice seen",
    )
    kube.kubectl("delete", "endpointslice", "stages-hand", namespace=namespace)
    eventually(
        lambda: log.read_text().count("stage 0 (dit): 0 replica(s)") == 2,
        timeout=30,
        what="the slice's deletion seen",
    )
    # SIGTERM with a watch open: the router must stop promptly, the lifespan's close of
    # the client waking the watch's thread rather than waiting out the watch's 300 s.
    # (uvicorn re-raises the signal once it has shut down, hence -SIGTERM.)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) in (0, -signal.SIGTERM), log.read_text()
    assert "Traceback" not in log.read_text()
