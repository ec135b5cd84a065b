"""The diffusion stage for real: diffusers in a StageDiffusionCoreProc on a tiny pipeline,
reached through StageDiffusionCoreClient over ZMQ, and the same engine inline."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from omni_runtime.diffusion.engine import DiffusionEngineConfig
from omni_runtime.diffusion.stage.generate import generate
from omni_runtime.diffusion.stage.inline_stage_diffusion_client import InlineStageDiffusionClient
from omni_runtime.diffusion.stage.stage_diffusion_core_client import StageDiffusionCoreClient
from omni_runtime.engine.stage.stage_core_client import StageCoreDeadError, StageCoreStartupError
from omni_runtime.engine.stage.stage_core_types import (
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
    StageErrorCode,
)
from omni_runtime.images import decode_image, encode_png
from omni_testkit.stage_outputs import outputs_until_dead

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

FAST = {"num_inference_steps": 2}


def request(
    request_id: str, prompt: str | None = "a red cat", **params: object
) -> StageDiffusionCoreRequest:
    return StageDiffusionCoreRequest(
        request_id=request_id, prompt=prompt, params={**FAST, **params}
    )


async def run_one(client: object, req: StageDiffusionCoreRequest) -> StageDiffusionCoreOutput:
    outputs = await generate(client, [req], timeout=120)  # type: ignore[arg-type]
    return outputs[req.request_id]


@pytest.fixture(scope="module")
def engine_config(tiny_models: Path) -> DiffusionEngineConfig:
    return DiffusionEngineConfig(model=str(tiny_models / "diffusion"))


@pytest.fixture(scope="module")
def proc_client(engine_config: DiffusionEngineConfig) -> Iterator[StageDiffusionCoreClient]:
    client = StageDiffusionCoreClient(engine_config)
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def inline_client(engine_config: DiffusionEngineConfig) -> Iterator[InlineStageDiffusionClient]:
    client = InlineStageDiffusionClient(engine_config)
    yield client
    client.shutdown()


async def test_concurrent_requests_give_pngs_of_requested_sizes(
    proc_client: StageDiffusionCoreClient,
) -> None:
    sizes = [(64, 64), (96, 64), (64, 128)]  # (width, height)
    reqs = [request(f"size-{i}", width=w, height=h, seed=i) for i, (w, h) in enumerate(sizes)]
    outputs = await generate(proc_client, reqs, timeout=120)
    for req, (width, height) in zip(reqs, sizes, strict=True):
        output = outputs[req.request_id]
        assert output.error is None
        assert output.images is not None
        assert output.images.shape == (1, height, width, 3)
        png = encode_png(output.images[0])
        assert png.startswith(b"\x89PNG")
        assert decode_image(png).shape == (height, width, 3)


async def test_same_seed_same_bytes_and_inline_matches_proc(
    proc_client: StageDiffusionCoreClient, inline_client: InlineStageDiffusionClient
) -> None:
    first = await run_one(proc_client, request("seed-a", seed=7))
    again = await run_one(proc_client, request("seed-b", seed=7))
    other = await run_one(proc_client, request("seed-c", seed=8))
    inline = await run_one(inline_client, request("seed-d", seed=7))
    assert first.images is not None
    assert again.images is not None
    assert other.images is not None
    assert inline.images is not None
    assert encode_png(first.images[0]) == encode_png(again.images[0])
    assert encode_png(first.images[0]) == encode_png(inline.images[0])
    assert not np.array_equal(first.images, other.images)


async def test_several_images_per_request(proc_client: StageDiffusionCoreClient) -> None:
    output = await run_one(proc_client, request("many", seed=3, num_images=2))
    assert output.images is not None
    assert output.images.shape == (2, 64, 64, 3)


@pytest.mark.parametrize(
    ("params", "prompt", "field", "param"),
    [
        ({"height": 0}, "x", "params.height", "height"),
        ({"num_inference_steps": 0}, "x", "params.num_inference_steps", "num_inference_steps"),
        ({"width": 70}, "x", "width: must be a multiple of 4", "width"),
        ({"sharpness": 3}, "x", "params.sharpness: unknown parameter", "sharpness"),
        ({"seed": -1}, "x", "params.seed", "seed"),
        ({"num_images": "two"}, "x", "params.num_images", "num_images"),
        ({}, None, "prompt: required", "prompt"),
    ],
)
@pytest.mark.parametrize("kind", ["proc", "inline"])
async def test_bad_request_errors_and_next_succeeds(
    proc_client: StageDiffusionCoreClient,
    inline_client: InlineStageDiffusionClient,
    kind: str,
    params: dict[str, object],
    prompt: str | None,
    field: str,
    param: str,
) -> None:
    client = proc_client if kind == "proc" else inline_client
    bad = await run_one(
        client, StageDiffusionCoreRequest(request_id="bad", prompt=prompt, params=params)
    )
    assert bad.images is None
    assert bad.error is not None
    assert bad.error.code == StageErrorCode.BAD_REQUEST
    assert bad.error.param == param
    assert field in bad.error.message
    good = await run_one(client, request("good", seed=1))
    assert good.error is None
    assert good.images is not None


@pytest.mark.parametrize("kind", ["proc", "inline"])
async def test_a_request_id_in_flight_is_refused_and_the_first_goes_on(
    proc_client: StageDiffusionCoreClient, inline_client: InlineStageDiffusionClient, kind: str
) -> None:
    client = proc_client if kind == "proc" else inline_client
    await client.add_request_async(request("twice", seed=1, num_inference_steps=20))
    await client.add_request_async(request("twice", seed=2))
    seen: list[StageDiffusionCoreOutput] = []
    async with asyncio.timeout(60):
        while len(seen) < 2:
            seen.extend((await client.get_outputs_async()).outputs)
    refusal, first = sorted(seen, key=lambda output: output.images is not None)
    assert refusal.error is not None
    assert refusal.error.code == StageErrorCode.REQUEST_ID_IN_FLIGHT
    assert refusal.error.message == "request_id: 'twice' is in flight already; use an id of its own"
    assert first.error is None
    assert first.images is not None
    again = await run_one(client, request("twice", seed=3))  # free again once finished
    assert again.images is not None


async def test_image_to_image_keeps_input_size(proc_client: StageDiffusionCoreClient) -> None:
    source = np.random.default_rng(0).integers(0, 256, size=(96, 64, 3), dtype=np.uint8)
    req = StageDiffusionCoreRequest(
        request_id="i2i",
        prompt="gold",
        images=[source],
        params={**FAST, "seed": 1, "strength": 0.5},
    )
    output = await run_one(proc_client, req)
    assert output.error is None
    assert output.images is not None
    assert output.images.shape == (1, 96, 64, 3)


async def test_prompt_embeds_condition_the_pipeline(proc_client: StageDiffusionCoreClient) -> None:
    width = proc_client.info["conditioning_width"]
    embeds = np.random.default_rng(0).standard_normal((5, width)).astype(np.float32)
    ok = await run_one(
        proc_client,
        StageDiffusionCoreRequest(
            request_id="emb", prompt_embeds=embeds, params={**FAST, "seed": 1}
        ),
    )
    assert ok.error is None
    assert ok.images is not None
    bad = await run_one(
        proc_client,
        StageDiffusionCoreRequest(request_id="emb-bad", prompt_embeds=embeds[:, :7], params=FAST),
    )
    assert bad.error is not None
    assert bad.error.message.startswith("prompt_embeds:")
    assert bad.error.param == "prompt_embeds"


@pytest.mark.parametrize("kind", ["proc", "inline"])
async def test_abort_stops_running_and_queued_requests(
    proc_client: StageDiffusionCoreClient, inline_client: InlineStageDiffusionClient, kind: str
) -> None:
    client = proc_client if kind == "proc" else inline_client
    # Long enough that finishing it instead of aborting would blow the deadline below.
    await client.add_request_async(request("long", num_inference_steps=500))
    await client.add_request_async(request("queued", num_inference_steps=500))
    await client.abort_requests_async(["long", "queued"])
    seen: dict[str, StageDiffusionCoreOutput] = {}
    async with asyncio.timeout(30):
        while len(seen) < 2:
            for output in (await client.get_outputs_async()).outputs:
                seen[output.request_id] = output
    assert seen["long"].aborted
    assert seen["queued"].aborted
    assert seen["long"].images is None
    after = await run_one(client, request("after-abort", seed=2))
    assert after.images is not None


async def test_collective_rpc(proc_client: StageDiffusionCoreClient) -> None:
    info = await proc_client.collective_rpc_async("describe", timeout=10)
    assert info["pipeline"] == "StableDiffusionPipeline"
    assert info["image_to_image"] is True
    with pytest.raises(RuntimeError, match="unknown method"):
        await proc_client.collective_rpc_async("_run", timeout=10)


@pytest.fixture
async def doomed_client(
    engine_config: DiffusionEngineConfig,
) -> AsyncIterator[StageDiffusionCoreClient]:
    """A client of its own, for tests that kill its proc."""
    client = StageDiffusionCoreClient(engine_config)
    yield client
    client.shutdown()
    assert not psutil.pid_exists(client.proc_manager.pid) or (
        psutil.Process(client.proc_manager.pid).status() == psutil.STATUS_ZOMBIE
    )


@pytest.mark.asyncio(loop_scope="function")
async def test_killed_proc_fails_outstanding_requests_fast(
    doomed_client: StageDiffusionCoreClient,
) -> None:
    await doomed_client.add_request_async(request("in-flight", num_inference_steps=500))
    os.kill(doomed_client.proc_manager.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(StageCoreDeadError, match="SIGKILL"):
        async with asyncio.timeout(10):
            await doomed_client.get_outputs_async()
    assert time.monotonic() - start < 5
    with pytest.raises(StageCoreDeadError):
        await doomed_client.add_request_async(request("after-death"))
    with pytest.raises(StageCoreDeadError):
        doomed_client.check_health()


@pytest.mark.asyncio(loop_scope="function")
async def test_sigterm_stops_proc_cleanly(doomed_client: StageDiffusionCoreClient) -> None:
    os.kill(doomed_client.proc_manager.pid, signal.SIGTERM)
    # What is asserted is a clean exit, not its speed: a proc still starting (importing
    # torch, loading the pipeline) finishes that first, which took over 10 s beside two
    # busy loops on two cores; 60 s as for the other deaths waited for here.
    with pytest.raises(StageCoreDeadError, match="exit code 0"):
        async with asyncio.timeout(60):
            await doomed_client.get_outputs_async()


async def test_startup_failure_is_reported_not_hung(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(StageCoreStartupError, match="failed to start") as info:
        StageDiffusionCoreClient(DiffusionEngineConfig(model=str(tmp_path / "missing")))
    assert str(tmp_path / "missing") in str(info.value)
    assert time.monotonic() - start < 60


async def test_startup_past_its_deadline_is_reported_and_leaves_nothing(
    engine_config: DiffusionEngineConfig,
) -> None:
    before = set(psutil.Process().children(recursive=True))
    start = time.monotonic()
    # Loading torch and diffusers alone takes longer than this.
    with pytest.raises(StageCoreStartupError, match="not ready within 1 s"):
        StageDiffusionCoreClient(engine_config, startup_timeout=1.0)
    assert time.monotonic() - start < 15
    assert set(psutil.Process().children(recursive=True)) - before == set()


async def wait_running(client: StageDiffusionCoreClient, idle_cpu: float) -> None:
    # An idle core burns no CPU: half a second of it means the request is running.
    core = psutil.Process(client.proc_manager.pid)
    deadline = time.monotonic() + 30
    while sum(core.cpu_times()[:2]) - idle_cpu < 0.5:
        assert time.monotonic() < deadline, "the request never started"
        await asyncio.sleep(0.05)


@pytest.mark.asyncio(loop_scope="function")
async def test_sigterm_finishes_the_running_request_then_exits(
    doomed_client: StageDiffusionCoreClient,
) -> None:
    """A stop signal drains: the request the core runs completes (a pod's SIGTERM must not
    cost a user the image it was making), then the core exits cleanly."""
    core = psutil.Process(doomed_client.proc_manager.pid)
    idle_cpu = sum(core.cpu_times()[:2])
    await doomed_client.add_request_async(request("finishing", num_inference_steps=60))
    await wait_running(doomed_client, idle_cpu)
    os.kill(doomed_client.proc_manager.pid, signal.SIGTERM)
    outputs, death = await outputs_until_dead(doomed_client, timeout=60)
    assert "exit code 0" in str(death)
    assert [o.request_id for o in outputs] == ["finishing"]
    assert not outputs[0].aborted
    assert outputs[0].error is None
    assert outputs[0].images is not None


@pytest.mark.asyncio(loop_scope="function")
async def test_sigterm_aborts_what_outlives_the_drain_timeout(
    engine_config: DiffusionEngineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drain is bounded (OMNI_DRAIN_TIMEOUT_S, read by the core at start): past it the
    running request is aborted, and the core still exits cleanly."""
    monkeypatch.setenv("OMNI_DRAIN_TIMEOUT_S", "0.5")
    client = StageDiffusionCoreClient(engine_config)
    try:
        core = psutil.Process(client.proc_manager.pid)
        idle_cpu = sum(core.cpu_times()[:2])
        # Far more steps than the 0.5 s drain allows: the abort is the proof that the bound
        # ended it, and the deadline only keeps a broken bound from hanging the test. How
        # soon after the 0.5 s the core is gone is the next step boundary plus its exit,
        # which on a loaded 2-core machine took 6.7 s (a 5 s bound here failed so).
        await client.add_request_async(request("long", num_inference_steps=500))
        await wait_running(client, idle_cpu)
        os.kill(client.proc_manager.pid, signal.SIGTERM)
        outputs, death = await outputs_until_dead(client, timeout=60)
        assert "exit code 0" in str(death)
        assert [o.request_id for o in outputs] == ["long"]
        assert outputs[0].aborted
    finally:
        client.shutdown()


async def test_core_exits_when_its_manager_process_is_killed(
    engine_config: DiffusionEngineConfig,
) -> None:
    script = (
        "import sys\n"
        "from omni_runtime.diffusion.engine import DiffusionEngineConfig\n"
        "from omni_runtime.diffusion.stage.stage_diffusion_core_client import "
        "StageDiffusionCoreClient\n"
        f"client = StageDiffusionCoreClient(DiffusionEngineConfig(model={engine_config.model!r}))\n"
        "print(client.proc_manager.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    manager = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert manager.stdout is not None
        core = psutil.Process(int(manager.stdout.readline()))
        manager.kill()
        manager.wait(timeout=10)
        # psutil.TimeoutExpired if the core outlives its manager. It notices at once; its
        # exit (torch's teardown) took over 10 s beside two busy loops on 2 cores.
        core.wait(timeout=60)
    finally:
        manager.kill()
        manager.wait()
