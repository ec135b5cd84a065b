"""BAGEL's DiT fed the thinker's context KV caches through real connectors.

The producer here is this test process: it builds a request's three contexts with
``BagelGenerator`` (what the thinker will hand over) and puts their keys and values into a
shared-memory or TCP connector; the DiT core (a real ``StageDiffusionCoreProc``) fetches
them itself. Fed the same contexts, the DiT makes the image it makes when it builds them
itself from the prompt and image, bit for bit; a request that ends without running frees
the producer's copies at once.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omni_runtime.config import ConnectorConfig
from omni_runtime.connectors import (
    ConnectorError,
    ConnectorUnavailableError,
    OmniConnector,
    StageConnectors,
)
from omni_runtime.diffusion.engine import DiffusionEngineConfig
from omni_runtime.diffusion.stage.stage_diffusion_core_client import StageDiffusionCoreClient
from omni_runtime.engine.stage.stage_core_types import (
    HandOff,
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
    StageErrorCode,
)
from omni_runtime.modeling.bagel.generation import BagelGenerator, Contexts
from omni_runtime.modeling.bagel.model import ContextKV
from omni_runtime.tiny_models import BAGEL_SUBDIR

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SIZE = 64
PROMPT = "Turn the main subject into a polished gold sculpture."
FAST = {"num_inference_steps": 4, "seed": 5}
CONNECTORS = {
    "shm": {"name": "SharedMemoryConnector"},
    "tcp": {"name": "TCPConnector", "extra": {"bind_host": "127.0.0.1"}},
    # Its transfer engine over TCP on loopback (RDMA across nodes).
    "mooncake": {
        "name": "MooncakeTransferEngineConnector",
        "extra": {"host": "127.0.0.1", "protocol": "tcp", "memory_pool_size": 64 << 20},
    },
}


def input_image() -> np.ndarray:
    return np.random.default_rng(11).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def checkpoint(tiny_models: Path) -> Path:
    return tiny_models / BAGEL_SUBDIR


@pytest.fixture(scope="module")
def producer() -> Iterator[StageConnectors]:
    """The thinker's side of the connectors, in this process."""
    connectors = StageConnectors(
        {name: ConnectorConfig.model_validate(c) for name, c in CONNECTORS.items()}
    )
    yield connectors
    connectors.close()


@pytest.fixture(scope="module")
def contexts(checkpoint: Path) -> Contexts:
    """The edit's contexts as the thinker computes them, with the request's seed."""
    generator = BagelGenerator.load(checkpoint)
    image = generator.prepare_image(Image.fromarray(input_image()))
    return generator.contexts(PROMPT, image, 0, 0, torch.Generator().manual_seed(FAST["seed"]))


@pytest.fixture(scope="module")
def dit(checkpoint: Path) -> Iterator[StageDiffusionCoreClient]:
    config = DiffusionEngineConfig(model=str(checkpoint), family="bagel", connectors=CONNECTORS)
    client = StageDiffusionCoreClient(config)
    yield client
    client.shutdown()


def put(
    connector: OmniConnector, key: str, context: ContextKV, prefix: ContextKV | None = None
) -> HandOff:
    kv = torch.stack([context.keys, context.values]).contiguous()
    meta = {"rope": context.rope}
    if prefix is not None:
        meta.update(prefix_length=prefix.length, prefix_rope=prefix.rope)
    return HandOff(connector.put(key, kv), meta)


async def run(
    client: StageDiffusionCoreClient, *requests: StageDiffusionCoreRequest
) -> dict[str, StageDiffusionCoreOutput]:
    for request in requests:
        await client.add_request_async(request)
    seen: dict[str, StageDiffusionCoreOutput] = {}
    async with asyncio.timeout(120):
        while len(seen) < len(requests):
            for output in (await client.get_outputs_async()).outputs:
                seen[output.request_id] = output
    return seen


def source(producer: StageConnectors, connector: str) -> OmniConnector:
    """The producer's connector; Mooncake's skips (or fails, where required) if its engine
    cannot load in this process (its libraries must be on LD_LIBRARY_PATH at start)."""
    try:
        return producer.get(connector)
    except ConnectorUnavailableError as e:
        if os.environ.get("OMNI_REQUIRE_MOONCAKE") == "1":
            pytest.fail(f"OMNI_REQUIRE_MOONCAKE=1, but {e}")
        pytest.skip(str(e))


