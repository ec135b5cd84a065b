"""Each model family's own request fields (``Family.request_fields``): a deployment's bodies
and its OpenAPI document take its family's and refuse another's by name, and the values
reach the DiT among the diffusion params; a pipeline of no family takes what its DiT
takes, as before families declared their fields (strength, an edit's, among them)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from pydantic import BaseModel

from omni_runtime.config import PipelineConfig
from omni_runtime.diffusion.params import DiffusionParams, diffusers_params
from omni_runtime.engine.stage.stage_core_types import StageServerOutput
from omni_runtime.families import FAMILIES, Family, familyless_request_fields
from omni_runtime.families.base import RequestField
from omni_runtime.router.app import create_app
from omni_runtime.router.endpoints.bodies import request_models
from omni_runtime.router.endpoints.chat import ChatCompletionRequest
from omni_runtime.router.endpoints.completions import CompletionRequest
from omni_runtime.router.endpoints.images import (
    ImageEditRequest,
    ImageGenerationRequest,
    edit_form,
)
from omni_runtime.router.errors import RequestError
from omni_runtime.router.json_body import parse_body
from omni_runtime.router.limits import RouterLimits
from omni_runtime.router.request_fields import STEP_CACHE_FIELD, STRENGTH
from omni_runtime.router.served import Served
from omni_runtime.router.stage_replica_pool import StageReplicaPool
from omni_runtime.router.stage_requests import PipelineRequest

REPO = Path(__file__).resolve().parents[4]
LIMITS = RouterLimits()
IMAGES = Served("image", takes_image=True)
TEXT = Served("text")
# None: a pipeline of no family (an LLM, then a diffusers pipeline such as Stable Diffusion).
# The image families: a video family's requests are the Videos API's (test_video_jobs.py).
# The families that make images (a video family's DiT makes jobs, a speaking one's speech).
KINDS: list[str | None] = [
    name for name, f in FAMILIES.items() if f.dit.video is None and f.speech is None
] + [None]
# Every family's fields, by name: what some deployment takes.
ALL_FIELDS = {field.name for family in FAMILIES.values() for field in family.request_fields}
# A valid value of each (within every family's bounds) and, by JSON, how it arrives.
GOOD = {
    "true_cfg_scale": 2.5,
    "cfg_normalization": True,
    "cfg_truncation": 0.5,
    "cfg_text_scale": 3.0,
    "cfg_img_scale": 1.5,
    "cfg_interval": [0.2, 0.9],
    "cfg_renorm_type": "channel",
    "cfg_renorm_min": 0.1,
    "timestep_shift": 2.0,
}
IMAGE = [
    {"stageId": 0, "name": "encoder", "type": "llm", "output": "hidden_states"},
    {"stageId": 1, "name": "dit", "type": "diffusion"},
]


def fields_of(kind: str | None) -> set[str]:
    family = FAMILIES[kind] if kind is not None else None
    return {field.name for field in request_models(family).fields}


def pipeline_of(kind: str | None) -> PipelineConfig:
    if kind is None:
        data: dict[str, Any] = {"model": "m", "stages": IMAGE}
    else:
        # The family's topology fills in the stages' types.
        data = {"model": "m", "family": kind, "stages": [{"stageId": 0}, {"stageId": 1}]}
    pipeline = PipelineConfig.model_validate({**data, "router": {"servedModelName": "tiny"}})
    assert pipeline.family_recipe is (FAMILIES[kind] if kind is not None else None)
    return pipeline


@pytest.fixture(params=KINDS, ids=lambda kind: kind or "no-family")
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str | None, TestClient]]:
    """A router of an image pipeline of each family (and of none), with no replicas: a
    body is parsed (and refused) before any stage is asked."""
    pipeline = pipeline_of(request.param)
    pools = {s.stage_id: StageReplicaPool(s.name, "round-robin") for s in pipeline.stages}
    with TestClient(create_app(pipeline, pools, limits=LIMITS)) as http:
        yield request.param, http


def png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_every_value_here_is_one_a_family_takes() -> None:
    assert set(GOOD) == ALL_FIELDS


def test_the_document_lists_the_familys_fields_and_no_other(
    served: tuple[str | None, TestClient],
) -> None:
    kind, http = served
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    own = fields_of(kind)
    assert own, kind
    for name in ("ChatCompletionRequest", "ImageGenerationRequest", "ImageEditRequest"):
        properties = set(schemas[name]["properties"])
        assert own <= properties, name
        assert not (ALL_FIELDS - own) & properties, name
        for field in own:
            assert schemas[name]["properties"][field]["description"], (name, field)
    # An edit's strength: only a pipeline of no family has an image-to-image variant.
    for name in ("ChatCompletionRequest", "ImageEditRequest"):
        assert ("strength" in schemas[name]["properties"]) == (kind is None), name
    assert "strength" not in schemas["ImageGenerationRequest"]["properties"]
    paths = http.get("/openapi.json").json()["paths"]
    takes_image = kind is None or FAMILIES[kind].dit.takes_image
    assert ("/v1/images/edits" in paths) == takes_image
    if takes_image:
        form = set(schemas["ImageEditForm"]["properties"])
        pairs = {"cfg_interval"} if kind == "bagel" else set()
        assert form & ALL_FIELDS == own - pairs
        # A list of images where the family takes several, as many as it takes.
        most = 1 if kind is None else FAMILIES[kind].max_input_images
        listed = schemas["ImageEditForm"]["properties"].get("image[]")
        assert (listed["maxItems"] if listed else 1) == most
    else:
        # The family's DiT takes no input image: a message's parts are text alone.
        parts = schemas["ChatMessage"]["properties"]["content"]["anyOf"][1]["items"]
        assert parts == {"$ref": "#/components/schemas/TextPart"}


def test_the_documents_bounds_are_the_declarations() -> None:
    bagel = request_models(FAMILIES["bagel"]).images.model_json_schema()["properties"]
    assert bagel["timestep_shift"]["anyOf"][0] == {
        "type": "number",
        "exclusiveMinimum": 0,
        "maximum": 100,
    }
    assert bagel["cfg_renorm_type"]["anyOf"][0]["enum"] == ["global", "channel", "text_channel"]
    interval = bagel["cfg_interval"]["anyOf"][0]
    assert (interval["type"], interval["minItems"], interval["maxItems"]) == ("array", 2, 2)
    assert all(item["minimum"] == 0 and item["maximum"] == 1 for item in interval["prefixItems"])
    z_image = request_models(FAMILIES["z-image"]).chat.model_json_schema()["properties"]
    assert z_image["cfg_normalization"]["anyOf"][0] == {"type": "boolean"}
    assert z_image["cfg_truncation"]["anyOf"][0] == {"type": "number", "minimum": 0, "maximum": 1}


def test_another_familys_field_is_a_400_naming_it(served: tuple[str | None, TestClient]) -> None:
    kind, http = served
    foreign = sorted(ALL_FIELDS - fields_of(kind))
    assert foreign, kind
    chat = {"modalities": ["image"], "messages": [{"role": "user", "content": "a cat"}]}
    for name in foreign:
        takers = [
            f.name for f in FAMILIES.values() if any(r.name == name for r in f.request_fields)
        ]
        for response in (
            http.post("/v1/chat/completions", json={**chat, name: GOOD[name]}),
            http.post("/v1/images/generations", json={"prompt": "a cat", name: GOOD[name]}),
            http.post(
                "/v1/images/edits",
                data={"prompt": "a cat", name: str(GOOD[name]).lower()},
                files={"image": ("a.png", png(), "image/png")},
            ),
        ):
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert error["param"] == name
            assert error["message"].startswith(f"{name}: unknown parameter for this pipeline")
            assert all(taker in error["message"] for taker in takers), error["message"]


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_a_familys_pipeline_refuses_an_edits_strength(kind: str) -> None:
    models = request_models(FAMILIES[kind])
    with pytest.raises(RequestError) as info:
        parse_body(models.chat, {"messages": [{"role": "user", "content": "x"}], "strength": 0.5})
    assert info.value.param == "strength"
    assert "unknown parameter for this pipeline (family-less pipelines take it)" in str(info.value)


def test_a_pipeline_of_no_family_takes_strength_as_before() -> None:
    """With an input image or without (the DiT then runs text-to-image and leaves it out)."""
    chat = request_models(None).chat
    image = io.BytesIO()
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(image, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(image.getvalue()).decode()
    parts = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]
    for content in (parts, "x"):
        body = parse_body(
            chat,
            {
                "modalities": ["image"],
                "messages": [{"role": "user", "content": content}],
                "strength": 0.5,
            },
        )
        assert body.to_pipeline_request("e", IMAGES, LIMITS).diffusion_params["strength"] == 0.5


@pytest.mark.parametrize(
    ("model", "field"),
    [
        # Of no pipeline at all.
        (request_models(FAMILIES["bagel"]).images, "quality"),
        # Only bodies that make images take a family's fields.
        (CompletionRequest, "cfg_text_scale"),
        # Generations take no input image, in no pipeline: nor an edit's strength.
        (request_models(None).images, "strength"),
    ],
)
def test_a_field_no_pipeline_takes_here_is_not_part_of_this_api(
    model: type[BaseModel], field: str
) -> None:
    body = {"prompt": "x", field: 1}
    with pytest.raises(RequestError) as info:
        parse_body(model, body)
    assert info.value.message == f"{field}: unknown field (not part of this API)"
    assert info.value.param == field


def test_the_familys_own_fields_are_checked_by_their_declarations() -> None:
    bagel = request_models(FAMILIES["bagel"]).images
    for body, param, needle in (
        ({"cfg_interval": [0.2]}, "cfg_interval[1]", "required"),
        ({"cfg_interval": [0.2, 1.5]}, "cfg_interval[1]", "less than or equal to 1"),
        ({"cfg_renorm_type": "local"}, "cfg_renorm_type", "'global', 'channel'"),
        ({"timestep_shift": 0}, "timestep_shift", "greater than 0"),
        ({"cfg_text_scale": True}, "cfg_text_scale", "valid number"),
    ):
        with pytest.raises(RequestError) as info:
            parse_body(bagel, {"prompt": "x", **body})
        assert info.value.param == param, info.value.message
        assert needle in info.value.message, info.value.message
    with pytest.raises(RequestError, match="cfg_normalization: Input should be a valid boolean"):
        parse_body(
            request_models(FAMILIES["z-image"]).images, {"prompt": "x", "cfg_normalization": 1}
        )


@pytest.mark.parametrize("kind", ["bagel", "z-image", "qwen-image"])
def test_the_familys_fields_reach_the_diffusion_params(kind: str) -> None:
    models = request_models(FAMILIES[kind])
    given = {name: GOOD[name] for name in fields_of(kind)}
    # JSON's pair is the DiT's tuple, as before families declared their fields.
    expected = {name: tuple(v) if isinstance(v, list) else v for name, v in given.items()}
    generation = parse_body(models.images, {"prompt": "a cat", "seed": 3, **given})
    params = generation.to_pipeline_request("g", LIMITS).diffusion_params
    assert params == {**expected, "seed": 3, "num_images": 1}
    chat = parse_body(
        models.chat,
        {"modalities": ["image"], "messages": [{"role": "user", "content": "a cat"}], **given},
    )
    assert chat.to_pipeline_request("c", IMAGES, LIMITS).diffusion_params == {
        **expected,
        "num_images": 1,
    }


def edit_form_body(form_fields: dict[str, str], images: int = 1) -> bytes:
    body = b"".join(
        b'--b\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s\r\n'
        % (name.encode(), value.encode())
        for name, value in form_fields.items()
    )
    for _ in range(images):
        body += b'--b\r\nContent-Disposition: form-data; name="image[]"; filename="a.png"\r\n\r\n'
        body += png() + b"\r\n"
    return body + b"--b--\r\n"


def test_an_edit_forms_family_fields_are_parsed_from_their_text() -> None:
    form_fields = {"prompt": "x", "timestep_shift": "3.5", "cfg_renorm_type": "channel"}
    form = edit_form(
        "multipart/form-data; boundary=b", LIMITS, request_models(FAMILIES["bagel"]).edits
    )
    form.feed(edit_form_body(form_fields))
    request, images = form.finish()
    params = request.to_pipeline_request("e", LIMITS, images).diffusion_params
    assert params == {"timestep_shift": 3.5, "cfg_renorm_type": "channel", "num_images": 1}


@pytest.mark.parametrize(
    ("family", "images", "error"),
    [
        ("z-image", 1, "image: this pipeline takes no input image"),
        ("bagel", 2, "image: at most one input image per request"),
        ("qwen-image-edit-plus", 3, None),
        ("qwen-image-edit-plus", 4, "image: at most 3 input images per request"),
    ],
)
def test_an_edit_form_takes_as_many_images_as_its_family(
    family: str, images: int, error: str | None
) -> None:
    form = edit_form(
        "multipart/form-data; boundary=b", LIMITS, request_models(FAMILIES[family]).edits
    )
    body = edit_form_body({"prompt": "x"}, images)
    if error is not None:
        with pytest.raises(RequestError, match=error) as refused:
            form.feed(body)
        assert refused.value.param == "image"
        return
    form.feed(body)
    request, parts = form.finish()
    assert len(request.to_pipeline_request("e", LIMITS, parts).images) == images


def test_an_edit_form_spells_its_images_one_way() -> None:
    form = edit_form(
        "multipart/form-data; boundary=b",
        LIMITS,
        request_models(FAMILIES["qwen-image-edit-plus"]).edits,
    )
    body = edit_form_body({"prompt": "x"}, 1).replace(b'name="image[]"', b'name="image"')
    body = body.removesuffix(b"--b--\r\n") + edit_form_body({}, 1)
    with pytest.raises(RequestError, match="image or a list as image\\[\\], not both"):
        form.feed(body)


@pytest.mark.parametrize(("family", "most"), [("qwen-image-edit", 1), ("qwen-image-edit-plus", 3)])
def test_a_chat_completion_takes_as_many_images_as_its_family(family: str, most: int) -> None:
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    part = {"type": "image_url", "image_url": {"url": url}}

    def chat(count: int) -> Any:
        content = [*[part] * count, {"type": "text", "text": "x"}]
        return parse_body(
            request_models(FAMILIES[family]).chat,
            {"messages": [{"role": "user", "content": content}], "modalities": ["image"]},
        )

    assert len(chat(most).to_pipeline_request("c", IMAGES, LIMITS).images) == most
    with pytest.raises(RequestError, match=f"messages: at most .* \\(got {most + 1}\\)"):
        chat(most + 1).to_pipeline_request("c", IMAGES, LIMITS)


def test_served_bodies_reach_the_pipeline_with_the_familys_fields(
    served: tuple[str | None, TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    kind, http = served
    ran: list[PipelineRequest] = []

    async def complete(request: PipelineRequest) -> list[StageServerOutput]:
        ran.append(request)
        images = np.zeros((1, 8, 8, 3), np.uint8)
        return [StageServerOutput(request_id=request.request_id, finished=True, images=images)]

    monkeypatch.setattr(http.app.state.router.orchestrator, "complete", complete)  # type: ignore[attr-defined]
    given = {name: GOOD[name] for name in fields_of(kind)}
    if kind is not None and FAMILIES[kind].dit.requires_image:
        # An edit pipeline makes nothing from text alone: refused before any stage runs.
        refused = http.post("/v1/images/generations", json={"prompt": "a cat", **given})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "image"
        assert "/v1/images/edits" in refused.json()["error"]["message"]
        form = {
            name: value if isinstance(value, str) else json.dumps(value)
            for name, value in given.items()
        }
        files = {"image": ("a.png", png(), "image/png")}
        response = http.post("/v1/images/edits", data={"prompt": "a cat", **form}, files=files)
    else:
        response = http.post("/v1/images/generations", json={"prompt": "a cat", **given})
    assert response.status_code == 200, response.text
    (request,) = ran
    assert set(request.diffusion_params) == {*given, "num_images"}


@pytest.mark.parametrize("family", ["qwen-image-edit", "qwen-image-edit-plus"])
def test_an_edit_pipelines_chat_without_an_image_is_refused(family: str) -> None:
    body = parse_body(
        request_models(FAMILIES[family]).chat,
        {"messages": [{"role": "user", "content": "a cat"}], "modalities": ["image"]},
    )
    with pytest.raises(RequestError, match="messages: this pipeline edits an input image"):
        body.to_pipeline_request("c", IMAGES, LIMITS)


def test_a_common_field_the_familys_dit_lacks_is_refused_and_undocumented() -> None:
    bodies = request_models(FAMILIES["bagel"])
    images = parse_body(bodies.images, {"prompt": "a cat", "negative_prompt": "dark"})
    with pytest.raises(RequestError, match="negative_prompt: unknown parameter") as refused:
        images.to_pipeline_request("g", LIMITS)
    assert refused.value.param == "negative_prompt"
    chat = parse_body(
        bodies.chat,
        {
            "messages": [{"role": "user", "content": "a cat"}],
            "modalities": ["image"],
            "negative_prompt": "dark",
        },
    )
    with pytest.raises(RequestError, match="negative_prompt: unknown parameter"):
        chat.to_pipeline_request("c", IMAGES, LIMITS)
    pipeline = pipeline_of("bagel")
    pools = {s.stage_id: StageReplicaPool(s.name, "round-robin") for s in pipeline.stages}
    document = TestClient(create_app(pipeline, pools, limits=LIMITS)).get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    for name in ("ChatCompletionRequest", "ImageGenerationRequest", "ImageEditForm"):
        assert "negative_prompt" not in schemas[name]["properties"], name


def test_a_pipeline_of_no_family_takes_what_its_diffusers_dit_takes() -> None:
    """The generic diffusers fields (the family-less DiT's parameters beyond the common
    ones: each handed to the loaded pipeline if its __call__ takes it) and no more, as
    before. Both sides derive them from the families' declarations."""
    common = {
        "height",
        "width",
        "num_inference_steps",
        "guidance_scale",
        "seed",
        "negative_prompt",
        "num_images",
    }
    generic = {f.name for f in familyless_request_fields()}
    # step_cache: only where the DiT stage declares tiers (the next test); partial_images:
    # a stream's, which every image body takes; a video's frames and progress: the Videos
    # API's.
    videos = {"num_frames", "report_progress"}
    taken = generic | {STRENGTH.name, STEP_CACHE_FIELD, "partial_images"} | videos
    assert taken == set(diffusers_params(None).__struct_fields__) - common
    assert generic == set(diffusers_params(None).__struct_fields__) - set(
        DiffusionParams.__struct_fields__
    )
    shared = request_models(None)
    assert set(shared.images.model_fields) - set(ImageGenerationRequest.model_fields) == generic
    assert set(shared.edits.model_fields) - set(ImageEditRequest.model_fields) == {
        *generic,
        "strength",
    }
    assert set(shared.chat.model_fields) - set(ChatCompletionRequest.model_fields) == {
        *generic,
        "strength",
    }


