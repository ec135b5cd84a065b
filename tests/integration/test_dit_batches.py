"""Batched DiT requests (a stage's maxNumSeqs above 1): requests that share their call
arguments but seed and prompt run in one pipeline call, each getting the image it gets
alone; one aborted in a batch is dropped and the others go on. Through the diffusion core
process (StageDiffusionCoreProc), whose busy loop forms the batches."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
from omni_runtime.diffusion.stage.stage_diffusion_core_client import StageDiffusionCoreClient
from omni_runtime.engine.stage.stage_core_types import (
    StageDiffusionCoreOutput,
    StageDiffusionCoreOutputs,
)
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest as Request
from omni_runtime.tiny_models import (
    HUNYUAN_VIDEO_SUBDIR,
    QWEN_IMAGE_SUBDIR,
    WAN_SUBDIR,
    Z_IMAGE_SUBDIR,
)

pytestmark = pytest.mark.integration

CHECKPOINTS = {"qwen-image": QWEN_IMAGE_SUBDIR, "z-image": Z_IMAGE_SUBDIR}
# Different lengths, so that a batch pads its prompts (and its negative prompts).
PROMPTS = ["a red fox", "a tall lighthouse on a cliff at night", "two cats"]
STEPS = 6


def request(index: int, **params: Any) -> Request:
    return Request(
        request_id=f"r{index}-{sorted(params.items())}",
        prompt=PROMPTS[index % len(PROMPTS)],
        params={
            "num_inference_steps": STEPS,
            "height": 64,
            "width": 64,
            "seed": 100 + index,
            "negative_prompt": "blurry, dark" if index % 2 else "ugly",
            **params,
        },
    )


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def family(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def alone(tiny_models: Path, family: str) -> DiffusionEngine:
    config = DiffusionEngineConfig(model=str(tiny_models / CHECKPOINTS[family]), family=family)
    return DiffusionEngine(config)


@pytest.fixture(scope="module")
def batched(tiny_models: Path, family: str) -> DiffusionEngineConfig:
    """A core that batches up to four requests (a stage's maxNumSeqs 4)."""
    return DiffusionEngineConfig(
        model=str(tiny_models / CHECKPOINTS[family]), family=family, max_batch=4
    )


def image_alone(dit: DiffusionEngine, req: Request) -> np.ndarray:
    dit.admit(req.request_id)
    output = dit.execute(req)
    assert output.error is None, output.error
    assert output.images is not None
    return output.images


def outputs_of(
    config: DiffusionEngineConfig, requests: list[Request]
) -> dict[str, StageDiffusionCoreOutput]:
    """Each request's final output from a core process of ``config``, the requests sent
    together."""

    async def run() -> dict[str, StageDiffusionCoreOutput]:
        client = StageDiffusionCoreClient(config)
        try:
            for req in requests:
                await client.add_request_async(req)
            finals: dict[str, StageDiffusionCoreOutput] = {}
            async with asyncio.timeout(120):
                while len(finals) < len(requests):
                    message = await client.get_outputs_async()
                    assert isinstance(message, StageDiffusionCoreOutputs)
                    for output in message.outputs:
                        finals[output.request_id] = output
            return finals
        finally:
            client.shutdown()

    return asyncio.run(run())


def assert_same_image(batched: np.ndarray, alone: np.ndarray) -> None:
    # A batch's matrix products are of other shapes than one request's, so floating point
    # may round an image value the other way: within 1 level, almost all identical.
    difference = np.abs(batched.astype(np.int64) - alone.astype(np.int64))
    assert difference.max() <= 1
    assert (difference == 0).mean() > 0.99


def test_a_batch_gives_each_request_its_image_alone(
    alone: DiffusionEngine, batched: DiffusionEngineConfig
) -> None:
    requests = [request(i) for i in range(3)]
    finals = outputs_of(batched, requests)
    for req in requests:
        output = finals[req.request_id]
        assert output.error is None, output.error
        assert output.images is not None
        assert_same_image(output.images, image_alone(alone, req))
    # Requests sent together run together, but the first may start alone before the
    # others come: a batch's requests share its run's time, so two of them at least do.
    times = [finals[r.request_id].execute_time for r in requests]
    assert len(set(times)) < len(times), times
    # Different seeds and prompts: different images.
    first, second = (finals[r.request_id].images for r in requests[:2])
    assert not np.array_equal(first, second)


def test_requests_that_differ_in_their_call_run_apart(
    alone: DiffusionEngine, batched: DiffusionEngineConfig
) -> None:
    requests = [request(0), request(1, num_inference_steps=STEPS + 1), request(2, height=32)]
    keys = {batched_key(alone, req) for req in requests}
    assert len(keys) == 3
    finals = outputs_of(batched, requests)
    for req in requests:
        images = finals[req.request_id].images
        assert images is not None
        assert_same_image(images, image_alone(alone, req))


def batched_key(dit: DiffusionEngine, req: Request) -> Any:
    dit.config.max_batch = 4
    try:
        return dit.batch_key(req)
    finally:
        dit.config.max_batch = 1


def test_an_aborted_request_leaves_its_batch_alone(
    alone: DiffusionEngine, tiny_models: Path, family: str
) -> None:
    config = DiffusionEngineConfig(
        model=str(tiny_models / CHECKPOINTS[family]), family=family, max_batch=4
    )
    dit = DiffusionEngine(config)
    requests = [request(i) for i in range(3)]
    dropped = requests[1].request_id
    calls = [0]

    def abort_mid_run(*_: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:  # the batch is on its way
            dit.abort([dropped])

    handle = dit.pipeline.transformer.register_forward_pre_hook(abort_mid_run)
    try:
        for req in requests:
            dit.admit(req.request_id)
        outputs = dit.execute_batch(requests)
    finally:
        handle.remove()
    assert calls[0] > 3, "the batch ran on after the abort"
    assert [o.request_id for o in outputs] == [r.request_id for r in requests]
    assert outputs[1].aborted
    assert outputs[1].images is None
    for index in (0, 2):
        images = outputs[index].images
        assert images is not None
        assert_same_image(images, image_alone(alone, requests[index]))


def test_a_batch_sends_each_request_its_own_partial_images(
    alone: DiffusionEngine, tiny_models: Path, family: str
) -> None:
    config = DiffusionEngineConfig(
        model=str(tiny_models / CHECKPOINTS[family]), family=family, max_batch=4
    )
    dit = DiffusionEngine(config)
    requests = [request(i, partial_images=2) for i in range(2)]
    # As many partials: one batch; a request without them runs apart.
    assert batched_key(alone, requests[0]) == batched_key(alone, requests[1])
    assert batched_key(alone, requests[0]) != batched_key(alone, request(0))
    sent: list[StageDiffusionCoreOutput] = []
    for req in requests:
        dit.admit(req.request_id)
    finals = dit.execute_batch(requests, emit=sent.append)
    for req, final in zip(requests, finals, strict=True):
        solo: list[StageDiffusionCoreOutput] = []
        alone.admit(req.request_id)
        solo_final = alone.execute(req, emit=solo.append)
        own = [output for output in sent if output.request_id == req.request_id]
        assert [o.partial_index for o in own] == [o.partial_index for o in solo] == [0, 1]
        for mine, theirs in zip(own, solo, strict=True):
            assert mine.images is not None
            assert theirs.images is not None
            assert mine.images.shape == (1, 64, 64, 3)
            assert_same_image(mine.images, theirs.images)
        assert final.images is not None
        assert solo_final.images is not None
        assert_same_image(final.images, solo_final.images)


# Text-to-video clips batch too (Wan2.2: its UMT5 in the DiT stage reads the prompts), each
# with the progress of its own steps; HunyuanVideo-1.5's do not (each prompt has glyph
# embeddings of its own, which its pipeline takes for one prompt only).
CLIP = {"height": 32, "width": 64, "num_frames": 5, "num_inference_steps": 3}


def clip_request(index: int, **params: Any) -> Request:
    return request(index, **{**CLIP, "report_progress": True, **params})


@pytest.fixture(scope="module")
def wan(tiny_models: Path) -> DiffusionEngine:
    return DiffusionEngine(
        DiffusionEngineConfig(model=str(tiny_models / WAN_SUBDIR), family="wan2.2")
    )


def test_clips_batch_and_each_gets_its_own_frames_and_progress(
    wan: DiffusionEngine, tiny_models: Path
) -> None:
    requests = [clip_request(i) for i in range(3)]
    assert len({batched_key(wan, req) for req in requests}) == 1
    assert batched_key(wan, clip_request(0, num_frames=9)) != batched_key(wan, requests[0])
    sent: list[StageDiffusionCoreOutput] = []
    config = DiffusionEngineConfig(
        model=str(tiny_models / WAN_SUBDIR), family="wan2.2", max_batch=4
    )
    dit = DiffusionEngine(config)
    for req in requests:
        dit.admit(req.request_id)
    finals = dit.execute_batch(requests, emit=sent.append)
    for req, final in zip(requests, finals, strict=True):
        assert final.error is None, final.error
        assert final.images is not None
        assert final.images.shape == (5, 32, 64, 3)
        assert_same_image(final.images, image_alone(wan, req))
        progress = [o.progress for o in sent if o.request_id == req.request_id]
        assert progress == [33, 66, 99], progress
    assert not np.array_equal(finals[0].images, finals[1].images)


def test_hunyuan_video_clips_run_alone(tiny_models: Path) -> None:
    config = DiffusionEngineConfig(
        model=str(tiny_models / HUNYUAN_VIDEO_SUBDIR),
        family="hunyuanvideo-1.5",
        max_batch=4,
        text_from_upstream=True,
    )
    dit = DiffusionEngine(config)
    width = dit.pipeline.transformer.config.text_embed_dim
    clip = Request(
        request_id="r",
        prompt="a cat",
        params={**CLIP, "guidance_scale": 1.0},
        prompt_embeds=np.zeros((4, width), dtype=np.float32),
    )
    # A request it runs (its batch key is not None for want of validity)...
    dit.validate(clip)
    # ...alone: each prompt's glyph embeddings are its own.
    assert dit.batch_key(clip) is None
