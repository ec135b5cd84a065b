"""Bodies the router refuses before any stage sees them, over real HTTP: every refusal is
an OpenAI-shaped 4xx, and the same keep-alive connection serves the next request."""

from __future__ import annotations

import http.client
import json

import httpx
import pytest
from serving import pipeline_from, running_router

from omni_testkit.port_leases import lease_port

pytestmark = pytest.mark.integration

PIPELINE = pipeline_from(
    {
        "model": "m",
        "stages": [{"stageId": 0, "name": "chat", "type": "llm"}],
        "router": {"servedModelName": "tiny"},
    }
)


def deep_array(depth: int) -> bytes:
    return b'{"model": "tiny", "messages": ' + b"[" * depth + b"]" * depth + b"}"


def deep_object(depth: int) -> bytes:
    return b'{"model": "tiny", "user": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"


@pytest.mark.parametrize(
    "body",
    [deep_array(65), deep_array(1000), deep_array(200_000), deep_object(1000)],
    ids=["65", "1000", "200000", "objects-1000"],
)
def test_deep_json_is_a_400_naming_the_limit_and_the_connection_lives_on(body: bytes) -> None:
    # No replica is listening: nothing here may need a stage.
    with running_router(
        PIPELINE, {0: [f"127.0.0.1:{lease_port()}"]}, wait_for_replicas=False
    ) as router:
        host, port = router.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            for path in ("/v1/chat/completions", "/v1/images/generations"):
                conn.request("POST", path, body, {"content-type": "application/json"})
                response = conn.getresponse()
                payload = json.loads(response.read())
                assert response.status == 400, payload
                assert response.getheader("connection") != "close"
                error = payload["error"]
                assert "deeper than 64 levels" in error["message"]
                assert error["type"] == "invalid_request_error"
                assert error["code"] == 400
                socket_used = conn.sock
                # The same connection answers the next request.
                conn.request("GET", "/v1/models")
                response = conn.getresponse()
                assert json.loads(response.read())["data"][0]["id"] == "tiny"
                assert conn.sock is socket_used
        finally:
            conn.close()


def test_nesting_within_the_limit_reaches_validation() -> None:
    with (
        running_router(PIPELINE, {0: [f"127.0.0.1:{lease_port()}"]}, wait_for_replicas=False) as r,
        httpx.Client(base_url=r.url, timeout=30) as http,
    ):
        response = http.post(
            "/v1/chat/completions",
            content=deep_array(60),
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "messages[0]"
        assert "deeper" not in error["message"]
