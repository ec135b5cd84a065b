"""Each kind of pipeline answers each endpoint as it serves it (router.served): the paths
that serve it take the request; every other one is a 400 that says what the pipeline
makes and where to ask for it (a video pipeline's chat and images requests point to
/v1/videos). Routers without replicas: a request is refused, or not, before any stage."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from omni_runtime.config import PipelineConfig
from omni_runtime.router.app import create_app
from omni_runtime.router.stage_replica_pool import StageReplicaPool

ENCODER_DIT = [
    {"stageId": 0, "name": "encoder", "type": "llm", "output": "hidden_states"},
    {"stageId": 1, "name": "dit", "type": "diffusion"},
]
PIPELINES: dict[str, dict[str, Any]] = {
    "text": {"stages": [{"stageId": 0, "name": "chat", "type": "llm"}]},
    # Of no family: text to image, and edits (its diffusers pipeline's image-to-image).
    "image": {"stages": ENCODER_DIT},
    "edit-only": {"family": "qwen-image-edit", "stages": [{"stageId": 0}, {"stageId": 1}]},
    "video": {"family": "wan2.2", "stages": [{"stageId": 0, "name": "dit", "type": "diffusion"}]},
    "speech": {"family": "qwen3-omni", "stages": [{"stageId": 0}, {"stageId": 1}, {"stageId": 2}]},
}
# What each pipeline's refusals say it does, and where they send the caller.
SAYS = {
    "text": ("answers with text", ["/v1/chat/completions", "/v1/completions"]),
    "image": ("makes images", ["/v1/images/generations", "/v1/images/edits"]),
    "edit-only": ("edits an input image", ["/v1/images/edits"]),
    "video": ("makes videos", ["POST /v1/videos"]),
    "speech": ("answers with text, spoken too", ["/v1/chat/completions"]),
}
SERVES = {
    "text": {"chat", "completions"},
    "image": {"chat", "generations", "edits"},
    "edit-only": {"chat", "edits"},
    "video": {"videos"},
    "speech": {"chat"},
}
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generations": "/v1/images/generations",
    "edits": "/v1/images/edits",
    "videos": "/v1/videos",
}


def png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def request_of(kind: str, endpoint: str) -> dict[str, Any]:
    """A request that the endpoint takes from a pipeline it serves: a chat completion asks
    for images where the pipeline makes them (with the image an edit pipeline edits)."""
    if endpoint == "chat":
        content: Any = "a cat"
        if kind == "edit-only":
            url = "data:image/png;base64," + base64.b64encode(png()).decode()
            content = [
                {"type": "text", "text": "a cat"},
                {"type": "image_url", "image_url": {"url": url}},
            ]
        body: dict[str, Any] = {"messages": [{"role": "user", "content": content}]}
        if kind in ("image", "edit-only", "video"):
            body["modalities"] = ["image"]
        return {"json": body}
    if endpoint == "edits":
        return {"data": {"prompt": "a cat"}, "files": {"image": ("a.png", png(), "image/png")}}
    return {"json": {"prompt": "a cat"}}


@pytest.fixture(params=list(PIPELINES))
def router(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, TestClient]]:
    pipeline = PipelineConfig.model_validate({"model": "m", **PIPELINES[request.param]})
    pools = {s.stage_id: StageReplicaPool(s.name, "round-robin") for s in pipeline.stages}
    with TestClient(create_app(pipeline, pools, state_dir=tmp_path)) as http:
        yield request.param, http


@pytest.mark.parametrize("endpoint", list(PATHS))
def test_each_pipeline_serves_its_endpoints_and_points_elsewhere_from_the_others(
    router: tuple[str, TestClient], endpoint: str
) -> None:
    kind, http = router
    answer = http.post(PATHS[endpoint], **request_of(kind, endpoint))
    message = (answer.json().get("error") or {}).get("message", "")
    if endpoint in SERVES[kind]:
        # Taken: queued (a video job), or on to the stages, of which there is no replica.
        assert answer.status_code in (200, 503), answer.text
        assert "does not serve" not in message
        return
    assert answer.status_code == 400, answer.text
    makes, where = SAYS[kind]
    assert message.startswith(f"{PATHS[endpoint]} does not serve this pipeline: it {makes}")
    for path in where:
        assert path in message, message
    # No pointer to what the pipeline does not serve.
    for other, path in PATHS.items():
        if other not in SERVES[kind] and other != endpoint:
            assert path not in message, message


def test_the_document_lists_the_paths_that_serve_the_pipeline(
    router: tuple[str, TestClient],
) -> None:
    kind, http = router
    paths = http.get("/openapi.json").json()["paths"]
    assert {name for name, path in PATHS.items() if path in paths} == SERVES[kind]
