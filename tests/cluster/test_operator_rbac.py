"""The operator does its whole job with only the permissions manifests/base grants it.

`kubectl apply -k manifests/base` installs the CRD, the namespace, the ServiceAccount and
its ClusterRole; the operator then runs here (kwok cannot run its image) with a token of
that ServiceAccount, and must take a pipeline to Ready without a single refusal.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from operator_harness import REPO, OperatorProcess, example

if TYPE_CHECKING:
    from conftest import Kube

Eventually = Callable[..., Any]
OPERATOR_NAMESPACE = "omni-system"


@pytest.fixture
def installed(kube: Kube) -> Iterator[None]:
    if not kube.local:
        pytest.skip("installs cluster-wide objects: only on the local control plane")
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(REPO / "manifests/base"))
    kube.wait_crd_established("omnipipelines.omni.dev")
    return


def service_account_kubeconfig(kube: Kube, path: Path) -> Path:
    """A kubeconfig for the same apiserver that authenticates as the operator's
    ServiceAccount (a bound token), not as the admin."""
    admin = yaml.safe_load(kube.kubeconfig.read_text())
    cluster = admin["clusters"][0]["cluster"]
    token = kube.kubectl(
        "create", "token", "omni-operator", "--duration=1h", namespace=OPERATOR_NAMESPACE
    ).stdout.strip()
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "test", "cluster": cluster}],
                "users": [{"name": "omni-operator", "user": {"token": token}}],
                "contexts": [
                    {"name": "operator", "context": {"cluster": "test", "user": "omni-operator"}}
                ],
                "current-context": "operator",
            }
        )
    )
    assert base64.b64decode(cluster["certificate-authority-data"])  # TLS is verified
    return path


def test_the_operator_needs_no_more_than_its_clusterrole(
    kube: Kube, installed: None, namespace: str, tmp_path: Path, eventually: Eventually
) -> None:
    # The ServiceAccount really is limited: no secrets, no pods of its own making.
    for verb, resource in (("list", "secrets"), ("create", "pods"), ("create", "clusterroles")):
        said = kube.kubectl(
            "auth",
            "can-i",
            verb,
            resource,
            f"--as=system:serviceaccount:{OPERATOR_NAMESPACE}:omni-operator",
            "--all-namespaces",
            check=False,
        )
        assert said.stdout.strip() == "no", f"{verb} {resource}: {said.stdout}"

    kubeconfig = service_account_kubeconfig(kube, tmp_path / "operator.kubeconfig")
    op = OperatorProcess(
        {**kube.env(), "KUBECONFIG": str(kubeconfig)}, namespace, tmp_path / "operator.log"
    )
    op.start()
    try:
        body = example("tiny-pipeline.yaml")
        name = body["metadata"]["name"]
        kube.apply(body, namespace=namespace)

        def ready() -> bool:
            got = kube.get_json("omnipipeline", name, namespace=namespace)
            assert got.get("status", {}).get("phase") == "Ready", got.get("status")
            return True

        eventually(ready, timeout=90, what="Ready under the operator's own RBAC")
        # Deleting a child makes the operator put it back: its watches and writes allowed.
        # The ConfigMap is named by the config's hash: one per configuration.
        (config_map,) = kube.get_json(
            "configmaps", "-l", f"omni.dev/pipeline={name}", namespace=namespace
        )["items"]
        config_name = config_map["metadata"]["name"]
        kube.kubectl("delete", "configmap", config_name, namespace=namespace)
        eventually(
            lambda: kube.kubectl("get", "configmap", config_name, namespace=namespace),
            timeout=60,
            what="the ConfigMap put back",
        )
        log = op.log_tail(400)
        # kopf logs a refusal as APIForbiddenError, ours says Forbidden too.
        assert "Forbidden" not in log, log
    finally:
        op.stop()
        print(f"--- operator log (tail) ---\n{op.log_tail()}")