def test_a_text_pipeline_refuses_the_image_fields_it_knows_by_name() -> None:
    chat = request_models(None).chat
    body = parse_body(chat, {"messages": [{"role": "user", "content": "x"}], "true_cfg_scale": 2.0})
    with pytest.raises(RequestError, match="true_cfg_scale: a parameter of image output"):
        body.to_pipeline_request("t", TEXT, LIMITS)
    assert {"height", "strength", "true_cfg_scale", "cfg_truncation"} <= set(
        chat.image_only_fields()
    )


def test_models_are_built_once_per_set_of_fields_and_image_count() -> None:
    qwen = request_models(FAMILIES["qwen-image-edit"])
    assert qwen is request_models(FAMILIES["qwen-image-edit"])
    # The same fields, another count of input images: bodies of their own.
    assert qwen is not request_models(FAMILIES["qwen-image"])
    assert qwen.edits.max_input_images == 1
    assert request_models(FAMILIES["qwen-image-edit-plus"]).edits.max_input_images == 3
    assert qwen.chat is not ChatCompletionRequest
    assert issubclass(qwen.chat, ChatCompletionRequest)
    assert qwen.chat.__name__ == "ChatCompletionRequest"
    assert request_models(FAMILIES["bagel"]) is request_models(FAMILIES["bagel"])


