"""LoRA adapters on a DiT stage: the tiny Z-Image DiT with tiny adapters (tiny_models.dit_lora),
in this process (DiffusionEngine) and in a diffusion core process, each image compared with
diffusers' own ZImagePipeline given the same file (load_lora_weights, set_adapters)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch

from omni_runtime.config import PipelineConfig
from omni_runtime.connectors import StageConnectors
from omni_runtime.diffusion.adapters import (
    DiTAdapters,
    ReadAdapter,
    linear_modules,
    peft_name,
    read_adapter,
)
from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
from omni_runtime.diffusion.stage.stage_diffusion_core_client import StageDiffusionCoreClient
from omni_runtime.engine.stage.stage_core_types import (
    StageAdapter,
    StageDiffusionCoreOutput,
    StageDiffusionCoreOutputs,
    StageErrorCode,
    StageServerOutput,
    StageServerRequest,
)
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest as Request
from omni_runtime.entrypoints.stage_process import diffusion_engine_config
from omni_runtime.images import to_uint8
from omni_runtime.stage_server.diffusion_frontend import StageDiffusionFrontend
from omni_runtime.tiny_models import Z_IMAGE_SUBDIR
from omni_runtime.tiny_models.dit_lora import build_dit_loras

pytestmark = pytest.mark.integration

FAMILY = "z-image"
PARAMS: dict[str, Any] = {"num_inference_steps": 4, "height": 64, "width": 64}
INK, NEON, MONO = "z-image-ink", "z-image-neon", "z-image-mono"


@pytest.fixture(scope="module")
def checkpoint(tiny_models: Path) -> Path:
    return tiny_models / Z_IMAGE_SUBDIR


@pytest.fixture(scope="module")
def loras(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_dit_loras(tmp_path_factory.mktemp("dit-loras"), checkpoint)


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters this DiT cannot take, by what is wrong with them."""
    folder = tmp_path_factory.mktemp("bad-loras")
    corrupt = folder / "corrupt.safetensors"
    corrupt.write_bytes(b"\x07\x00\x00\x00\x00\x00\x00\x00not json" + bytes(range(64)))
    # The layout of a UNet's LoRA: no module of the DiT is named so.
    foreign = folder / "unet-blocks.safetensors"
    safetensors.torch.save_file(
        {
            "transformer.down_blocks.0.attentions.0.proj_in.lora_A.weight": torch.ones(4, 64),
            "transformer.down_blocks.0.attentions.0.proj_in.lora_B.weight": torch.ones(64, 4),
        },
        foreign,
    )
    # The DiT's own module, but an adapter of a narrower model (32 in_features, not 64).
    narrow = folder / "narrow.safetensors"
    safetensors.torch.save_file(
        {
            "transformer.layers.0.attention.to_q.lora_A.weight": torch.ones(4, 32),
            "transformer.layers.0.attention.to_q.lora_B.weight": torch.ones(64, 4),
        },
        narrow,
    )
    return {"corrupt": corrupt, "foreign": foreign, "narrow": narrow}


def adapter(loras: dict[str, Path], name: str, scale: float = 1.0) -> StageAdapter:
    return StageAdapter(name=name, source=str(loras[name]), scale=scale)


def request(request_id: str, lora: StageAdapter | None = None, seed: int = 7) -> Request:
    return Request(
        request_id=request_id,
        prompt="a lighthouse at night",
        params={**PARAMS, "seed": seed, "negative_prompt": "blurry"},
        adapter=lora,
    )


def make_engine(checkpoint: Path, max_loras: int) -> DiffusionEngine:
    return DiffusionEngine(
        DiffusionEngineConfig(model=str(checkpoint), family=FAMILY, max_loras=max_loras)
    )


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[DiffusionEngine]:
    dit = make_engine(checkpoint, max_loras=2)
    yield dit
    dit.close()


def run(dit: DiffusionEngine, req: Request) -> StageDiffusionCoreOutput:
    assert dit.admit(req.request_id) is None
    return dit.execute(req)


def image(dit: DiffusionEngine, req: Request) -> np.ndarray:
    output = run(dit, req)
    assert output.error is None, output.error
    assert output.images is not None
    return output.images


