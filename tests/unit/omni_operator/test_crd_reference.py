"""docs/crd-reference.md is generated from the CRD (omni_operator.crd_reference) and current."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_operator import crd, crd_reference

REPO = Path(__file__).resolve().parents[3]
CHECKED_IN = REPO / "docs" / "crd-reference.md"
COMMAND = "python -m omni_operator.crd_reference"


@pytest.fixture(scope="module")
def reference() -> str:
    return crd_reference.render_reference(crd.build_crd())


def test_checked_in_reference_is_current(reference: str) -> None:
    assert CHECKED_IN.exists(), f"docs/crd-reference.md is missing: run {COMMAND}"
    assert CHECKED_IN.read_text(encoding="utf-8") == reference, (
        f"docs/crd-reference.md is stale: regenerate it with `{COMMAND}`"
    )


def test_check_flag_reports_a_stale_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "reference.md"
    assert crd_reference.main(["--output", str(output)]) == 0
    assert crd_reference.main(["--output", str(output), "--check"]) == 0
    output.write_text(output.read_text().replace("| `port` |", "| `porte` |"))
    assert crd_reference.main(["--output", str(output), "--check"]) == 1
    err = capsys.readouterr().err
    assert f"is stale: regenerate it with `{COMMAND}`" in err, err
    assert "-| `porte` |" in err, err
    assert crd_reference.main(["--output", str(tmp_path / "absent.md"), "--check"]) == 1


def _fields(schema: dict[str, Any], path: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Every field below ``schema``: the path of its object, its name, its schema."""
    for name, prop in schema.get("properties", {}).items():
        yield path, name, prop
        node, node_path = prop, f"{path}.{name}"
        while "properties" not in node:
            if isinstance(node.get("items"), dict):
                node, node_path = node["items"], node_path + "[]"
            elif isinstance(node.get("additionalProperties"), dict):
                node, node_path = node["additionalProperties"], node_path + ".<name>"
            else:
                break
        if "properties" in node:
            yield from _fields(node, node_path)


def test_every_field_is_documented_with_its_description(reference: str) -> None:
    root = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    sections = reference.split("\n## ")
    seen = 0
    for top in ("spec", "status"):
        for path, name, prop in _fields(root["properties"][top], top):
            (section,) = [s for s in sections if s.startswith(f"`{path}`\n")]
            row = next(
                (line for line in section.splitlines() if line.startswith(f"| `{name}`")), None
            ) or next(line for line in section.splitlines() if f"[`{name}`](#" in line)
            first_words = " ".join(prop["description"].split()[:4]).replace("<", "&lt;")
            assert first_words.replace(">", "&gt;") in row, (path, name)
            seen += 1
    assert seen > 80


def test_rules_are_given_as_their_messages(reference: str) -> None:
    assert "stage ids must be unique: … stages have stageId …" in reference
    # The 16 GPU rules, one per GPU id, are given once.
    assert reference.count("is over-subscribed") == 1
    assert "(one rule for each N of 0-15)" in reference
    assert "nvidia.com/gpu is set by the operator from the stages' devices; remove it" in reference


def test_message_templates() -> None:
    template = crd_reference._message_template
    assert template('"at most %d (got %s)".format([a, b])') == "at most … (got …)"
    assert template("'\\'' + self.name + '\\' is bad'") == "'…' is bad"
    assert template("self.name") is None
