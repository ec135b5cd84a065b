"""Video: the tiny Wan2.2 served as a stage, and OpenAI's Videos API over it.

The DiT stage's frames equal diffusers' own WanPipeline (and WanImageToVideoPipeline) for
the same weights, prompt, seed, steps, size and frames; through a real router and a real
stage process, the official client's videos.create_and_poll, retrieve, list,
download_content and delete work as OpenAI's API defines them; a deleted job is aborted in
the DiT; a router that stops mid-job gives it back and another replica of the router
(sharing the job store) finishes it; bad requests are 4xx naming the field.
"""

from __future__ import annotations

import io
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
import openai
import pytest
import torch
import yaml
from PIL import Image
from serving import (
    CLI,
    RunningRouter,
    StageProcess,
    pipeline_from,
    running_router,
    start_stage_processes,
    wait_until,
)

from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreOutput
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest as Request
from omni_runtime.images import encode_png, to_uint8
from omni_runtime.tiny_models import WAN_SUBDIR
from omni_testkit.port_leases import lease_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DIT = 0
# The tiny clip: 5 frames of 32x64 (Wan's smallest multiples), 4 steps.
CLIP = {"num_inference_steps": 4, "height": 32, "width": 64, "num_frames": 5, "seed": 3}
# A clip that takes the tiny DiT tens of seconds (a second every 7 steps or so here), for
# jobs that must still run when the test acts on them.
LONG = {"size": "256x256", "num_frames": 33, "num_inference_steps": 200}


def picture(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (48, 40, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def checkpoint(tiny_models: Path) -> Path:
    return tiny_models / WAN_SUBDIR


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> DiffusionEngine:
    return DiffusionEngine(DiffusionEngineConfig(model=str(checkpoint), family="wan2.2"))


def frames_of(engine: DiffusionEngine, name: str, **extra: Any) -> np.ndarray:
    extra.setdefault("params", CLIP)
    request = Request(request_id=name, prompt="a red fox in the snow", **extra)
    engine.admit(name)
    output = engine.execute(request)
    assert output.error is None, output.error
    assert output.images is not None
    return output.images


def test_the_stages_frames_are_diffusers_own(engine: DiffusionEngine, checkpoint: Path) -> None:
    from diffusers import WanImageToVideoPipeline, WanPipeline

    pipe = WanPipeline.from_pretrained(str(checkpoint))
    pipe.set_progress_bar_config(disable=True)
    call = {k: v for k, v in CLIP.items() if k != "seed"}

    def reference(pipeline: Any, **more: Any) -> np.ndarray:
        result = pipeline(
            prompt="a red fox in the snow",
            generator=torch.Generator("cpu").manual_seed(CLIP["seed"]),
            output_type="np",
            **call,
            **more,
        )
        return to_uint8(result.frames[0])

    text = frames_of(engine, "t2v")
    assert text.shape == (5, 32, 64, 3)
    assert np.array_equal(text, reference(pipe))
    image = picture(1)
    started = frames_of(engine, "i2v", images=[image])
    i2v = WanImageToVideoPipeline.from_pipe(pipe)
    assert np.array_equal(started, reference(i2v, image=Image.fromarray(image)))
    assert not np.array_equal(started, text)


def test_progress_is_reported_as_the_steps_go(engine: DiffusionEngine) -> None:
    sent: list[StageDiffusionCoreOutput] = []
    request = Request(
        request_id="progress", prompt="a fox", params={**CLIP, "report_progress": True}
    )
    engine.admit(request.request_id)
    final = engine.execute(request, emit=sent.append)
    assert final.images is not None
    # Four steps: a quarter each; 100 is the final output's, not a report's.
    assert [output.progress for output in sent] == [25, 50, 75, 99]
    assert all(not output.final for output in sent)


def test_a_video_request_makes_one_video(engine: DiffusionEngine) -> None:
    engine.admit("two")
    output = engine.execute(Request(request_id="two", prompt="a fox", params={"num_images": 2}))
    assert output.error is not None
    assert output.error.param == "num_images"


# -- through the router, with the official client --------------------------------------


@pytest.fixture(scope="module")
def config(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], Path]:
    data = yaml.safe_load((REPO / "examples" / "tiny-wan.yaml").read_text())
    data["model"] = str(checkpoint)
    path = tmp_path_factory.mktemp("videos") / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data))
    return data, path


@pytest.fixture(scope="module")
def stage(config: tuple[dict[str, Any], Path]) -> Iterator[StageProcess]:
    _, path = config
    (proc,) = start_stage_processes(path, [DIT], path.parent)
    try:
        yield proc
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, proc.log.read_text()[-2000:]


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("video-jobs")


