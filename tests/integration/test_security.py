"""What the router and stage sockets admit: API keys on every endpoint (none, wrong,
right, rotated), the official openai client with ``api_key=``, and stage sockets that
refuse peers without the pipeline's CURVE key while they go on serving the router.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import zmq
from serving import pipeline_from, running_router, serving, wait_until

from omni_runtime.engine.stage.stage_core_types import StageCoreRequestType
from omni_runtime.router.auth import ApiKeys
from omni_runtime.stage_keys import StageClientKeys, generate_keys, load_client_keys
from omni_runtime.tiny_models import LLM_SUBDIR

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).parents[2] / "examples"
KEY = "sk-omni-test-1"
ROTATED = "sk-omni-test-2"

# Every path the router serves, with a request that reaches it.
ENDPOINTS: list[tuple[str, str, dict[str, object]]] = [
    ("POST", "/v1/chat/completions", {"json": {"model": "m", "messages": []}}),
    ("POST", "/v1/images/generations", {"json": {"prompt": "p"}}),
    ("POST", "/v1/images/edits", {"files": {"prompt": (None, "p")}}),
    ("GET", "/v1/models", {}),
    ("GET", "/metrics", {}),
    ("GET", "/health", {}),
    ("GET", "/livez", {}),
    ("GET", "/openapi.json", {}),
    ("GET", "/no/such/path", {}),
]
PROBES = {"/health", "/livez"}


def _statuses(url: str, headers: dict[str, str]) -> dict[str, int]:
    with httpx.Client(base_url=url, timeout=30) as client:
        return {
            path: client.request(method, path, headers=headers, **kwargs).status_code  # type: ignore[arg-type]
            for method, path, kwargs in ENDPOINTS
        }


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "api-keys"
    path.write_text(f"# the router's keys\n{KEY}\n")
    return path


@pytest.mark.parametrize("metrics_need_api_key", [False, True])
def test_every_endpoint_but_the_probes_needs_a_right_key(
    key_file: Path, metrics_need_api_key: bool
) -> None:
    pipeline = pipeline_from(
        {
            "model": "m",
            "stages": [{"stage_id": 0, "type": "llm"}],
            "router": {"metrics_need_api_key": metrics_need_api_key},
        }
    )
    open_paths = PROBES if metrics_need_api_key else PROBES | {"/metrics"}
    keys = ApiKeys(file=key_file)
    with running_router(pipeline, {}, wait_for_replicas=False, api_keys=keys) as router:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            got = _statuses(router.url, headers)
            assert {p for p, status in got.items() if status != 401} == open_paths, headers
        right = _statuses(router.url, {"Authorization": f"Bearer {KEY}"})
        assert 401 not in right.values(), right
        # The document says so: a bearer scheme on every path but the open ones.
        document = httpx.get(
            f"{router.url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}
        ).json()
        assert document["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
        for path, operations in document["paths"].items():
            for operation in operations.values():
                assert ("security" in operation) is (path not in open_paths), path

        refused = httpx.get(f"{router.url}/v1/models", headers={"Authorization": "Bearer no"})
        assert refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["error"]["type"] == "invalid_request_error"
        assert KEY not in refused.text


def test_a_rotated_key_file_refuses_the_old_key_within_its_recheck(key_file: Path) -> None:
    pipeline = pipeline_from({"model": "m", "stages": [{"stage_id": 0, "type": "llm"}]})
    keys = ApiKeys(file=key_file, recheck_interval=0.5)
    with running_router(pipeline, {}, wait_for_replicas=False, api_keys=keys) as router:

        def status(key: str) -> int:
            headers = {"Authorization": f"Bearer {key}"}
            return httpx.get(f"{router.url}/v1/models", headers=headers).status_code

        assert (status(KEY), status(ROTATED)) == (200, 401)
        # As the kubelet rotates a Secret: the file is replaced whole.
        staged = key_file.with_suffix(".new")
        staged.write_text(f"{ROTATED}\n")
        staged.replace(key_file)
        wait_until(lambda: status(KEY) == 401, 5, "the old key refused")
        assert status(ROTATED) == 200
        # A file emptied mid-rotation keeps the keys last read: it neither opens the
        # router nor locks everyone out.
        emptied = time.monotonic()
        key_file.write_text("")
        wait_until(
            lambda: status(ROTATED) == 200 and keys.checked_at > emptied, 5, "the file re-read"
        )
        assert status(KEY) == 401
        assert status("x") == 401


def test_serve_refuses_an_unusable_key_file_at_start(tmp_path: Path) -> None:
    from omni_runtime.entrypoints.cli import main

    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    config = EXAMPLES / "tiny-chat.yaml"
    assert main(["serve", "-f", str(config), "--api-key-file", str(empty)]) == 1
    assert main(["serve", "-f", str(config), "--api-key-file", str(tmp_path / "none")]) == 1


@pytest.fixture(scope="module")
def served_chat(
    tiny_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    """``serve`` of the tiny chat pipeline with an API key: its URL and its log."""
    workdir = tmp_path_factory.mktemp("security")
    key_file = workdir / "api-keys"
    key_file.write_text(f"{KEY}\n")
    env = {"OMNI_TINY_MODELS": str(tiny_models)}
    assert (tiny_models / LLM_SUBDIR).is_dir()
    with serving(
        EXAMPLES / "tiny-chat.yaml", workdir, args=["--api-key-file", str(key_file)], env=env
    ) as url:
        yield url, workdir / "serve.log"


def test_the_openai_client_is_served_with_the_key_and_refused_without(
    served_chat: tuple[str, Path],
) -> None:
    url, _ = served_chat
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    wrong = openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_peers_without_the_pipelines_stage_key_get_nothing_and_the_stage_serves_on(
    served_chat: tuple[str, Path],
) -> None:
    url, log = served_chat
    port = int(re.findall(r"ready on 127\.0\.0\.1:(\d+)", log.read_text())[0])
    foreign_dir = generate_keys(Path(tempfile.mkdtemp()) / "keys")
    foreign = load_client_keys(foreign_dir)
    context = zmq.Context()
    try:
        for keys in (None, foreign):
            peer = context.socket(zmq.DEALER)
            peer.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                # Another pipeline's client pair; the server key would have to be known too,
                # and still the stage refuses a client key it does not admit.
                StageClientKeys(keys.public, keys.secret, keys.server_public).secure(peer)
            peer.connect(f"tcp://127.0.0.1:{port}")
            peer.send_multipart([StageCoreRequestType.HEALTH.value])
            # A stage answers HEALTH at once; silence for a second is the refusal.
            assert peer.poll(1000) == 0
            peer.close()
    finally:
        context.term()
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "still there?"}], max_tokens=4
    )
    assert reply.choices[0].message.content is not None
