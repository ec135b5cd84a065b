"""scripts/images.sh's REGISTRY and PUSH options, run against a stand-in podman that records
what it is asked (no image is built, nothing leaves the machine)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "scripts" / "images.sh"

STUB_PODMAN = """#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
if [[ "$1 $2" == "image inspect" && "$*" == *"{{.Id}}"* ]]; then echo sha256:0123; fi
exit 0
"""


def run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "podman").write_text(STUB_PODMAN)
    (stubs / "mmdebstrap").write_text("#!/usr/bin/env bash\nexit 0\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    log = tmp_path / "podman.log"
    log.unlink(missing_ok=True)
    result = subprocess.run(
        [str(IMAGES), "operator", "runtime"],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **{k: v for k, v in os.environ.items() if k not in ("REGISTRY", "PUSH")},
            "PATH": f"{stubs}:{os.environ['PATH']}",
            "OMNI_CACHE_DIR": str(tmp_path / "cache"),
            "STUB_LOG": str(log),
            **env,
        },
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return result, [call for call in calls if not call.startswith("image inspect")]


def test_default_names_are_unchanged(tmp_path: Path) -> None:
    result, calls = run(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "operator omni-operator/omni-operator:0.1.0",
        "runtime omni-operator/omni-runtime:0.1.0",
    ]
    assert not [c for c in calls if c.startswith(("tag ", "push "))]


@pytest.mark.parametrize("push", [False, True])
def test_registry_tags_and_pushes(tmp_path: Path, push: bool) -> None:
    env = {"REGISTRY": "registry.example.com:5000/team/"}
    if push:
        env["PUSH"] = "1"
    result, calls = run(tmp_path, **env)
    assert result.returncode == 0, result.stderr
    remote = "registry.example.com:5000/team"
    assert result.stdout.splitlines() == [
        f"operator {remote}/omni-operator:0.1.0",
        f"runtime {remote}/omni-runtime:0.1.0",
    ]
    assert f"tag omni-operator/omni-operator:0.1.0 {remote}/omni-operator:0.1.0" in calls
    assert f"tag omni-operator/omni-runtime:0.1.0 {remote}/omni-runtime:0.1.0" in calls
    pushed = [c for c in calls if c.startswith("push ")]
    expected = [f"push {remote}/omni-operator:0.1.0", f"push {remote}/omni-runtime:0.1.0"]
    assert pushed == (expected if push else [])


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PUSH": "1"}, "PUSH needs REGISTRY"),
        ({"REGISTRY": "two words"}, "REGISTRY must be a registry host and path"),
    ],
)
def test_bad_options_are_refused(tmp_path: Path, env: dict[str, str], message: str) -> None:
    result, calls = run(tmp_path, **env)
    assert result.returncode == 2
    assert message in result.stderr
    assert calls == []