def test_a_family_field_may_not_replace_a_common_one() -> None:
    clash = RequestField(name="seed", kind="integer", description="A seed of its own.")
    family: Family = dataclasses.replace(FAMILIES["z-image"], request_fields=(clash,))
    with pytest.raises(ValueError, match="seed: ChatCompletionRequest has it already"):
        request_models(family)


@pytest.mark.parametrize(
    ("field", "needle"),
    [
        ({"name": "x", "kind": "enum"}, "values are for an enum"),
        ({"name": "x", "kind": "number", "values": ("a",)}, "values are for an enum"),
        ({"name": "x", "kind": "boolean", "ge": 0}, "a boolean has no bounds"),
        ({"name": "not a name", "kind": "boolean"}, "not a field name"),
        ({"name": "_private", "kind": "boolean"}, "not a field name"),
    ],
)
def test_a_declaration_that_cannot_be_a_field_is_refused(
    field: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        RequestField(description="d", **field)


def test_http_api_doc_names_every_familys_fields() -> None:
    """tests/unit/test_docs.py checks a pipeline of no family's document; each family's
    fields are named too."""
    text = (REPO / "docs" / "http-api.md").read_text(encoding="utf-8")
    assert sorted(name for name in ALL_FIELDS if f"`{name}`" not in text) == []


def test_step_cache_is_a_field_of_pipelines_whose_dit_has_tiers() -> None:
    cached = request_models(FAMILIES["qwen-image"], ("off", "fast"))
    generation = parse_body(cached.images, {"prompt": "a cat", "step_cache": "fast"})
    params = generation.to_pipeline_request("g", LIMITS).diffusion_params
    assert params == {"step_cache": "fast", "num_images": 1}
    with pytest.raises(RequestError, match="step_cache: Input should be 'off' or 'fast'"):
        parse_body(cached.images, {"prompt": "a cat", "step_cache": "faster"})
    plain = request_models(FAMILIES["qwen-image"])
    assert STEP_CACHE_FIELD not in plain.images.model_fields
    with pytest.raises(RequestError, match="its diffusion stage has no stepCache"):
        parse_body(plain.images, {"prompt": "a cat", "step_cache": "fast"})
