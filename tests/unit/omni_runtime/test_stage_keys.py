"""Stage keys: CURVE on a real StageServer and real RemoteStageClients over loopback TCP.

A router with the pipeline's keys is served; one with another pipeline's keys, one with
none, and a raw socket are refused at the handshake, and the stage goes on serving the
right one. The stage's frontend here answers every request at once (the server and its
sockets are what is tested; tests/integration/test_stage_security.py runs real stages).
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from omni_runtime.config import PipelineConfig
from omni_runtime.config.credentials import CLIENT_FILES, KEY_FILES, SERVER_FILES
from omni_runtime.engine.stage.stage_core_client import StageCoreDeadError
from omni_runtime.engine.stage.stage_core_types import (
    StageCoreRequestType,
    StageServerOutput,
    StageServerRequest,
)
from omni_runtime.router.remote_stage_client import RemoteStageClient
from omni_runtime.stage_keys import (
    StageClientKeys,
    StageKeysError,
    generate_keys,
    load_client_keys,
    load_server_keys,
)
from omni_runtime.stage_server.frontend import StageFrontend
from omni_runtime.stage_server.server import StageServer


def test_generated_keys_are_owner_only_and_load_per_role(tmp_path: Path) -> None:
    directory = generate_keys(tmp_path / "keys")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for name in KEY_FILES:
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600
    server = load_server_keys(directory)
    client = load_client_keys(directory)
    assert server.client_public == client.public
    assert client.server_public == server.public
    # No key in a repr (a log line of either would otherwise carry the secret).
    assert server.secret.decode() not in repr(server)
    assert client.secret.decode() not in repr(client)


def test_each_role_reads_only_its_files(tmp_path: Path) -> None:
    full = generate_keys(tmp_path / "full")
    for role_files, load in ((SERVER_FILES, load_server_keys), (CLIENT_FILES, load_client_keys)):
        only = tmp_path / f"only-{load.__name__}"
        only.mkdir()
        for name in role_files:
            (only / name).write_bytes((full / name).read_bytes())
        load(only)  # the other role's secret is not needed


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "server.key").unlink(), r"cannot read .*server\.key"),
        (lambda d: (d / "client.pub").write_text("short"), r"client\.pub is not a CURVE key"),
        (
            lambda d: (d / "server.pub").write_bytes((d / "client.pub").read_bytes()),
            r"server\.pub is not the public half",
        ),
    ],
)
def test_unusable_keys_are_refused_naming_the_file(
    tmp_path: Path, damage: Callable[[Path], object], message: str
) -> None:
    directory = generate_keys(tmp_path / "keys")
    damage(directory)
    with pytest.raises(StageKeysError, match=message):
        load_server_keys(directory)


class _AnswerAtOnce(StageFrontend):
    """Finishes each request as it arrives, echoing its prompt."""

    def __init__(self, pipeline: PipelineConfig) -> None:
        self.pipeline = pipeline
        self.stage = pipeline.stages[0]
        self._outputs: asyncio.Queue[StageServerOutput] = asyncio.Queue()

    async def add(self, request: StageServerRequest) -> list[StageServerOutput]:
        self._outputs.put_nowait(
            StageServerOutput(request.request_id, finished=True, text=request.prompt or "")
        )
        return []

    async def next_outputs(self) -> list[StageServerOutput]:
        return [await self._outputs.get()]

    async def abort(self, request_ids: list[str]) -> None:
        return None

    @property
    def in_flight(self) -> int:
        return self._outputs.qsize()

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


@contextlib.asynccontextmanager
async def _served(keys_dir: Path) -> AsyncIterator[str]:
    pipeline = PipelineConfig.model_validate(
        {"model": "m", "stages": [{"stage_id": 0, "type": "llm"}]}
    )
    server = StageServer(_AnswerAtOnce(pipeline), host="127.0.0.1", keys=load_server_keys(keys_dir))
    task = asyncio.create_task(server.serve())
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()


async def _echo(client: RemoteStageClient, text: str) -> str:
    await client.add_request_async(StageServerRequest(f"r-{text}", prompt=text, stream=False))
    outputs = await asyncio.wait_for(client.get_outputs_async(), 10)
    (output,) = outputs.outputs
    return output.text


async def test_only_the_pipelines_router_is_served(tmp_path: Path) -> None:
    keys_dir = generate_keys(tmp_path / "pipeline")
    other = load_client_keys(generate_keys(tmp_path / "other-pipeline"))
    mine = load_client_keys(keys_dir)
    async with _served(keys_dir) as address:
        router = RemoteStageClient(address, keys=mine)
        try:
            await router.wait_ready(10)
            assert await _echo(router, "before") == "before"

            # Another pipeline's router proves a key this stage does not admit.
            foreign = RemoteStageClient(
                address, keys=StageClientKeys(other.public, other.secret, mine.server_public)
            )
            with pytest.raises(StageCoreDeadError, match="refused this router's stage key"):
                await foreign.wait_ready(10)
            foreign.shutdown()

            # A router without keys cannot even complete the handshake.
            keyless = RemoteStageClient(address)
            with pytest.raises(StageCoreDeadError, match="handshake failed"):
                await keyless.wait_ready(10)
            keyless.shutdown()

            # A raw socket's request never reaches the stage: nothing comes back.
            await _raw_request_gets_nothing(address)

            assert await _echo(router, "after") == "after"
            router.check_health()
        finally:
            router.shutdown()


async def _raw_request_gets_nothing(address: str) -> None:
    context = zmq.asyncio.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(f"tcp://{address}")
        await raw.send_multipart([StageCoreRequestType.HEALTH.value])
        # The server answers a HEALTH at once when it takes one: a second of silence is a
        # refusal (the handshake failed) and not a slow answer.
        assert await raw.poll(1000) == 0
    finally:
        raw.close()
        context.term()