class Reference:
    """diffusers' own ZImagePipeline, each adapter loaded from its file as diffusers'
    documentation does it."""

    def __init__(self, checkpoint: Path) -> None:
        from diffusers import ZImagePipeline

        self.pipe = ZImagePipeline.from_pretrained(checkpoint, dtype=torch.float32)
        self.pipe.set_progress_bar_config(disable=True)
        self._loaded: set[str] = set()
        self._cache: dict[tuple[str | None, float, int], np.ndarray] = {}

    def image(self, lora: StageAdapter | None, seed: int = 7) -> np.ndarray:
        key = (lora.name if lora else None, lora.scale if lora else 1.0, seed)
        if key in self._cache:
            return self._cache[key]
        if lora is None:
            if self._loaded:
                self.pipe.disable_lora()
        else:
            if lora.name not in self._loaded:
                self.pipe.load_lora_weights(lora.source, adapter_name=lora.name)
                self._loaded.add(lora.name)
            self.pipe.enable_lora()
            self.pipe.set_adapters([lora.name], adapter_weights=[lora.scale])
        with torch.inference_mode():
            result = self.pipe(
                prompt="a lighthouse at night",
                negative_prompt="blurry",
                generator=torch.Generator("cpu").manual_seed(seed),
                output_type="np",
                **PARAMS,
            )
        self._cache[key] = to_uint8(result.images)
        return self._cache[key]


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Reference:
    return Reference(checkpoint)


def assert_same(made: np.ndarray, expected: np.ndarray) -> None:
    # The engine runs the same pipeline on the same weights, LoRA layers and generator:
    # the same operations in the same order, so the same bytes.
    assert made.shape == expected.shape
    np.testing.assert_array_equal(made, expected)


def test_an_adapter_makes_diffusers_own_image(
    engine: DiffusionEngine, reference: Reference, loras: dict[str, Path]
) -> None:
    ink = adapter(loras, INK)
    made = image(engine, request("ink", ink))
    assert_same(made, reference.image(ink))
    # And it is the adapter's doing: without it, another image (diffusers' own, too).
    plain = image(engine, request("plain"))
    assert_same(plain, reference.image(None))
    assert np.abs(made.astype(int) - plain.astype(int)).mean() > 2
    assert INK in engine.held_adapters()


def test_a_half_scale_is_the_reference_at_half_scale(
    engine: DiffusionEngine, reference: Reference, loras: dict[str, Path]
) -> None:
    full = image(engine, request("neon-1", adapter(loras, NEON)))
    half_adapter = adapter(loras, NEON, 0.5)
    half = image(engine, request("neon-0.5", half_adapter))
    assert not np.array_equal(half, full)
    assert_same(half, reference.image(half_adapter))
    assert_same(full, reference.image(adapter(loras, NEON)))


def test_lru_of_one_evicts_and_reloads(
    checkpoint: Path, reference: Reference, loras: dict[str, Path]
) -> None:
    dit = make_engine(checkpoint, max_loras=1)
    try:
        ink, mono = adapter(loras, INK), adapter(loras, MONO)
        first = image(dit, request("a-1", ink))
        assert dit.held_adapters() == [INK]
        second = image(dit, request("b", mono))
        assert dit.held_adapters() == [MONO]
        assert_same(second, reference.image(mono))
        third = image(dit, request("a-2", ink))
        assert_same(third, first)
        assert_same(third, reference.image(ink))
        assert dit.held_adapters() == [INK]
        # Evicted for good: only ink's layers remain in the transformer.
        assert set(dit.pipeline.transformer.peft_config) == {peft_name(INK)}
    finally:
        dit.close()


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("corrupt", "not a readable safetensors LoRA file"),
        ("foreign", "modules the DiT does not have"),
        ("narrow", "in_features"),
    ],
)
def test_an_adapter_that_does_not_fit_fails_its_request_alone(
    engine: DiffusionEngine,
    reference: Reference,
    loras: dict[str, Path],
    bad_files: dict[str, Path],
    bad: str,
    why: str,
) -> None:
    held = engine.held_adapters()
    lora = StageAdapter(name=f"bad-{bad}", source=str(bad_files[bad]))
    output = run(engine, request(f"bad-{bad}", lora))
    assert output.images is None
    assert output.error is not None
    assert output.error.code is StageErrorCode.BAD_REQUEST
    assert output.error.param == "model"
    assert str(bad_files[bad]) in output.error.message
    assert why in output.error.message
    # Not held; room was made for it (the least recently used evicted, as the stage
    # server's mirror does when it sends the request), nothing else changed.
    assert lora.name not in engine.held_adapters()
    assert set(engine.held_adapters()) <= set(held)
    assert len(engine.held_adapters()) >= min(len(held), 1)
    # The engine serves on, each next request as it should be.
    assert_same(image(engine, request(f"after-{bad}")), reference.image(None))
    ink = adapter(loras, INK)
    assert_same(image(engine, request(f"after-{bad}-ink", ink)), reference.image(ink))