@pytest.fixture(scope="module")
def router(
    config: tuple[dict[str, Any], Path], stage: StageProcess, state_dir: Path
) -> Iterator[RunningRouter]:
    data, _ = config
    with running_router(pipeline_from(data), {DIT: [stage.address]}, state_dir=state_dir) as r:
        yield r


@pytest.fixture(scope="module")
def client(router: RunningRouter) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key="unused", timeout=60)


def decoded(mp4: bytes) -> tuple[list[np.ndarray], float]:
    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate or 0)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return frames, rate


def test_create_poll_download_and_delete(client: openai.OpenAI) -> None:
    video = client.videos.create_and_poll(
        prompt="a red fox in the snow",
        size="64x32",  # type: ignore[arg-type]
        extra_body={"num_frames": 5, "num_inference_steps": 4, "seed": 3},
        poll_interval_ms=100,
    )
    assert video.status == "completed", video.error
    assert video.object == "video"
    assert video.progress == 100
    assert video.size == "64x32"
    assert video.model == "tiny-wan"
    assert video.seconds == f"{5 / 24:g}"
    assert video.completed_at is not None
    assert video.expires_at == video.completed_at + 3600
    content = client.videos.download_content(video.id).read()
    frames, rate = decoded(content)
    assert len(frames) == 5
    assert frames[0].shape == (32, 64, 3)
    assert rate == 24
    assert client.videos.retrieve(video.id).status == "completed"
    listed = client.videos.list(order="asc")
    assert video.id in [v.id for v in listed.data]
    deleted = client.videos.delete(video.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def test_the_mp4_holds_the_stages_frames(client: openai.OpenAI, engine: DiffusionEngine) -> None:
    video = client.videos.create_and_poll(
        prompt="a red fox in the snow",
        size="64x32",  # type: ignore[arg-type]
        extra_body={"num_frames": 5, "num_inference_steps": 4, "seed": 3},
        poll_interval_ms=100,
    )
    frames, _ = decoded(client.videos.download_content(video.id).read())
    expected = frames_of(engine, "mp4")
    other = frames_of(engine, "other", params={**CLIP, "seed": 4})

    def luma(frames: np.ndarray) -> np.ndarray:
        return frames.astype(np.float64) @ np.array([0.299, 0.587, 0.114])

    # H.264 at CRF 18 keeps luma close; 4:2:0 halves chroma, which random weights' noise
    # lives in, so colour is compared through luma only.
    error = np.abs(luma(np.stack(frames)) - luma(expected)).mean()
    apart = np.abs(luma(other) - luma(expected)).mean()
    assert error < apart / 3, (error, apart)


def test_image_to_video_takes_the_input_reference(client: openai.OpenAI) -> None:
    videos = []
    for seed in (1, 2):
        video = client.videos.create_and_poll(
            prompt="a fox",
            size="64x32",  # type: ignore[arg-type]
            input_reference=("start.png", encode_png(picture(seed)), "image/png"),
            extra_body={"num_frames": 5, "num_inference_steps": 2, "seed": 3},
            poll_interval_ms=100,
        )
        assert video.status == "completed", video.error
        videos.append(decoded(client.videos.download_content(video.id).read())[0][0])
    assert not np.array_equal(videos[0], videos[1])


def test_pages_of_jobs(client: openai.OpenAI) -> None:
    ids = [
        client.videos.create(
            prompt=f"clip {n}", extra_body={"num_frames": 5, "num_inference_steps": 1}
        ).id
        for n in range(3)
    ]
    first = client.videos.list(limit=2, order="desc")
    assert len(first.data) == 2
    assert first.has_more
    seen = [v.id for v in client.videos.list(order="desc").data]
    assert seen.index(ids[2]) < seen.index(ids[1]) < seen.index(ids[0])
    after = client.videos.list(after=ids[1], order="asc", limit=100)
    assert ids[2] in [v.id for v in after.data]
    assert ids[0] not in [v.id for v in after.data]
    for video_id in ids:
        wait_until(
            lambda video_id=video_id: client.videos.retrieve(video_id).status == "completed",
            60,
            f"{video_id} completed",
        )


def test_deleting_a_running_job_aborts_it_in_the_dit(
    client: openai.OpenAI, router: RunningRouter
) -> None:
    pool = router.state.pools[DIT]
    aborted_before = sum(s.aborted for s in pool.stats())
    video = client.videos.create(prompt="a long clip", extra_body=LONG)
    wait_until(lambda: client.videos.retrieve(video.id).progress > 0, 60, "the job under way")
    client.videos.delete(video.id)
    wait_until(lambda: pool.in_flight == 0, 30, "the DiT freed")
    assert sum(s.aborted for s in pool.stats()) == aborted_before + 1
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def test_a_router_that_stops_hands_its_job_to_another(
    config: tuple[dict[str, Any], Path], stage: StageProcess, state_dir: Path
) -> None:
    data, _ = config
    pipeline = pipeline_from(data)
    with running_router(pipeline, {DIT: [stage.address]}, state_dir=state_dir) as first:
        http = httpx.Client(base_url=first.base_url, timeout=30)
        created = http.post(
            "/videos",
            json={"prompt": "handed over", **LONG, "num_inference_steps": 40},
        ).json()
        wait_until(
            lambda: http.get(f"/videos/{created['id']}").json()["progress"] > 0,
            60,
            "the job under way on the first router",
        )
    # The first router is gone; a second one, on the same store, takes the job back up.
    with running_router(pipeline, {DIT: [stage.address]}, state_dir=state_dir) as second:
        http = httpx.Client(base_url=second.base_url, timeout=30)
        assert_finished_with_33_frames(http, created["id"], "the second router")


def test_a_killed_routers_job_is_run_again_by_another(
    config: tuple[dict[str, Any], Path], stage: StageProcess, tmp_path: Path
) -> None:
    """A router process killed outright (SIGKILL: no time to give its job back): once its
    lease lapses, another router on the same store runs the job again, from the first
    stage, and finishes it."""
    data, path = config
    state = tmp_path / "jobs"
    port = lease_port()
    log = tmp_path / "router.log"
    with open(log, "wb") as out:
        killed = subprocess.Popen(
            [
                *CLI, "router", "-f", str(path),
                "--replicas", f"{DIT}={stage.address}",
                "--host", "127.0.0.1", "--port", str(port),
                "--state-dir", str(state),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=30)

        def serving() -> bool:
            assert killed.poll() is None, log.read_text()[-3000:]
            try:
                return http.get("/models").status_code == 200 and _health_ok(port)
            except httpx.TransportError:
                return False

        wait_until(serving, 120, "the router process serving", interval=0.2)
        created = http.post(
            "/videos", json={"prompt": "killed", **LONG, "num_inference_steps": 40}
        ).json()
        wait_until(
            lambda: http.get(f"/videos/{created['id']}").json()["progress"] > 0,
            60,
            "the job under way on the router process",
        )
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    with running_router(pipeline_from(data), {DIT: [stage.address]}, state_dir=state) as other:
        http = httpx.Client(base_url=other.base_url, timeout=30)
        # Its lease (15 s) lapses, the other router takes it: its second attempt.
        assert_finished_with_33_frames(http, created["id"], "the other router")


def assert_finished_with_33_frames(http: httpx.Client, job_id: str, where: str) -> None:
    """The job (a LONG clip of 40 steps) completes on ``where``, and its MP4 holds its
    frames."""
    done = wait_until(
        lambda: (
            (job := http.get(f"/videos/{job_id}").json())["status"] in ("completed", "failed")
            and job
        ),
        120,
        f"the job finished on {where}",
    )
    assert done["status"] == "completed", done["error"]
    frames, _ = decoded(http.get(f"/videos/{job_id}/content").content)
    assert len(frames) == 33


def _health_ok(port: int) -> bool:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"seconds": "soon"}, 400, "seconds"),
        ({"seconds": "-4"}, 400, "seconds"),
        ({"num_frames": 6}, 400, "num_frames"),
        ({"num_frames": 9999}, 400, "num_frames"),
        ({"size": "64"}, 400, "size"),
        # Not a multiple of the DiT's 32 (which the replica reports: refused at creation,
        # not found when the job runs).
        ({"size": "7x9"}, 400, "size"),
        ({"size": "96x48"}, 400, "size"),
        ({"model": "sora-2"}, 404, "model"),
        ({"num_inference_steps": 0}, 400, "num_inference_steps"),
        ({"resolution": "720p"}, 400, "resolution"),
    ],
)
def test_bad_requests_name_the_field(
    router: RunningRouter, fields: dict[str, Any], status: int, param: str
) -> None:
    answer = httpx.post(f"{router.base_url}/videos", json={"prompt": "a fox", **fields}, timeout=30)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param


