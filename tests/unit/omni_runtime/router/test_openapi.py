"""The router's OpenAPI document and the errors Starlette itself answers, without stages:
what GET /openapi.json promises (tests/integration/test_openapi_fuzz.py checks that the
router keeps it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import schemathesis
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from omni_runtime.config import PipelineConfig
from omni_runtime.router import app as router_app
from omni_runtime.router.app import create_app
from omni_runtime.router.limits import RouterLimits
from omni_runtime.router.stage_replica_pool import StageReplicaPool

TEXT = [{"stageId": 0, "name": "chat", "type": "llm"}]
IMAGE = [
    {"stageId": 0, "name": "encoder", "type": "llm", "output": "hidden_states"},
    {"stageId": 1, "name": "dit", "type": "diffusion"},
]
# A Wan2.2 pipeline: one diffusion stage whose DiT makes videos.
VIDEO = [{"stageId": 0, "name": "dit", "type": "diffusion"}]
# A HunyuanVideo-1.5 image-to-video pipeline: its encoder, then its DiT, which makes every
# clip from an input image.
I2V = [
    {"stageId": 0, "name": "encoder", "type": "llm", "output": "hidden_states"},
    {"stageId": 1, "name": "dit", "type": "diffusion"},
]
FAMILY_OF = {id(VIDEO): "wan2.2", id(I2V): "hunyuanvideo-1.5-i2v"}
LIMITS = RouterLimits(max_prompt_chars=100, max_tokens=50, max_n=3, max_steps=7, max_image_side=640)
POST_ERRORS = {"400", "401", "404", "413", "415", "429", "500", "503", "504"}


def client(stages: list[dict[str, Any]], state_dir: Path | None = None) -> TestClient:
    family = {"family": FAMILY_OF[id(stages)]} if id(stages) in FAMILY_OF else {}
    pipeline = PipelineConfig.model_validate(
        {"model": "m", "stages": stages, "router": {"servedModelName": "tiny"}, **family}
    )
    pools = {s.stage_id: StageReplicaPool(s.name, "round-robin") for s in pipeline.stages}
    return TestClient(create_app(pipeline, pools, limits=LIMITS, state_dir=state_dir))


@pytest.fixture(params=["text", "image", "video", "image-to-video"])
def http(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    stages = {"text": TEXT, "image": IMAGE, "video": VIDEO, "image-to-video": I2V}[request.param]
    with client(stages, tmp_path) as test_client:
        yield test_client


def document(http: TestClient) -> dict[str, Any]:
    response = http.get("/openapi.json")
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


def walk(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from walk(item)


def test_every_route_is_documented_with_its_errors(http: TestClient) -> None:
    doc = document(http)
    routes = {
        (route.path, method.lower())
        for route in http.app.routes  # type: ignore[attr-defined]
        if isinstance(route, APIRoute)
        for method in route.methods
    }
    documented = {(path, method) for path, item in doc["paths"].items() for method in item}
    images = {("/v1/images/generations", "post"), ("/v1/images/edits", "post")}
    text = {("/v1/completions", "post"), ("/tokenize", "post"), ("/detokenize", "post")}
    chat = {("/v1/chat/completions", "post")}
    videos = {
        ("/v1/videos", "post"),
        ("/v1/videos", "get"),
        ("/v1/videos/{video_id}", "get"),
        ("/v1/videos/{video_id}", "delete"),
        ("/v1/videos/{video_id}/content", "get"),
    }
    # The paths of another kind of pipeline answer 400 to everything: not listed.
    if "/v1/images/generations" in doc["paths"]:
        assert documented == routes - text - videos
    elif "/v1/videos" in doc["paths"]:
        assert documented == routes - text - images - chat
    else:
        assert documented == routes - images - videos
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            if method == "post":
                assert operation["requestBody"]["required"] is True
                # A video job is queued, not run: no stage timeout answers it.
                expected = POST_ERRORS - {"504"} if path == "/v1/videos" else POST_ERRORS
                assert set(operation["responses"]) >= expected, path
            for status, response in operation["responses"].items():
                if status >= "400" and path.startswith("/v1/"):
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert set(doc["paths"]["/health"]["get"]["responses"]) == {"200", "503"}
    # The metrics' endpoint labels are the /v1 routes, and only those (the adapter paths
    # are routes where a stage takes adapters).
    adapter_paths = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
    assert {
        path for path, _ in routes if path.startswith("/v1/") and "{" not in path
    } == router_app._V1_PATHS - adapter_paths


def test_the_document_is_valid_openapi_with_json_schema_keywords_only(http: TestClient) -> None:
    doc = document(http)
    schemathesis.openapi.from_dict(doc)  # refuses what is not OpenAPI
    for name, schema in doc["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(schema)
        # pydantic writes constraints it cannot place as its own keywords (gt, le, ...),
        # which JSON Schema ignores: a bound the document would not state.
        for node in walk(schema):
            for keyword in ("gt", "ge", "lt", "le"):
                assert not (keyword in node and "type" in node), (name, node)


def test_the_request_schemas_carry_the_limits_and_the_model() -> None:
    for stages in (TEXT, IMAGE):
        with client(stages) as http:
            schemas = document(http)["components"]["schemas"]
        chat = schemas["ChatCompletionRequest"]["properties"]
        # Optional (a request without it is served by this model), and this model alone.
        assert "model" not in schemas["ChatCompletionRequest"]["required"]
        assert chat["model"]["anyOf"][0]["enum"] == ["tiny"]
        assert chat["max_tokens"]["anyOf"][0]["maximum"] == 50
        content = schemas["ChatMessage"]["properties"]["content"]["anyOf"]
        assert content[0]["maxLength"] == 100
        if stages is TEXT:
            assert chat["n"]["enum"] == [1]
            assert "height" not in chat
            assert content[1]["items"] == {"$ref": "#/components/schemas/TextPart"}
        else:
            assert chat["n"]["maximum"] == 3
            assert chat["height"]["anyOf"][0]["maximum"] == 640
            assert "modalities" in schemas["ChatCompletionRequest"]["required"]
            images = schemas["ImageGenerationRequest"]["properties"]
            assert images["num_inference_steps"]["anyOf"][0]["maximum"] == 7
            size = jsonschema.Draft202012Validator(images["size"])
            for good in ("auto", "640x640", "1x1", "64x48"):
                assert size.is_valid(good), good
            for bad in ("641x64", "0x5", "064x64", "big", "64"):
                assert not size.is_valid(bad), bad
            form = schemas["ImageEditForm"]
            assert form["properties"]["image"]["format"] == "binary"
            assert {"image", "prompt"} <= set(form["required"])


def test_an_image_to_video_document_requires_the_image_and_takes_no_size(
    tmp_path: Path,
) -> None:
    """Every clip of HunyuanVideo-1.5's i2v starts from an image and takes its size from
    it: the form requires input_reference and takes size auto alone, and there is no JSON
    body (it cannot carry the file); a text-to-video document (Wan's) keeps both."""
    with client(I2V, tmp_path / "i2v") as http:
        doc = document(http)
    form = doc["components"]["schemas"]["VideoCreateForm"]
    assert set(form["required"]) == {"input_reference", "prompt"}
    assert form["properties"]["input_reference"]["format"] == "binary"
    content = doc["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
    assert set(content) == {"multipart/form-data"}
    validator = jsonschema.Draft202012Validator(form)
    image = {"prompt": "a cat", "input_reference": "<bytes>"}
    assert validator.is_valid(image)
    assert validator.is_valid({**image, "size": "auto"})
    assert not validator.is_valid({"prompt": "a cat"})
    assert not validator.is_valid({**image, "size": "64x64"})
    json_size = doc["components"]["schemas"]["VideoCreateRequest"]["properties"]["size"]
    assert json_size["anyOf"][0]["enum"] == ["auto"]
    with client(VIDEO, tmp_path / "t2v") as http:
        doc = document(http)
    form = doc["components"]["schemas"]["VideoCreateForm"]
    assert "input_reference" not in form["required"]
    assert jsonschema.Draft202012Validator(form).is_valid({"prompt": "a cat", "size": "64x64"})
    content = doc["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
    assert set(content) == {"multipart/form-data", "application/json"}


def _png() -> bytes:
    from omni_runtime.images import encode_png

    return encode_png(np.zeros((16, 32, 3), np.uint8))


# multipart/form-data parts as httpx sends them: (None, text) is a field, not a file.
PROMPT = {"prompt": (None, "a cat")}


@pytest.mark.parametrize(
    ("request_kwargs", "param"),
    [
        # No image: a form without the file, and a JSON body (which cannot carry one).
        ({"files": PROMPT}, "input_reference"),
        ({"json": {"prompt": "a cat"}}, "input_reference"),
        # A size, which the pipeline takes from the image instead.
        ({"files": {**PROMPT, "size": (None, "64x32"), "input_reference": "png"}}, "size"),
        # Bytes that are no image.
        ({"files": {**PROMPT, "input_reference": "junk"}}, "input_reference"),
    ],
    ids=["form-without-image", "json", "size", "not-an-image"],
)
def test_an_image_to_video_job_without_its_image_or_with_a_size_is_refused(
    tmp_path: Path, request_kwargs: dict[str, Any], param: str
) -> None:
    files = request_kwargs.get("files", {})
    if "input_reference" in files:
        data = _png() if files["input_reference"] == "png" else b"not an image"
        files = {**files, "input_reference": ("a.png", data, "image/png")}
        request_kwargs = {"files": files}
    with client(I2V, tmp_path) as http:
        answer = http.post("/v1/videos", **request_kwargs)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == param, error
        assert error["code"] == 400
        # With the image, and no size or auto, the job is queued.
        image = {"input_reference": ("a.png", _png(), "image/png")}
        for size in ({}, {"size": (None, "auto")}):
            answer = http.post("/v1/videos", files={**PROMPT, **size, **image})
            assert answer.status_code == 200, answer.text
            assert answer.json()["size"] == "auto"


@pytest.mark.parametrize(
    ("method", "path", "status", "needle"),
    [
        ("get", "/nope", 404, "no such path"),
        ("get", "/v1/nope", 404, "no such path"),
        ("delete", "/v1/models", 405, "DELETE is not allowed"),
        ("get", "/v1/chat/completions", 405, "GET is not allowed"),
    ],
)
def test_starlette_errors_are_openai_shaped(
    http: TestClient, method: str, path: str, status: int, needle: str
) -> None:
    response = http.request(method, path)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"]
    assert error["code"] == status
    if status == 405:
        assert response.headers["allow"]


def test_unknown_v1_paths_share_one_metrics_label() -> None:
    with client(TEXT) as http:
        for n in range(3):
            http.get(f"/v1/made-up-{n}")
        metrics = http.get("/metrics").text
    assert 'endpoint="other",status="404"} 3.0' in metrics
    assert "made-up" not in metrics


def test_a_bug_is_an_openai_shaped_500() -> None:
    with client(TEXT) as http:

        @http.app.get("/boom")  # type: ignore[attr-defined, untyped-decorator]
        async def boom() -> None:
            raise RuntimeError("bug")

        with TestClient(http.app, raise_server_exceptions=False) as raw:
            response = raw.get("/boom")
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"


def test_a_405_lists_every_method_of_its_path(tmp_path: Path) -> None:
    """/v1/videos' GET and POST are routes of their own (one operation each): a method
    neither takes is answered with both in Allow, as one route with both methods would."""
    with client(VIDEO, tmp_path) as http:
        response = http.delete("/v1/videos")
        assert response.status_code == 405
        assert response.headers["allow"] == "GET, POST"
        assert http.put("/v1/videos/video_1").headers["allow"] == "DELETE, GET"