def test_a_missing_file_names_it(engine: DiffusionEngine) -> None:
    output = run(engine, request("missing", StageAdapter("gone", "/nonexistent/gone.safetensors")))
    assert output.error is not None
    assert output.error.param == "model"
    assert "/nonexistent/gone.safetensors" in output.error.message


def test_a_half_injected_adapter_is_removed(
    checkpoint: Path, reference: Reference, loras: dict[str, Path], bad_files: dict[str, Path]
) -> None:
    """An adapter past the checks whose injection fails part way (PEFT's own shape check,
    here) leaves the transformer as it was."""
    dit = make_engine(checkpoint, max_loras=2)
    try:
        narrow = safetensors.torch.load_file(bad_files["narrow"])
        # A good module first, so that PEFT injects layers before it meets the bad one.
        state = {
            "transformer.layers.1.attention.to_k.lora_A.weight": torch.ones(4, 64),
            "transformer.layers.1.attention.to_k.lora_B.weight": torch.ones(64, 4),
            **narrow,
        }
        modules = linear_modules(dit.pipeline.transformer)

        def read(lora: StageAdapter) -> ReadAdapter:
            if lora.name != "halfway":
                return read_adapter(lora, type(dit.pipeline), modules)
            return ReadAdapter(lora.name, lora.source, Path(lora.source), state, None)

        dit._adapters = DiTAdapters(dit.pipeline, 2, read=read)
        ink = adapter(loras, INK)
        assert_same(image(dit, request("before", ink)), reference.image(ink))
        modules_before = {name for name, _ in dit.pipeline.transformer.named_modules()}
        output = run(dit, request("half", StageAdapter("halfway", str(bad_files["narrow"]))))
        assert output.error is not None
        assert output.error.param == "model"
        assert str(bad_files["narrow"]) in output.error.message
        assert "size mismatch" in output.error.message
        assert dit.held_adapters() == [INK]
        assert set(dit.pipeline.transformer.peft_config) == {peft_name(INK)}
        assert {name for name, _ in dit.pipeline.transformer.named_modules()} == modules_before
        assert_same(image(dit, request("after-half")), reference.image(None))
        assert_same(image(dit, request("after-half-ink", ink)), reference.image(ink))
    finally:
        dit.close()


def test_batches_never_mix_adapters_or_scales(
    engine: DiffusionEngine, loras: dict[str, Path]
) -> None:
    engine.config.max_batch = 4
    try:
        keys = {
            engine.batch_key(request(name, lora))
            for name, lora in [
                ("none", None),
                ("ink", adapter(loras, INK)),
                ("ink-half", adapter(loras, INK, 0.5)),
                ("neon", adapter(loras, NEON)),
            ]
        }
        assert len(keys) == 4
        assert engine.batch_key(request("ink-2", adapter(loras, INK), seed=9)) in keys
    finally:
        engine.config.max_batch = 1


def core_outputs(
    config: DiffusionEngineConfig, requests: list[Request]
) -> tuple[dict[str, StageDiffusionCoreOutput], list[str]]:
    """The requests' final outputs from one core process, sent together, and the adapters
    it holds at the end."""

    async def go() -> tuple[dict[str, StageDiffusionCoreOutput], list[str]]:
        client = StageDiffusionCoreClient(config)
        try:
            for req in requests:
                await client.add_request_async(req)
            finals: dict[str, StageDiffusionCoreOutput] = {}
            async with asyncio.timeout(180):
                while len(finals) < len(requests):
                    message = await client.get_outputs_async()
                    assert isinstance(message, StageDiffusionCoreOutputs)
                    for output in message.outputs:
                        if output.final:
                            finals[output.request_id] = output
            held = await client.collective_rpc_async("held_adapters", timeout=30)
            return finals, held
        finally:
            client.shutdown()

    return asyncio.run(go())


@pytest.mark.parametrize("max_batch", [1, 4])
def test_requests_of_different_adapters_in_flight_on_one_core(
    checkpoint: Path,
    reference: Reference,
    loras: dict[str, Path],
    bad_files: dict[str, Path],
    max_batch: int,
) -> None:
    ink, neon = adapter(loras, INK), adapter(loras, NEON)
    cases = [
        ("ink", ink),
        ("neon", neon),
        ("none", None),
        ("bad", StageAdapter("bad", str(bad_files["narrow"]))),
        ("ink-half", adapter(loras, INK, 0.5)),
        ("neon-again", neon),
    ]
    config = DiffusionEngineConfig(
        model=str(checkpoint), family=FAMILY, max_loras=2, max_batch=max_batch
    )
    started = time.monotonic()
    finals, held = core_outputs(config, [request(name, lora) for name, lora in cases])
    assert time.monotonic() - started < 180
    for name, lora in cases:
        output = finals[name]
        if name == "bad":
            assert output.error is not None
            assert output.error.param == "model"
            assert str(bad_files["narrow"]) in output.error.message
            continue
        assert output.error is None, output.error
        assert output.images is not None
        if max_batch == 1:
            assert_same(output.images, reference.image(lora))
        else:
            # neon's two requests may share a pipeline call: a batch's matrix products are
            # of other shapes, so a value may round the other way (test_dit_batches).
            difference = np.abs(output.images.astype(int) - reference.image(lora).astype(int))
            assert difference.max() <= 1
            assert (difference == 0).mean() > 0.99
    assert sorted(held) == [INK, NEON]


