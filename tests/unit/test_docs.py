"""The documentation holds together: every relative link in README.md, manifests/README.md
and docs/ leads to a file (and a heading or anchor) that exists, and docs/http-api.md names
every path and request field of the router's OpenAPI document."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from omni_runtime.config import PipelineConfig
from omni_runtime.router.app import create_app
from omni_runtime.router.stage_replica_pool import StageReplicaPool

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "manifests" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# [text](target) outside code; images too.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`[^`\n]*`")


def _links(text: str) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", text))
    return _LINK.findall(text)


def _anchors(path: Path) -> set[str]:
    """The anchors a markdown file has: its headings as GitHub spells them, and ids."""
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', text))
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_docs_exist() -> None:
    names = {path.name for path in DOCS}
    assert {"README.md", "architecture.md", "crd-reference.md", "http-api.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in _links(doc.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}: no heading or anchor #{anchor} in {path.name}")
    assert broken == [], f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 250
    commands = [line.strip() for line in lines[:10] if line.startswith("    ")]
    assert commands[0].startswith(
        "scripts/setup.sh && .venv/bin/python examples/image_edit.py --out out"
    )
    assert commands[1].startswith("scripts/test.sh")


def _request_fields(document: dict[str, Any]) -> set[str]:
    """The top-level fields of every request body (JSON bodies and the edit form)."""
    schemas = document["components"]["schemas"]
    return {
        field
        for name, schema in schemas.items()
        if name.endswith(("Request", "Form"))
        for field in schema.get("properties", {})
    }


# A pipeline of each kind whose document says the most, its stages taking LoRA adapters
# (their paths and fields too): a text one, an image one of no family (every generic DiT
# field, and edits), Z-Image's whose DiT caches steps (one field more), and Wan's (videos).
_PIPELINES: dict[str, dict[str, Any]] = {
    "text": {"stages": [{"stageId": 0, "name": "chat", "type": "llm", "maxLoras": 1}]},
    "image": {
        "stages": [
            {"stageId": 0, "name": "encoder", "type": "llm", "output": "hidden_states"},
            {"stageId": 1, "name": "dit", "type": "diffusion", "maxLoras": 1},
        ]
    },
    "cached-image": {
        "family": "z-image",
        "stages": [{"stageId": 0}, {"stageId": 1, "stepCache": {"tiers": {"fast": {}}}}],
    },
    "video": {
        "family": "wan2.2",
        "stages": [{"stageId": 0, "name": "dit", "type": "diffusion", "maxLoras": 1}],
    },
}


def _document(kind: str) -> dict[str, Any]:
    pipeline = PipelineConfig.model_validate({"model": "m", **_PIPELINES[kind]})
    pools = {s.stage_id: StageReplicaPool(s.name, "round-robin") for s in pipeline.stages}
    document: dict[str, Any] = TestClient(create_app(pipeline, pools)).get("/openapi.json").json()
    return document


@pytest.mark.parametrize("kind", list(_PIPELINES))
def test_http_api_doc_names_every_path_and_field(kind: str) -> None:
    text = (REPO / "docs" / "http-api.md").read_text(encoding="utf-8")
    document = _document(kind)
    missing_paths = [
        f"{method.upper()} {path}"
        for path, operations in document["paths"].items()
        for method in operations
        if f"{method.upper()} {path}" not in text
    ]
    assert missing_paths == [], "docs/http-api.md does not name these paths"
    missing = sorted(f for f in _request_fields(document) if f"`{f}`" not in text)
    assert missing == [], "docs/http-api.md does not name these request fields"
    assert "GET /openapi.json" in text
