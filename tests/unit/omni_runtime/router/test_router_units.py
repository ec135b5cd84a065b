"""The router's pure parts: the stage chain, replica addresses, request checks, placement."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
from PIL import Image

from omni_runtime.config import PipelineConfig
from omni_runtime.entrypoints.router_process import ReplicaAddressError, parse_replica_args
from omni_runtime.entrypoints.serve import stage_environment
from omni_runtime.router.endpoints.chat import ChatCompletionRequest
from omni_runtime.router.endpoints.images import ImageGenerationRequest
from omni_runtime.router.errors import RequestError
from omni_runtime.router.json_body import parse_body
from omni_runtime.router.limits import RouterLimits, parse_size
from omni_runtime.router.media import decode_data_url
from omni_runtime.router.messages import flatten_messages
from omni_runtime.router.orchestrator import stage_chain
from omni_runtime.router.served import Served

LIMITS = RouterLimits()
TEXT = Served("text")


def pipeline(*stages: dict[str, Any], **more: Any) -> PipelineConfig:
    return PipelineConfig.model_validate({"model": "m", "stages": list(stages), **more})


def test_stage_chain_orders_by_id_and_refuses_what_is_not_a_chain() -> None:
    chain = stage_chain(
        pipeline(
            {"stageId": 1, "type": "diffusion"},
            {"stageId": 0, "type": "llm", "output": "hidden_states"},
        )
    )
    assert [s.stage_id for s in chain] == [0, 1]
    with pytest.raises(ValueError, match="images cannot feed a later stage"):
        stage_chain(pipeline({"stageId": 0, "type": "diffusion"}, {"stageId": 1, "type": "llm"}))


def test_replica_addresses_come_from_arguments_over_the_environment() -> None:
    config = pipeline({"stageId": 0, "name": "a", "type": "llm"}, {"stageId": 1, "type": "llm"})
    environ = {"OMNI_REPLICAS_0": "h1:1,h2:2", "OMNI_REPLICAS_1": "e:3", "OMNI_REPLICAS_9": "x:1"}
    result = parse_replica_args(config, ["a=h3:3"], environ)
    assert result == {0: ["h3:3"], 1: ["e:3"]}
    with pytest.raises(ReplicaAddressError, match="not HOST:PORT"):
        parse_replica_args(config, ["0=h:99999"], {})


def test_a_stage_process_sees_only_its_own_gpus() -> None:
    config = pipeline(
        {"stageId": 0, "type": "llm", "devices": "0,1"}, {"stageId": 1, "type": "diffusion"}
    )
    base = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "PATH": "/bin"}
    assert stage_environment(config.stages[0], base)["CUDA_VISIBLE_DEVICES"] == "0,1"
    cpu = stage_environment(config.stages[1], base)
    assert cpu["CUDA_VISIBLE_DEVICES"] == ""
    assert cpu["PATH"] == "/bin"


def test_sizes_are_width_by_height_and_bounded() -> None:
    assert parse_size("96x64", LIMITS) == (64, 96)
    assert parse_size(None, LIMITS) == (None, None)
    for bad, needle in (("64", "WIDTHxHEIGHT"), ("0x5", "WIDTHxHEIGHT"), ("9999x64", "width")):
        with pytest.raises(RequestError, match=needle):
            parse_size(bad, LIMITS)


def _data_url(image: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_data_urls_decode_to_rgb_and_bad_ones_name_the_field() -> None:
    image = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    assert np.array_equal(decode_data_url(_data_url(image), LIMITS, "u"), image)
    with pytest.raises(RequestError, match=r"^u: only base64 data URLs"):
        decode_data_url("data:text/plain;base64,aGk=", LIMITS, "u")
    tiny = RouterLimits(max_input_image_bytes=10)
    with pytest.raises(RequestError, match="over 10 bytes") as info:
        decode_data_url(_data_url(image), tiny, "u")
    assert info.value.status == 413


def test_messages_flatten_to_text_and_images() -> None:
    image = np.zeros((2, 2, 3), dtype=np.uint8)
    body = parse_body(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "image_url", "image_url": {"url": _data_url(image)}},
                        {"type": "text", "text": "b"},
                    ],
                },
            ],
        },
    )
    messages, images = flatten_messages(body.messages, LIMITS, 1)
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
    ]
    assert [i.shape for i in images] == [(2, 2, 3)]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": "m", "messages": []}, "messages: List should have at least 1 item"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content: required"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": []},
            "tools: unknown field",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
            "messages[0].content",
        ),
    ],
)
def test_body_errors_name_the_field(body: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_body(ChatCompletionRequest, body)
    assert info.value.message.startswith(message), info.value.message
    assert info.value.status == 400


def test_the_router_keeps_idle_connections_longer_than_the_openai_client() -> None:
    """With equal idle timers (5 s each, uvicorn's and the openai client's defaults) a
    client may send on a pooled connection the router is closing: a connection error."""
    from fastapi import FastAPI
    from openai._constants import DEFAULT_CONNECTION_LIMITS

    from omni_runtime.entrypoints.router_process import router_server_config

    config = router_server_config(FastAPI(), "127.0.0.1", 8000)
    expiry = DEFAULT_CONNECTION_LIMITS.keepalive_expiry
    assert expiry is not None
    assert config.timeout_keep_alive > 2 * expiry


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"guidance_scale": True}, "valid number"),
        ({"guidance_scale": "1.5"}, "valid number"),
        ({"n": "2"}, "valid integer"),
        ({"n": 2.5}, "valid integer"),
        ({"seed": 1e300}, "valid integer"),
    ],
)
def test_json_numbers_are_numbers(body: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError, match=message):
        parse_body(ImageGenerationRequest, {"prompt": "x", **body})


def test_a_whole_float_is_an_integer() -> None:
    body = parse_body(ImageGenerationRequest, {"prompt": "x", "n": 2.0, "guidance_scale": 3})
    assert body.n == 2
    assert isinstance(body.n, int)
    assert body.guidance_scale == 3.0


def test_a_text_pipeline_refuses_image_fields_by_name() -> None:
    body = parse_body(
        ChatCompletionRequest,
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "height": 64},
    )
    with pytest.raises(RequestError, match="height: a parameter of image output") as caught:
        body.to_pipeline_request("id", TEXT, LIMITS)
    assert caught.value.param == "height"
