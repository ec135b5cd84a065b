"""The router's OpenAPI document, fuzzed: schemathesis (`schemathesis run`, every check)
against a router serving real stage processes: the tiny chat LLM (a text pipeline), the
tiny Z-Image and Qwen-Image split across a vLLM encoder and a diffusers DiT (image
pipelines, whose documents list their families' own fields), the tiny BAGEL (its thinker
and its own DiT: text to image and edits), the tiny Qwen-Image-Edit-Plus (an edit
pipeline: up to three input images by chat and by /v1/images/edits' form, no generations),
the tiny Wan2.2 and HunyuanVideo-1.5 image-to-video (the Videos API; the latter's every job
from an input image).

Besides schemathesis' own checks (no 5xx, every status and content type documented,
responses valid by their schemas, valid requests accepted and invalid ones refused,
methods a path does not take answered 405), openapi_fuzz_hooks.py checks that every error
is OpenAI-shaped. Afterwards no request may be left in flight, in the router or a stage.

The router runs with limits far below the defaults, which the document states: so a valid
request generated at a limit (the longest prompt, the most tokens, the largest image, the
most steps) stays quick on a CPU and fits the tiny models' 512-token context.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from serving import RunningRouter, pipeline_from, running_router, start_stage_processes, wait_until

from omni_runtime.config import PipelineConfig, dump_pipeline
from omni_runtime.router.limits import RouterLimits
from omni_runtime.tiny_models import (
    BAGEL_SUBDIR,
    HUNYUAN_VIDEO_I2V_SUBDIR,
    LLM_SUBDIR,
    QWEN_IMAGE_EDIT_PLUS_SUBDIR,
    QWEN_IMAGE_SUBDIR,
    WAN_SUBDIR,
    Z_IMAGE_SUBDIR,
)
from omni_runtime.tiny_models._common import VOCAB_SIZE

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
HOOKS = Path(__file__).with_name("openapi_fuzz_hooks.py")
CONFIG = Path(__file__).with_name("schemathesis.toml")
# 64 characters are at most 256 byte-level tokens; with MAX_MESSAGES messages' template
# tokens, a prompt stays well inside the 512-token context (a generated token needs one).
MAX_MESSAGES = 16
# A fixed seed: the same cases every run, so that a failure is the router's and can be
# replayed. Another seed explores further (schemathesis run --seed, by hand).
SEED = 20261202


@dataclass(frozen=True)
class Fuzzed:
    """A pipeline the fuzz runs against, and how hard."""

    name: str
    limits: RouterLimits
    # Per operation and phase; RUN_TIMEOUT bounds a run that would hang.
    max_examples: int
    run_timeout: int
    # The operations that must have answered both a 200 and a 400.
    answered: tuple[str, ...]
    # Heights and widths the DiT makes (a rule of its loaded pipeline, which the router
    # does not know): 1 for none.
    size_multiple: int = 1
    # The most input images a valid fuzzed request carries (within its family's).
    max_images: int = 0
    # The schemathesis phases that run (None: all).
    phases: str | None = None


TEXT = Fuzzed(
    name="text",
    limits=RouterLimits(max_prompt_chars=64, max_tokens=16, max_n=2, max_steps=2),
    # About 500 requests, which take 20-40 s on two cores (the stage's start, about 30 s
    # more).
    max_examples=200,
    run_timeout=180,
    answered=("POST /v1/chat/completions",),
)
Z_IMAGE = Fuzzed(
    name="z-image",
    # At most 2 images of 64x64 in 2 steps (4, the example's default, when none is asked):
    # an image request takes a fraction of a second on two cores (the encoder's prompt and
    # negative prompt, then the DiT). About 650 requests, which take 20-40 s (the stages'
    # start, about 30 s more).
    limits=RouterLimits(
        max_prompt_chars=64, max_tokens=16, max_n=2, max_steps=2, max_image_side=64
    ),
    max_examples=50,
    run_timeout=300,
    answered=("POST /v1/chat/completions", "POST /v1/images/generations"),
    # The tiny Z-Image's image processor's: its VAE's 8 times its transformer's patch of 2
    # (tests/integration/test_family_dit.py sees 72 refused).
    size_multiple=16,
)


IMAGE_LIMITS = RouterLimits(
    max_prompt_chars=64, max_tokens=16, max_n=2, max_steps=2, max_image_side=64
)
QWEN_IMAGE = Fuzzed(
    name="qwen-image",
    limits=IMAGE_LIMITS,
    max_examples=50,
    run_timeout=300,
    answered=("POST /v1/chat/completions", "POST /v1/images/generations"),
    size_multiple=16,
)
# BAGEL: its thinker and DiT (two contexts' KV through shared memory; an edit's third),
# text to image and edits (one image) by chat, generations and edits.
BAGEL = Fuzzed(
    name="bagel",
    limits=IMAGE_LIMITS,
    max_examples=30,
    run_timeout=420,
    answered=(
        "POST /v1/chat/completions",
        "POST /v1/images/generations",
        "POST /v1/images/edits",
    ),
    size_multiple=16,
    max_images=1,
)
EDIT_PLUS = Fuzzed(
    name="qwen-image-edit-plus",
    # One image of 64x64 at most, in one step (the fuzz pipeline's default too), from one
    # input image (of the three the family takes, which test_family_pipelines covers):
    # its DiT reads each input image at ~1024x1024, 2.5 s a request on two cores.
    limits=RouterLimits(
        max_prompt_chars=64, max_tokens=16, max_n=1, max_steps=1, max_image_side=64
    ),
    max_examples=15,
    run_timeout=300,
    answered=("POST /v1/chat/completions", "POST /v1/images/edits"),
    size_multiple=16,
    max_images=1,
    # Not the coverage phase: its ~110 valid chat completions take 7 minutes here.
    phases="examples,fuzzing",
)
# Wan2.2 (one DiT stage making videos): the Videos API, jobs of at most 9 frames of 64x64
# in 2 steps (a fraction of a second each), 4 active at once: past them a 429, and what
# the run queued drains within seconds of its end.
WAN = Fuzzed(
    name="wan",
    limits=RouterLimits(
        max_prompt_chars=64, max_tokens=16, max_n=1, max_steps=2, max_image_side=64,
        max_video_frames=9,
    ),
    max_examples=30,
    run_timeout=300,
    answered=("POST /v1/videos",),
    size_multiple=32,
    max_images=1,
)  # fmt: skip
# HunyuanVideo-1.5's image-to-video (its encoder on vLLM, its DiT on diffusers): every job
# needs its input_reference (a multipart form alone) and takes no size; at most 9 frames of
# the image's bucket around the tiny transformer's 32 px, in 2 steps.
HUNYUAN_VIDEO_I2V = Fuzzed(
    name="hunyuan-video-i2v",
    limits=RouterLimits(
        max_prompt_chars=64, max_tokens=16, max_n=1, max_steps=2, max_image_side=64,
        max_video_frames=9,
    ),
    max_examples=20,
    run_timeout=300,
    answered=("POST /v1/videos",),
    size_multiple=16,
    max_images=1,
)  # fmt: skip
FUZZED = {
    fuzzed.name: fuzzed
    for fuzzed in (TEXT, Z_IMAGE, QWEN_IMAGE, BAGEL, EDIT_PLUS, WAN, HUNYUAN_VIDEO_I2V)
}
SUBDIRS = {
    WAN.name: WAN_SUBDIR,
    HUNYUAN_VIDEO_I2V.name: HUNYUAN_VIDEO_I2V_SUBDIR,
    Z_IMAGE.name: Z_IMAGE_SUBDIR,
    QWEN_IMAGE.name: QWEN_IMAGE_SUBDIR,
    BAGEL.name: BAGEL_SUBDIR,
    EDIT_PLUS.name: QWEN_IMAGE_EDIT_PLUS_SUBDIR,
}


def _text_pipeline(tiny_models: Path) -> PipelineConfig:
    return pipeline_from(
        {
            "model": str(tiny_models / LLM_SUBDIR),
            "stages": [
                {
                    "stageId": 0,
                    "name": "chat",
                    "type": "llm",
                    "dtype": "float32",
                    "enforceEager": True,
                    "maxModelLen": 512,
                }
            ],
            "router": {"servedModelName": "tiny-chat"},
        }
    )


def _example_pipeline(name: str, tiny_models: Path, subdir: str, steps: int) -> PipelineConfig:
    """examples/tiny-<name>.yaml: its encoder on vLLM, its DiT on diffusers, ``steps``
    denoising steps unless a request asks for others."""
    data = yaml.safe_load((REPO / "examples" / f"tiny-{name}.yaml").read_text())
    data["model"] = str(tiny_models / subdir)
    data["stages"][-1]["defaultSamplingParams"]["num_inference_steps"] = steps
    if "videos" in data.get("router", {}):
        data["router"]["videos"]["maxActiveJobs"] = 4
    return pipeline_from(data)


def _pipeline(fuzzed: Fuzzed, tiny_models: Path) -> PipelineConfig:
    if fuzzed is TEXT:
        return _text_pipeline(tiny_models)
    # As few steps as each DiT takes by default, where a request asks for none (Z-Image's
    # example's 4 as it was).
    steps = {Z_IMAGE.name: 4, BAGEL.name: 2}.get(fuzzed.name, 1)
    return _example_pipeline(fuzzed.name, tiny_models, SUBDIRS[fuzzed.name], steps)


@pytest.fixture(scope="module", params=list(FUZZED.values()), ids=lambda fuzzed: fuzzed.name)
def router(
    request: pytest.FixtureRequest, tiny_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Fuzzed, RunningRouter]]:
    fuzzed: Fuzzed = request.param
    workdir = tmp_path_factory.mktemp(f"openapi-fuzz-{fuzzed.name}")
    pipeline = _pipeline(fuzzed, tiny_models)
    config = workdir / "pipeline.json"
    config.write_text(json.dumps(dump_pipeline(pipeline)))
    stage_ids = [stage.stage_id for stage in pipeline.stages]
    stages = start_stage_processes(config, stage_ids, workdir)
    try:
        addresses = {stage.stage_id: [stage.address] for stage in stages}
        with running_router(
            pipeline, addresses, limits=fuzzed.limits, state_dir=workdir / "videos"
        ) as running:
            yield fuzzed, running
    finally:
        for stage in stages:
            stage.stop()
    for stage in stages:
        assert stage.proc.returncode == 0, stage.log.read_text()[-2000:]


@pytest.mark.timeout(660)
def test_schemathesis_finds_nothing(
    router: tuple[Fuzzed, RunningRouter],
    tmp_path: Path,
    record_property: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fuzzed, running = router
    limits = fuzzed.limits
    har = tmp_path / "run.har"
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG),
        "run", f"{running.url}/openapi.json",
        "--checks", "all",
        "--max-examples", str(fuzzed.max_examples),
        "--seed", str(SEED),
        "--workers", "1",
        "--generation-database", "none",
        "--request-timeout", "60",
        # A slow answer is not what this looks for (a hang is, at the request timeout):
        # an edit on two cores shared with the other test session takes 3 to 13 s.
        "--max-response-time", "60",
        "--report", "har", "--report-har-path", str(har),
        "--no-color",
        *(["--phases", fuzzed.phases] if fuzzed.phases else []),
    ]  # fmt: skip
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": str(HOOKS),
        "FUZZ_MAX_PROMPT_CHARS": str(limits.max_prompt_chars),
        "FUZZ_MAX_MESSAGES": str(MAX_MESSAGES),
        "FUZZ_VOCAB_SIZE": str(VOCAB_SIZE),
        "FUZZ_MAX_TOKENS": str(limits.max_tokens),
        "FUZZ_SIZE_MULTIPLE": str(fuzzed.size_multiple),
        "FUZZ_MAX_IMAGES": str(fuzzed.max_images),
        "FUZZ_PIPELINE": fuzzed.name,
        "FUZZ_MAX_VIDEO_FRAMES": str(limits.max_video_frames),
    }
    start = time.monotonic()
    run = subprocess.run(
        command,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=fuzzed.run_timeout,
        check=False,
    )
    elapsed = time.monotonic() - start
    document = httpx.get(f"{running.url}/openapi.json", timeout=10).json()
    counts, streams = _counts(har, document)
    summary = (
        f"schemathesis ({fuzzed.name}): {sum(counts['total'].values())} requests in "
        f"{elapsed:.0f} s "
        f"({streams} streamed); "
        + "; ".join(
            f"{operation}: {dict(sorted(statuses.items()))}"
            for operation, statuses in sorted(counts.items())
        )
    )
    # On the terminal whether or not output is captured, and in the JUnit report.
    with capsys.disabled():
        print(f"\n{summary}")
    record_property(f"schemathesis-{fuzzed.name}", summary)
    assert run.returncode == 0, f"{summary}\n{run.stdout[-12000:]}\n{run.stderr[-3000:]}"
    # Each operation was called, and those that run the pipeline were both answered and
    # refused.
    for operation in (*fuzzed.answered, "GET /v1/models", "GET /health"):
        assert counts[operation], f"{operation} was never called: {summary}"
    for operation in fuzzed.answered:
        assert counts[operation][200] > 0, summary
        assert counts[operation][400] > 0, summary
    assert counts["total"][500] == 0, summary
    _wait_for_nothing_in_flight(running)
    assert httpx.get(f"{running.url}/health", timeout=10).status_code == 200


def _counts(har: Path, document: dict[str, Any]) -> tuple[dict[str, collections.Counter[int]], int]:
    """Responses by operation ("METHOD /path"; "other methods" for those a path does not
    take, and "total") and status, from the run's HAR; and how many were event streams."""
    counts: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    streams = 0
    for entry in json.loads(har.read_text())["log"]["entries"]:
        method = entry["request"]["method"]
        path = httpx.URL(entry["request"]["url"]).path
        documented = method.lower() in document["paths"].get(path, {})
        operation = f"{method} {path}" if documented else "other methods"
        status = entry["response"]["status"]
        counts[operation][status] += 1
        counts["total"][status] += 1
        headers = {h["name"].lower(): h["value"] for h in entry["response"]["headers"]}
        streams += headers.get("content-type", "").startswith("text/event-stream")
    return counts, streams


def _wait_for_nothing_in_flight(router: RunningRouter) -> None:
    """Every request the run made has ended in the router and in every stage: the gauges
    /metrics shows come back to 0 (a request ends a moment after its last byte)."""

    def in_flight() -> dict[str, float]:
        text = httpx.get(f"{router.url}/metrics", timeout=10).text
        gauges = {}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith(("omni_router_in_flight", "omni_stage_in_flight")):
                gauges[name] = float(value)
        assert "omni_router_in_flight" in gauges, text
        return gauges

    def settled() -> bool:
        return not any(in_flight().values())

    try:
        wait_until(settled, 30, "no request in flight", interval=0.2)
    except AssertionError:
        raise AssertionError(f"requests left in flight: {in_flight()}") from None
