"""The project's images, built here by scripts/images.sh from the Dockerfiles as users build
them, checked the way pods run them: as uid 65532 with a read-only root filesystem, writable
only where the operator mounts emptyDirs (/tmp, $HOME). The runtime image serves the tiny
pipeline and answers a real request through the official client.

Containers run with podman (runc), on no network or on the host's loopback only."""

from __future__ import annotations

import base64
import io
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import openai
import pytest
from PIL import Image
from serving import wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "scripts" / "images.sh"
# A cold build of the runtime image takes minutes; scripts/test.sh builds the images before
# pytest starts, so in CI this only checks that they are up to date.
BUILD_TIMEOUT_S = 3600
# What the operator gives a stage container (render/pods.py): writable /tmp and $HOME only, as
# emptyDirs. podman gives a tmpfs the image directory's owner and mode (root, 0750 for
# $HOME) unless told to chown it to the container's user (U).
READ_ONLY = [
    "--read-only",
    "--tmpfs", "/tmp:rw,mode=1777",
    "--tmpfs", "/var/lib/omni:rw,U",
]  # fmt: skip


def images_unavailable() -> str | None:
    """Why images cannot be built and run here (None if they can)."""
    if os.geteuid() != 0:
        return "building and running the images needs root (podman, rootful)"
    missing = [tool for tool in ("podman", "mmdebstrap", "runc") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (scripts/host_packages.sh installs them)"
    return None


@pytest.fixture(scope="session")
def podman_env() -> dict[str, str]:
    reason = images_unavailable()
    if reason is not None:
        if os.environ.get("OMNI_REQUIRE_IMAGES"):
            pytest.fail(f"OMNI_REQUIRE_IMAGES is set, but {reason}")
        pytest.skip(reason)
    conf = subprocess.run(
        [str(IMAGES), "--containers-conf"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return {**os.environ, "CONTAINERS_CONF": conf}


def built(name: str, env: dict[str, str]) -> str:
    """The tag of image ``name``, built (or found up to date) by scripts/images.sh."""
    result = subprocess.run(
        [str(IMAGES), name], capture_output=True, text=True, env=env, timeout=BUILD_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (line,) = result.stdout.splitlines()
    built_name, tag = line.split()
    assert built_name == name
    return tag


def podman(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    result = subprocess.run(
        ["podman", *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert result.returncode == 0, f"podman {' '.join(args)}:\n{result.stderr[-4000:]}"
    return result.stdout


def image_size_gb(env: dict[str, str], tag: str) -> float:
    return int(podman(env, "image", "inspect", "--format", "{{.Size}}", tag)) / 1e9


@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_operator_image_runs_kopf_as_its_user_read_only(podman_env: dict[str, str]) -> None:
    tag = built("operator", podman_env)
    version = podman(
        podman_env, "run", "--rm", "--network", "none", "--read-only",
        "--entrypoint", "kopf", tag, "--version",
    )  # fmt: skip
    assert version.startswith("kopf, version "), version
    probe = podman(
        podman_env, "run", "--rm", "--network", "none", "--read-only", "--entrypoint",
        "python", tag, "-c", "import os, omni_operator.handlers; print(os.getuid(), os.getgid())",
    )  # fmt: skip
    assert probe.split() == ["65532", "65532"]
    # Only what the operator needs: no ML stack (the import contracts keep its code so).
    absent = podman(
        podman_env, "run", "--rm", "--network", "none", "--entrypoint", "python", tag, "-c",
        "import importlib.util as u; "
        "print([m for m in ('torch', 'vllm', 'diffusers') if u.find_spec(m)])",
    )  # fmt: skip
    assert absent.strip() == "[]"
    assert image_size_gb(podman_env, tag) < 1.0


@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_runtime_image_imports_its_stack_as_its_user_read_only(
    podman_env: dict[str, str],
) -> None:
    tag = built("runtime", podman_env)
    probe = podman(
        podman_env, "run", "--rm", "--network", "none", *READ_ONLY, "--entrypoint", "python",
        "-e", "VLLM_LOGGING_LEVEL=ERROR", tag, "-c",
        "import os, torch, torchvision.ops, vllm, diffusers, mooncake.engine, omni_runtime; "
        "print(os.getuid(), torch.__version__, vllm.__version__, os.environ['OMNI_TINY_MODELS'])",
    )  # fmt: skip
    uid, torch_version, vllm_version, tiny = probe.split()[-4:]
    assert uid == "65532"
    assert torch_version.startswith("2.13.0"), torch_version
    assert vllm_version.startswith("0.32.0"), vllm_version
    assert tiny == "/opt/omni/tiny-models"


@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_runtime_image_serves_the_tiny_pipeline_as_its_user(podman_env: dict[str, str]) -> None:
    """``omni-runtime serve`` inside the image, read-only, as uid 65532, with the models
    baked into it: a real request through the official client gets a PNG back. (This is
    where the baked models' file modes once failed: 0600 and owned by root.)"""
    tag = built("runtime", podman_env)
    name = f"omni-serve-{uuid.uuid4().hex[:8]}"
    pipeline = REPO / "examples" / "tiny-text-to-image.yaml"
    # The host's network namespace, and in it loopback only: port 0 picks a free port, and
    # serve says which once it listens.
    podman(
        podman_env, "run", "-d", "--name", name, "--network", "host", *READ_ONLY,
        "-v", f"{pipeline}:/etc/omni/pipeline.yaml:ro", tag,
        "serve", "-f", "/etc/omni/pipeline.yaml", "--host", "127.0.0.1", "--port", "0",
    )  # fmt: skip
    try:

        def announced() -> str | None:
            state = podman(podman_env, "inspect", "--format", "{{.State.Status}}", name).strip()
            logs = podman(podman_env, "logs", name)
            if state != "running":
                raise AssertionError(f"the container is {state}:\n{logs[-4000:]}")
            for line in logs.splitlines():
                if line.startswith("serving http://"):
                    return line.split()[1]
            return None

        started = time.monotonic()
        base_url: str = wait_until(announced, 300, "serve inside the image", interval=1)
        client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120)
        answer = client.images.generate(
            model="tiny-omni",
            prompt="a red square",
            size="64x64",
            response_format="b64_json",
            extra_body={"num_inference_steps": 2, "seed": 1},
        )
        assert answer.data
        assert answer.data[0].b64_json
        image = Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json)))
        assert image.format == "PNG"
        assert image.size == (64, 64)
        print(f"served from the image in {time.monotonic() - started:.0f} s")
    finally:
        subprocess.run(
            ["podman", "stop", "-t", "30", name], env=podman_env, capture_output=True, timeout=90
        )
        logs = subprocess.run(
            ["podman", "logs", name], env=podman_env, capture_output=True, text=True, timeout=30
        ).stdout
        subprocess.run(["podman", "rm", "-f", name], env=podman_env, capture_output=True)
    assert "Traceback" not in logs, logs[-4000:]


@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_cuda_runtime_image_carries_the_cuda_stack(podman_env: dict[str, str]) -> None:
    """What can be checked without a GPU: vLLM's CUDA build and torch's CUDA 13 libraries
    import as the image's user, read-only. Running a kernel needs a GPU and its driver."""
    tag = built("runtime-cuda", podman_env)
    probe = podman(
        podman_env, "run", "--rm", "--network", "none", *READ_ONLY, "--entrypoint", "python",
        "-e", "VLLM_LOGGING_LEVEL=ERROR", tag, "-c",
        "import os, torch, vllm, diffusers, omni_runtime; "
        "print(os.getuid(), torch.version.cuda, torch.backends.cudnn.version(), "
        "torch.cuda.is_available(), vllm.__version__)",
    )  # fmt: skip
    uid, cuda, cudnn, available, vllm_version = probe.split()[-5:]
    assert uid == "65532"
    assert cuda.startswith("13."), cuda
    assert cudnn.isdigit(), cudnn  # cuDNN loads from torch's NVIDIA wheel
    assert available == "False"  # no GPU here: what a GPU node adds is unverified
    assert vllm_version.startswith("0.32.0"), vllm_version
    # The CPU build's marker is absent: this is vLLM's CUDA wheel.
    dist = podman(
        podman_env, "run", "--rm", "--network", "none", "--entrypoint", "python", tag, "-c",
        "import importlib.metadata as m; print(m.distribution('vllm').metadata['Name'])",
    )  # fmt: skip
    assert dist.strip() == "vllm"


def test_images_script_names_what_it_builds() -> None:
    result = subprocess.run([str(IMAGES), "nonsense"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "no image 'nonsense' (operator, runtime, runtime-cuda)" in result.stderr
