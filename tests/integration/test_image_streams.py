"""Image streams and step caching through a real router and real stage processes (the tiny
Z-Image: its encoder on vLLM, its DiT on diffusers), with OpenAI's official client: partial
images then the image, the same bytes as unstreamed; a client that goes away mid-stream
frees the DiT; a request's step_cache tier."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import yaml
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from serving import (
    RunningRouter,
    StageProcess,
    pipeline_from,
    running_router,
    start_stage_processes,
    wait_until,
)

from omni_runtime.tiny_models import Z_IMAGE_SUBDIR

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ENCODER, DIT = 0, 1
SIZE = "64x64"


@pytest.fixture(scope="module")
def config(
    tiny_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], Path]:
    data = yaml.safe_load((REPO / "examples" / "tiny-z-image.yaml").read_text())
    data["model"] = str(tiny_models / Z_IMAGE_SUBDIR)
    path = tmp_path_factory.mktemp("image-streams") / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data))
    return data, path


@pytest.fixture(scope="module")
def router(config: tuple[dict[str, Any], Path]) -> Iterator[RunningRouter]:
    data, path = config
    procs: list[StageProcess] = start_stage_processes(path, [ENCODER, DIT], path.parent)
    try:
        addresses = {proc.stage_id: [proc.address] for proc in procs}
        with running_router(pipeline_from(data), addresses) as running:
            yield running
    finally:
        for proc in procs:
            proc.stop()
    for proc in procs:
        assert proc.proc.returncode == 0, proc.log.read_text()[-2000:]


@pytest.fixture(scope="module")
def client(router: RunningRouter) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key="unused", timeout=120)


def decoded(b64: str | None) -> np.ndarray:
    assert b64 is not None
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def generate(client: openai.OpenAI, steps: int, **extra: Any) -> np.ndarray:
    answer = client.images.generate(
        prompt="a red fox in the snow",
        size=SIZE,  # type: ignore[arg-type]
        extra_body={"num_inference_steps": steps, "seed": 5, **extra},
    )
    assert answer.data is not None
    return decoded(answer.data[0].b64_json)


def test_a_stream_sends_its_partials_then_the_same_image(client: openai.OpenAI) -> None:
    unstreamed = generate(client, 6)
    events = list(
        client.images.generate(
            prompt="a red fox in the snow",
            size=SIZE,  # type: ignore[arg-type]
            stream=True,
            partial_images=2,
            extra_body={"num_inference_steps": 6, "seed": 5},
        )
    )
    assert [event.type for event in events] == [
        "image_generation.partial_image",
        "image_generation.partial_image",
        "image_generation.completed",
    ]
    partials, completed = events[:-1], events[-1]
    assert [getattr(event, "partial_image_index", None) for event in partials] == [0, 1]
    assert all(event.size == SIZE and event.output_format == "png" for event in events)
    assert np.array_equal(decoded(completed.b64_json), unstreamed)
    # Each partial is an image of the request on its way: the later nearer the end.
    first, second = (decoded(event.b64_json).astype(np.int64) for event in partials)
    assert first.shape == second.shape == unstreamed.shape
    end = unstreamed.astype(np.int64)
    assert np.abs(second - end).mean() < np.abs(first - end).mean()


def test_a_short_request_sends_fewer_partials_than_asked(client: openai.OpenAI) -> None:
    # Four steps leave two between the first and the last: two partials of the three.
    events = list(
        client.images.generate(
            prompt="a fox",
            size=SIZE,  # type: ignore[arg-type]
            stream=True,
            partial_images=3,
            extra_body={"num_inference_steps": 4, "seed": 1},
        )
    )
    assert [event.type for event in events].count("image_generation.partial_image") == 2
    assert events[-1].type == "image_generation.completed"


def test_partials_are_a_streams_and_each_image_completes(client: openai.OpenAI) -> None:
    # Without a stream, partial_images changes nothing: the answer is the image.
    assert np.array_equal(generate(client, 4, partial_images=2), generate(client, 4))
    # Two images: the partials are the first one's, then each image completes.
    events = list(
        client.images.generate(
            prompt="a fox",
            size=SIZE,  # type: ignore[arg-type]
            n=2,
            stream=True,
            partial_images=1,
            extra_body={"num_inference_steps": 4, "seed": 2},
        )
    )
    assert [event.type for event in events] == [
        "image_generation.partial_image",
        "image_generation.completed",
        "image_generation.completed",
    ]
    first, second = (decoded(event.b64_json) for event in events[1:])
    assert not np.array_equal(first, second)


def test_a_chat_completion_refuses_to_stream_its_image(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "a fox"}],
            stream=True,
            extra_body={"modalities": ["image"]},
        )
    assert refused.value.body["param"] == "stream"  # type: ignore[index]


def test_a_client_gone_mid_stream_frees_the_dit(router: RunningRouter) -> None:
    pool = router.state.pools[DIT]
    aborted_before = sum(s.aborted for s in pool.stats())
    body = {
        "prompt": "a long night",
        "size": SIZE,
        "num_inference_steps": 200,
        "stream": True,
        "partial_images": 3,
    }
    with (
        httpx.Client(base_url=router.base_url, timeout=120) as http,
        http.stream("POST", "/images/generations", json=body) as response,
    ):
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:"):
                assert '"image_generation.partial_image"' in line
                break  # and the client goes away, the job 1/4 done
    # Freed well before its 200 steps could have finished.
    wait_until(lambda: pool.in_flight == 0, 30, "the streamed request aborted")
    assert sum(s.aborted for s in pool.stats()) == aborted_before + 1


def test_a_request_picks_its_step_cache_tier(client: openai.OpenAI) -> None:
    exact = generate(client, 8)
    assert np.array_equal(generate(client, 8, step_cache="off"), exact)
    cached = generate(client, 8, step_cache="fast")
    assert not np.array_equal(cached, exact)
    assert np.array_equal(generate(client, 8, step_cache="fast"), cached)
    with pytest.raises(openai.BadRequestError) as refused:
        generate(client, 8, step_cache="fastest")
    assert refused.value.body["param"] == "step_cache"  # type: ignore[index]


def stage_metrics(router: RunningRouter, stage: str) -> dict[str, float]:
    """The router's /metrics samples labelled with ``stage`` (name -> value)."""
    text = httpx.get(f"{router.url}/metrics", timeout=10).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("stage") == stage and set(sample.labels) == {"stage"}
    }


def test_metrics_count_the_dits_work_as_the_planner_reads_it(
    router: RunningRouter, client: openai.OpenAI
) -> None:
    before = stage_metrics(router, "dit").get("omni_stage_work_units_total", 0.0)
    generate(client, 8)
    after = stage_metrics(router, "dit")
    # 8 steps of a 64x64 image: 8 x 64 x 64 / 1024^2 units.
    assert after["omni_stage_work_units_total"] - before == pytest.approx(8 * 64 * 64 / 1024**2)
    assert after["omni_stage_outstanding_work_units"] == 0
    # The DiT replica has run requests: its cost fit is there, and an image costs something.
    cost = after["omni_stage_seconds_per_request"], after["omni_stage_seconds_per_work_unit"]
    assert min(cost) >= 0, cost
    assert max(cost) > 0, cost