@pytest.mark.parametrize("name", ["half", "pixel.art"])
def test_any_valid_adapter_name_loads(
    engine: DiffusionEngine, reference: Reference, loras: dict[str, Path], name: str
) -> None:
    # A module's own attribute ("half"), a '.': neither is a name PEFT could keep an
    # adapter under.
    ink = adapter(loras, INK)
    made = image(engine, request(f"named-{name}", StageAdapter(name, ink.source)))
    assert_same(made, reference.image(ink))
    assert name in engine.held_adapters()


def test_the_stage_servers_mirror_follows_the_core(
    checkpoint: Path, reference: Reference, loras: dict[str, Path], bad_files: dict[str, Path]
) -> None:
    """Through StageDiffusionFrontend: the adapter reaches the core, the frontend's mirror
    of the core's cache holds what the core holds, and forgets an adapter the core could
    not load; a stage that takes no adapters refuses a request naming one."""
    declared = {INK: loras[INK], NEON: loras[NEON], "bad": bad_files["narrow"]}
    # A model the schema infers no family from (it would want the family's encoder stage):
    # the frontend reads only the stages and adapters; the engine gets the checkpoint.
    pipeline = PipelineConfig.model_validate(
        {
            "model": "/models/tiny-dit",
            "stages": [{"stageId": 0, "name": "dit", "type": "diffusion", "maxLoras": 2}],
            "adapters": [
                {"name": name, "stage": "dit", "source": str(path)}
                for name, path in declared.items()
            ],
        }
    )
    plain = PipelineConfig.model_validate(
        {
            "model": "/models/tiny-dit",
            "stages": [{"stageId": 0, "name": "dit", "type": "diffusion"}],
        }
    )
    stage = pipeline.stages[0]
    # The family is the caller's to set: its own rules want an encoder stage.
    config = diffusion_engine_config(pipeline, stage, str(checkpoint))
    config.family = FAMILY
    assert config.max_loras == 2

    def server_request(request_id: str, name: str | None) -> StageServerRequest:
        chosen = None if name is None else StageAdapter(name, str(declared[name]))
        return StageServerRequest(
            request_id=request_id,
            prompt="a lighthouse at night",
            params={**PARAMS, "seed": 7, "negative_prompt": "blurry"},
            adapter=chosen,
        )

    async def go() -> tuple[dict[str, StageServerOutput], list[str], list[str]]:
        client = StageDiffusionCoreClient(config)
        frontend = StageDiffusionFrontend(pipeline, stage, client, StageConnectors({}))
        refusing = StageDiffusionFrontend(plain, plain.stages[0], client, StageConnectors({}))
        try:
            refused = await refusing.add(server_request("refused", INK))
            assert len(refused) == 1
            assert refused[0].error is not None
            assert refused[0].error.param == "model"
            assert refusing.held_adapters == []
            sent = [("ink", INK), ("neon", NEON), ("bad", "bad"), ("none", None)]
            for request_id, name in sent:
                assert await frontend.add(server_request(request_id, name)) == []
            finals: dict[str, StageServerOutput] = {}
            async with asyncio.timeout(180):
                while len(finals) < len(sent):
                    for output in await frontend.next_outputs():
                        if output.finished:
                            finals[output.request_id] = output
            held = await client.collective_rpc_async("held_adapters", timeout=30)
            return finals, frontend.held_adapters, held
        finally:
            client.shutdown()

    finals, mirrored, held = asyncio.run(go())
    for request_id, name in [("ink", INK), ("neon", NEON), ("none", None)]:
        output = finals[request_id]
        assert output.error is None, output.error
        assert output.images is not None
        lora = None if name is None else adapter(loras, name)
        assert_same(output.images, reference.image(lora))
    bad = finals["bad"].error
    assert bad is not None
    assert bad.param == "model"
    assert str(bad_files["narrow"]) in bad.message
    # bad evicted ink (the least recently used) on both sides, then failed: neon alone.
    assert held == [NEON]
    assert mirrored == held