def kv_request(
    request_id: str, producer: StageConnectors, connector: str, contexts: Contexts, **params: Any
) -> StageDiffusionCoreRequest:
    source_connector = source(producer, connector)
    return StageDiffusionCoreRequest(
        request_id=request_id,
        params={**FAST, **params},
        images=[input_image()],
        inputs={
            "context_kv": put(
                source_connector, f"{request_id}-full", contexts.full, contexts.no_text
            ),
            "no_image_context_kv": put(
                source_connector, f"{request_id}-no-image", contexts.no_image
            ),
        },
    )


@pytest.mark.parametrize("connector", ["shm", "tcp", "mooncake"])
async def test_the_thinkers_kv_makes_the_image_the_dit_makes_itself(
    dit: StageDiffusionCoreClient, producer: StageConnectors, contexts: Contexts, connector: str
) -> None:
    own = StageDiffusionCoreRequest(
        request_id=f"own-{connector}", prompt=PROMPT, params=FAST, images=[input_image()]
    )
    handed = kv_request(f"kv-{connector}", producer, connector, contexts)
    outputs = await run(dit, own, handed)
    for output in outputs.values():
        assert output.error is None, output.error
        assert output.images is not None
    np.testing.assert_array_equal(outputs[handed.request_id].images, outputs[own.request_id].images)
    # Fetched once: the producer's copies are gone.
    for hand_off in handed.inputs.values():
        with pytest.raises(ConnectorError):
            producer.get(connector).get(hand_off.handle)


@pytest.mark.parametrize("connector", ["shm", "tcp"])
async def test_a_request_aborted_before_it_runs_frees_the_producers_copies(
    dit: StageDiffusionCoreClient, producer: StageConnectors, contexts: Contexts, connector: str
) -> None:
    # Long enough that the second waits in the core's queue when it is aborted.
    busy = StageDiffusionCoreRequest(
        request_id=f"busy-{connector}", prompt=PROMPT, params={"num_inference_steps": 200}
    )
    queued = kv_request(f"queued-{connector}", producer, connector, contexts)
    await dit.add_request_async(busy)
    await dit.add_request_async(queued)
    await dit.abort_requests_async([busy.request_id, queued.request_id])
    seen: dict[str, StageDiffusionCoreOutput] = {}
    async with asyncio.timeout(60):
        while len(seen) < 2:
            for output in (await dit.get_outputs_async()).outputs:
                seen[output.request_id] = output
    assert seen[queued.request_id].aborted
    assert len(queued.inputs) == 2
    for hand_off in queued.inputs.values():
        with pytest.raises(ConnectorError):
            producer.get(connector).get(hand_off.handle)


async def test_a_kv_cache_of_the_wrong_shape_or_gone_is_refused_by_name(
    dit: StageDiffusionCoreClient, producer: StageConnectors, contexts: Contexts
) -> None:
    source = producer.get("tcp")
    wrong = ContextKV(contexts.full.keys[:1], contexts.full.values[:1], contexts.full.rope)
    bad_shape = StageDiffusionCoreRequest(
        request_id="bad-shape", params=FAST, inputs={"context_kv": put(source, "bad", wrong)}
    )
    gone_ref = put(source, "gone", contexts.full)
    source.release(gone_ref.handle.key)
    gone = StageDiffusionCoreRequest(
        request_id="gone", params=FAST, inputs={"context_kv": gone_ref}
    )
    no_companion = StageDiffusionCoreRequest(
        request_id="no-companion",
        params=FAST,
        images=[input_image()],
        inputs={"context_kv": put(source, "alone", contexts.full, contexts.no_text)},
    )
    outputs = await run(dit, bad_shape, gone, no_companion)
    error = outputs["bad-shape"].error
    assert error is not None
    assert error.param == "context_kv"
    assert "expected keys and values of shape [2, 2, tokens, 2, 32]" in error.message
    error = outputs["gone"].error
    assert error is not None
    assert error.message.startswith("context_kv:")
    # Named, so that a router runs the request again from the thinker (a lost hand-off).
    assert (error.code, error.param) == (StageErrorCode.STAGE_FAILED, "context_kv")
    error = outputs["no-companion"].error
    assert error is not None
    assert error.param == "no_image_context_kv"
