"""`kubectl kustomize` renders manifests/base and the single-namespace overlay into an
operator that holds exactly the rights its renderer needs (no wildcard, no secrets) and
runs as the operator image's entry point says. kubectl comes from the control plane build
of tests/cluster/controlplane (skipped, saying so, where that is not built)."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from dockerfiles import parse_dockerfile
from omni_operator.api import GROUP, PLURAL, OmniPipelineSpec
from omni_operator.render import render
from omni_operator.render.names import CHILD_KINDS

# They run kubectl, a program of the control plane build.
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "manifests" / "base"
OVERLAY = REPO / "manifests" / "overlays" / "single-namespace"
EXAMPLES = REPO / "manifests" / "examples"
CRD_FILE = REPO / "crds" / f"{PLURAL}.yaml"
OPERATOR_NAMESPACE = "omni-system"
OPERATOR_UID = 65532
ALL_VERBS = frozenset({"get", "list", "watch", "create", "update", "patch", "delete"})
# Resources that only exist cluster-wide: a Role cannot grant them.
CLUSTER_SCOPED = frozenset(
    {("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces")}
)


def kubectl() -> str:
    build = REPO / "tests" / "cluster" / "controlplane" / "build.sh"
    result = subprocess.run(
        ["bash", str(build), "--print-bin-dir"], capture_output=True, text=True, timeout=60
    )
    if result.returncode != 0:
        pytest.skip(f"no control plane build to take kubectl from: {result.stderr.strip()}")
    binary = Path(result.stdout.strip().splitlines()[-1]) / "kubectl"
    if not binary.is_file():
        pytest.skip(f"kubectl not built ({binary}): run bash {build.relative_to(REPO)}")
    return str(binary)


def kustomize(directory: Path) -> list[dict[str, Any]]:
    assert CRD_FILE.is_file(), (
        f"{CRD_FILE.relative_to(REPO)} is missing: generate it with python -m omni_operator.crd"
    )
    result = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, (
        f"kubectl kustomize {directory.relative_to(REPO)}: {result.stderr}"
    )
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def one(docs: Iterable[Mapping[str, Any]], kind: str) -> dict[str, Any]:
    found = [dict(d) for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


Grant = tuple[str, str, str]  # (apiGroup, resource, verb)


def grants(rules: Iterable[Mapping[str, Any]]) -> set[Grant]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule.get("verbs", [])
    }


def api_group(api_version: str) -> str:
    return api_version.rpartition("/")[0]


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return kustomize(BASE)


@pytest.fixture(scope="module")
def overlay() -> list[dict[str, Any]]:
    return kustomize(OVERLAY)


def test_base_holds_the_crd(base: list[dict[str, Any]]) -> None:
    crd = one(base, "CustomResourceDefinition")
    assert crd["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    assert crd["spec"] == yaml.safe_load(CRD_FILE.read_text())["spec"]


def test_everything_namespaced_is_in_the_operator_namespace(base: list[dict[str, Any]]) -> None:
    assert one(base, "Namespace")["metadata"]["name"] == OPERATOR_NAMESPACE
    for doc in base:
        if doc["kind"] in {"ServiceAccount", "Deployment", "Role", "RoleBinding"}:
            assert doc["metadata"].get("namespace") == OPERATOR_NAMESPACE, doc["metadata"]
    for kind in ("ClusterRoleBinding",):
        for subject in one(base, kind)["subjects"]:
            assert subject == {
                "kind": "ServiceAccount",
                "name": "omni-operator",
                "namespace": OPERATOR_NAMESPACE,
            }


def entrypoint(dockerfile: str) -> list[str]:
    (value,) = parse_dockerfile(REPO / dockerfile).stages[-1].args("ENTRYPOINT")
    command: list[str] = json.loads(value)
    return command


def test_operator_deployment(base: list[dict[str, Any]]) -> None:
    deployment = one(base, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == one(base, "ServiceAccount")["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == OPERATOR_UID
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["image"] == "omni-operator/omni-operator:0.1.0"
    # The image's entry point, unchanged.
    assert container["command"] + container["args"] == entrypoint("Dockerfile.operator")
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert set(container["resources"]) == {"requests", "limits"}

    # The liveness probe asks what kopf's --liveness serves.
    (liveness,) = [a for a in container["args"] if a.startswith("--liveness=")]
    url = re.fullmatch(r"--liveness=http://0\.0\.0\.0:(\d+)(/\S*)", liveness)
    assert url, liveness
    probe = container["livenessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert probe["path"] == url.group(2)
    assert ports.get(probe["port"], probe["port"]) == int(url.group(1))

    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["OMNI_RUNTIME_IMAGE"] == "omni-operator/omni-runtime:0.1.0"
    assert env["OMNI_RUNTIME_CUDA_IMAGE"] == "omni-operator/omni-runtime:0.1.0-cuda"


def check_least_privilege(docs: list[dict[str, Any]]) -> None:
    roles = [d for d in docs if d["kind"] in {"Role", "ClusterRole"}]
    assert roles
    for role in roles:
        where = f"{role['kind']} {role['metadata']['name']}"
        for rule in role["rules"]:
            assert "nonResourceURLs" not in rule, f"{where}: {rule}"
            for key in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert not any("*" in value for value in rule.get(key, [])), f"{where}: {rule}"
            # Secrets: created (the pipeline's stage keys), never read, listed or changed.
            if "secrets" in rule["resources"]:
                assert rule["verbs"] == ["create"], f"{where} grants more on secrets: {rule}"
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), f"{where}: {rule}"
    for binding in (d for d in docs if d["kind"] in {"RoleBinding", "ClusterRoleBinding"}):
        assert binding["roleRef"]["name"] in {r["metadata"]["name"] for r in roles}, binding
        assert binding["roleRef"]["name"] not in {"cluster-admin", "admin", "edit"}, binding


def test_base_rbac_is_least_privilege(base: list[dict[str, Any]]) -> None:
    check_least_privilege(base)
    assert [d["kind"] for d in base if d["kind"] in {"Role", "RoleBinding"}] == []


def rendered_examples() -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        # An example may bring what its pipeline mounts (a PersistentVolumeClaim) beside it.
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "OmniPipeline":
                continue
            spec = OmniPipelineSpec.model_validate(doc["spec"])
            objects += render(doc["metadata"]["name"], "demo", "0000", spec, default_image="img")
    assert objects, f"no OmniPipeline under {EXAMPLES.relative_to(REPO)}"
    return objects


def test_cluster_role_covers_what_the_operator_does(base: list[dict[str, Any]]) -> None:
    granted = grants(one(base, "ClusterRole")["rules"])

    def lacking(wanted: Iterable[Grant]) -> list[Grant]:
        return sorted(set(wanted) - granted)

    # Every kind the renderer makes: applied, watched, pruned.
    children = {(api_group(k.api_version), k.plural, v) for k in CHILD_KINDS for v in ALL_VERBS}
    assert lacking(children) == []
    # ... which covers the kinds of what it renders for the examples.
    plurals = {(api_group(k.api_version), k.kind): k.plural for k in CHILD_KINDS}
    rendered = rendered_examples()
    for obj in rendered:
        assert (api_group(obj["apiVersion"]), obj["kind"]) in plurals, obj["kind"]
    # What the rendered Roles grant, the operator must hold itself (RBAC escalation check).
    for role in (o for o in rendered if o["kind"] == "Role"):
        assert lacking(grants(role["rules"])) == [], role["metadata"]["name"]
    # The pipelines, their status, Events, kopf's own needs, and the stage pods' readiness
    # gate (pods read, one condition written through their status).
    needs = [
        *[("", "pods", v) for v in ("get", "list", "watch")],
        ("", "pods/status", "patch"),
        *[(GROUP, PLURAL, v) for v in ("get", "list", "watch", "patch")],
        *[(GROUP, f"{PLURAL}/status", v) for v in ("get", "patch")],
        (GROUP, f"{PLURAL}/finalizers", "update"),
        ("", "events", "create"),
        ("events.k8s.io", "events", "create"),
        *[("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")],
    ]
    assert lacking(needs) == []
    # Peering is not used (--standalone), so kopf.dev is not granted.
    assert not any(group == "kopf.dev" for group, _, _ in granted)
    # It never writes a pod's spec, nor creates or deletes one (the Deployments do).
    assert {v for _, resource, v in granted if resource == "pods"} == {"get", "list", "watch"}
    assert {v for _, resource, v in granted if resource == "pods/status"} == {"patch"}


def test_single_namespace_overlay(
    base: list[dict[str, Any]], overlay: list[dict[str, Any]]
) -> None:
    check_least_privilege(overlay)
    cluster_wide = grants(one(overlay, "ClusterRole")["rules"])
    assert {(g, r) for g, r, _ in cluster_wide} <= CLUSTER_SCOPED
    # kopf reads both at start-up even when it serves one namespace.
    assert ("apiextensions.k8s.io", "customresourcedefinitions", "watch") in cluster_wide
    assert ("", "namespaces", "list") in cluster_wide

    # The Role grants in the operator's namespace what the base grants everywhere.
    role = one(overlay, "Role")
    expected = {g for g in grants(one(base, "ClusterRole")["rules"]) if g[:2] not in CLUSTER_SCOPED}
    assert grants(role["rules"]) == expected

    deployment = one(overlay, "Deployment")
    namespace = deployment["metadata"]["namespace"]
    assert role["metadata"]["namespace"] == namespace
    binding = one(overlay, "RoleBinding")
    assert binding["metadata"]["namespace"] == namespace
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": namespace}
    ]

    # kopf watches the operator's own namespace instead of all; nothing else changes.
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (base_container,) = one(base, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["args"] == [
        "--namespace=$(OMNI_NAMESPACE)" if a == "--all-namespaces" else a
        for a in base_container["args"]
    ]
    env = {e["name"]: e for e in container["env"]}
    assert env["OMNI_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert deployment["spec"]["replicas"] == 1