def test_a_size_the_dit_cannot_make_is_refused_at_creation(router: RunningRouter) -> None:
    answer = httpx.post(
        f"{router.base_url}/videos", json={"prompt": "a fox", "size": "7x9"}, timeout=30
    )
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert "multiples of 32" in message, message
    assert "32x32" in message, message


def test_a_bad_size_is_refused_while_the_dit_is_busy(
    config: tuple[dict[str, Any], Path],
    stage: StageProcess,
    router: RunningRouter,
    client: openai.OpenAI,
    tmp_path: Path,
) -> None:
    """A router that has never asked the DiT anything refuses a size it cannot make while
    the DiT runs a clip (and so answers no describe() until the clip ends): the replica's
    reports (StageLoad) carry its multiple from the moment it is connected."""
    data, _ = config
    pool = router.state.pools[DIT]
    busy = client.videos.create(prompt="a long clip", extra_body=LONG)
    try:
        wait_until(lambda: client.videos.retrieve(busy.id).progress > 0, 60, "the DiT busy")
        # A store of its own: this router takes none of the other's jobs.
        with running_router(
            pipeline_from(data), {DIT: [stage.address]}, state_dir=tmp_path
        ) as fresh:
            answer = httpx.post(
                f"{fresh.base_url}/videos", json={"prompt": "a fox", "size": "7x9"}, timeout=30
            )
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == "size"
            assert "multiples of 32" in error["message"], error
            assert "such as 32x32" in error["message"], error
            assert fresh.state.pools[DIT].size_multiples() == {32}
        # The clip ran all along: the refusal did not wait for it.
        assert client.videos.retrieve(busy.id).status == "in_progress"
    finally:
        client.videos.delete(busy.id)
        wait_until(lambda: pool.in_flight == 0, 30, "the DiT freed")


