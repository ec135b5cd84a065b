"""Step caching in a family's DiT (diffusers' TaylorSeer hooks, per request): the off tier
is the uncached pipeline, byte for byte; a tier computes the steps its schedule says and
no others, and its image stays near the uncached one; a transformer is left as loaded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
from omni_runtime.diffusion.step_cache import StepCacheTier, computed_steps
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest as Request
from omni_runtime.tiny_models import DIFFUSION_SUBDIR, QWEN_IMAGE_SUBDIR, Z_IMAGE_SUBDIR

pytestmark = pytest.mark.integration

STEPS = 12
TIERS = {
    "fast": StepCacheTier(interval=2, warmup_steps=2),
    "coarse": StepCacheTier(interval=3, warmup_steps=2, cooldown_steps=1, max_order=0),
}
# family -> (checkpoint, a module each computed step runs once per denoiser call, the
# denoiser calls per step with guidance on: Qwen-Image runs its two branches apart, Z-Image
# batches them)
FAMILIES = {
    "qwen-image": (QWEN_IMAGE_SUBDIR, "transformer_blocks.0.attn", 2),
    "z-image": (Z_IMAGE_SUBDIR, "layers.0.attention", 1),
}
# PSNR (dB) of each tier's image against the uncached one on the tiny random weights, at
# least (measured here: qwen-image 59.8 / 55.2, z-image 34.6 / 33.4); random weights
# change more from step to step than trained ones, so these are floors of the machinery,
# not of the quality on a real checkpoint.
PSNR_FLOOR = {
    ("qwen-image", "fast"): 50.0,
    ("qwen-image", "coarse"): 45.0,
    ("z-image", "fast"): 30.0,
    ("z-image", "coarse"): 28.0,
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def cached(tiny_models: Path, family: str) -> DiffusionEngine:
    subdir = FAMILIES[family][0]
    config = DiffusionEngineConfig(
        model=str(tiny_models / subdir), family=family, step_cache_tiers=TIERS
    )
    return DiffusionEngine(config)


def run(dit: DiffusionEngine, **params: Any) -> np.ndarray:
    request = Request(
        request_id=f"r-{len(params)}-{sorted(params.items())}",
        prompt="a red fox in the snow",
        params={
            "num_inference_steps": STEPS,
            "height": 64,
            "width": 64,
            "seed": 7,
            "negative_prompt": "blurry",
            **params,
        },
    )
    dit.admit(request.request_id)
    output = dit.execute(request)
    assert output.error is None, output.error
    assert output.images is not None
    return output.images


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture
def denoiser_calls(cached: DiffusionEngine, family: str) -> Iterator[list[int]]:
    """Counts the calls of a module that runs only on computed steps."""
    module = dict(cached.pipeline.transformer.named_modules())[FAMILIES[family][1]]
    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    handle = module.register_forward_hook(count)
    yield calls
    handle.remove()


def test_off_is_the_uncached_pipeline_byte_for_byte(
    tiny_models: Path, family: str, cached: DiffusionEngine
) -> None:
    plain = DiffusionEngine(
        DiffusionEngineConfig(model=str(tiny_models / FAMILIES[family][0]), family=family)
    )
    expected = run(plain)
    assert np.array_equal(run(cached, step_cache="off"), expected)
    # The stage's default tier is off: a request that names none is uncached too.
    assert np.array_equal(run(cached), expected)
    # A cached run leaves the transformer as it was loaded.
    run(cached, step_cache="fast")
    assert np.array_equal(run(cached, step_cache="off"), expected)


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_a_tier_computes_its_schedules_steps_and_stays_near(
    family: str, cached: DiffusionEngine, denoiser_calls: list[int], tier: str
) -> None:
    per_step = FAMILIES[family][2]
    uncached = run(cached, step_cache="off")
    assert denoiser_calls[0] == STEPS * per_step
    denoiser_calls[0] = 0
    image = run(cached, step_cache=tier)
    schedule = computed_steps(TIERS[tier], STEPS)
    assert len(schedule) < STEPS
    assert denoiser_calls[0] == len(schedule) * per_step
    assert psnr(image, uncached) >= PSNR_FLOOR[(family, tier)]
    # The schedule is fixed, so a cached image is the same every time.
    assert np.array_equal(run(cached, step_cache=tier), image)


def test_a_tier_the_stage_lacks_is_refused_by_name(cached: DiffusionEngine) -> None:
    request = Request(request_id="bad-tier", prompt="x", params={"step_cache": "faster"})
    cached.admit(request.request_id)
    error = cached.execute(request).error
    assert error is not None
    assert error.param == "step_cache"
    assert error.message == (
        "step_cache: 'faster' is not a tier of this stage; tiers: off, fast, coarse"
    )


# Only Z-Image's pipeline stops guiding part way (cfg_truncation).
@pytest.mark.parametrize("family", ["z-image"], indirect=True)
def test_guidance_that_stops_part_way_is_refused_with_a_tier(cached: DiffusionEngine) -> None:
    request = Request(
        request_id="truncated", prompt="x", params={"step_cache": "fast", "cfg_truncation": 0.5}
    )
    cached.admit(request.request_id)
    error = cached.execute(request).error
    assert error is not None
    assert error.param == "step_cache"
    assert "cfg_truncation below 1" in error.message


def test_a_stage_default_tier_applies_to_requests_naming_none(tiny_models: Path) -> None:
    config = DiffusionEngineConfig(
        model=str(tiny_models / QWEN_IMAGE_SUBDIR),
        family="qwen-image",
        step_cache_tiers=TIERS,
        step_cache_default="fast",
    )
    dit = DiffusionEngine(config)
    assert np.array_equal(run(dit), run(dit, step_cache="fast"))
    assert not np.array_equal(run(dit), run(dit, step_cache="off"))


def test_a_pipeline_of_no_family_takes_no_step_cache(tiny_models: Path) -> None:
    config = DiffusionEngineConfig(
        model=str(tiny_models / DIFFUSION_SUBDIR), step_cache_tiers=TIERS
    )
    with pytest.raises(ValueError, match=r"stepCache: .* takes no step cache"):
        DiffusionEngine(config)