def test_before_any_replica_connects_a_size_is_left_to_the_stage(
    config: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    """With no DiT replica connected the router cannot know the multiple: the job is taken
    and queued (it would wait for a replica anyway), and the stage checks its size when it
    runs, as router.endpoints.videos documents."""
    data, _ = config
    # Leased: nothing listens there, and nothing else will.
    nowhere = f"127.0.0.1:{lease_port()}"
    with running_router(
        pipeline_from(data), {DIT: [nowhere]}, state_dir=tmp_path, wait_for_replicas=False
    ) as lonely:
        assert lonely.state.pools[DIT].live_replica_count == 0
        answer = httpx.post(
            f"{lonely.base_url}/videos", json={"prompt": "a fox", "size": "7x9"}, timeout=30
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["status"] == "queued"
        assert answer.json()["size"] == "7x9"


def test_a_replica_that_reports_no_multiple_is_asked_for_it(
    config: tuple[dict[str, Any], Path], checkpoint: Path, tmp_path: Path
) -> None:
    """A replica that says nothing of its multiple (one of a revision before
    StageLoad.size_multiple; here an in-process DiT, which makes no reports at all) leaves
    the router to ask its describe(), as it did before the reports carried it."""
    from fastapi.testclient import TestClient

    from omni_runtime.diffusion.stage.inline_stage_diffusion_client import (
        InlineStageDiffusionClient,
    )
    from omni_runtime.router.app import create_app
    from omni_runtime.router.stage_replica_pool import StageReplicaPool

    data, _ = config
    pool = StageReplicaPool("dit", "round-robin")
    pool.add_replica(
        InlineStageDiffusionClient(DiffusionEngineConfig(model=str(checkpoint), family="wan2.2"))
    )
    with TestClient(create_app(pipeline_from(data), {DIT: pool}, state_dir=tmp_path)) as http:
        assert pool.size_multiples() == set()
        refused = http.post("/v1/videos", json={"prompt": "a fox", "size": "7x9"})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "size"
        assert "multiples of 32" in refused.json()["error"]["message"]


def test_an_input_reference_that_is_no_image_is_refused(router: RunningRouter) -> None:
    answer = httpx.post(
        f"{router.base_url}/videos",
        data={"prompt": "a fox"},
        files={"input_reference": ("start.png", b"not an image", "image/png")},
        timeout=30,
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "input_reference"


def test_content_before_completion_and_unknown_jobs(
    client: openai.OpenAI, router: RunningRouter
) -> None:
    video = client.videos.create(prompt="slow", extra_body=LONG)
    early = httpx.get(f"{router.base_url}/videos/{video.id}/content", timeout=30)
    assert early.status_code == 409, early.text
    client.videos.delete(video.id)
    missing = httpx.get(f"{router.base_url}/videos/video_{'0' * 32}", timeout=30)
    assert missing.status_code == 404
    assert "no video" in missing.json()["error"]["message"]
