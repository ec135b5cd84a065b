"""A video job's runs keep their stage requests apart (VideoJobs over a real SQLite store):
a run given back by a router that stops keeps its attempt, and its stage requests may
still be aborting when another router starts it again, so each run's requests have an id
of their own (the stages refuse an id in flight). The stages are a stand-in that records
what they are asked; tests/cluster/test_end_to_end.py runs the same hand-over on real
pods."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from omni_runtime.config import PipelineConfig
from omni_runtime.config.router import VideoJobsConfig
from omni_runtime.families import FAMILIES
from omni_runtime.router.adapters import AdapterCatalog
from omni_runtime.router.endpoints.videos import VideoCreateRequest
from omni_runtime.router.errors import RequestError
from omni_runtime.router.job_store import SqliteJobStore
from omni_runtime.router.limits import RouterLimits
from omni_runtime.router.video_jobs import VideoJobs


class _Stages:
    """What VideoJobs asks of the orchestrator: a revision to serve, and runs that stay
    under way until cancelled (each run's request id recorded)."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.adapters: list[dict[int, Any]] = []
        self.started = asyncio.Event()

    def choose_revision(self) -> str:
        return "r1"

    async def run(self, request: Any, timeout: float) -> AsyncIterator[Any]:
        self.request_ids.append(request.request_id)
        self.adapters.append(request.adapters)
        self.started.set()
        await asyncio.Event().wait()  # under way until its router stops
        yield None  # pragma: no cover


def _jobs(
    store: SqliteJobStore, stages: _Stages, adapters: AdapterCatalog | None = None
) -> VideoJobs:
    recipe = FAMILIES["wan2.2"].dit.video
    assert recipe is not None
    return VideoJobs(
        store,
        stages,  # type: ignore[arg-type]
        VideoJobsConfig(),
        recipe,
        model_name="tiny-wan",
        limits=RouterLimits(),
        adapters=adapters,
    )


def test_a_run_given_back_and_run_again_asks_the_stages_under_a_new_id(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[str], list[str], str]:
        first_stages, second_stages = _Stages(), _Stages()
        first = _jobs(SqliteJobStore(tmp_path), first_stages)
        first.start()
        job = await first.create(VideoCreateRequest(prompt="a fox"), [])
        await asyncio.wait_for(first_stages.started.wait(), 10)
        # The first router stops: its run is cancelled and the job given back.
        await first.close()
        second = _jobs(SqliteJobStore(tmp_path), second_stages)
        second.start()
        await asyncio.wait_for(second_stages.started.wait(), 10)
        await second.close()
        return first_stages.request_ids, second_stages.request_ids, job.id

    first, second, job_id = asyncio.run(scenario())
    assert len(first) == len(second) == 1
    assert first[0].startswith(f"{job_id}-1-")
    # The same attempt (a stop costs none), but a request id of its own.
    assert second[0].startswith(f"{job_id}-1-")
    assert first != second


def test_a_job_naming_an_adapter_runs_with_it(tmp_path: Path) -> None:
    pipeline = PipelineConfig.model_validate(
        {
            "model": "/models/wan2.2",
            "family": "wan2.2",
            "stages": [{"stageId": 0, "name": "dit", "type": "diffusion"}],
            "adapters": [{"name": "ink", "stage": "dit", "source": "/loras/ink.safetensors"}],
        }
    )
    adapters = AdapterCatalog(pipeline, "tiny-wan")

    async def scenario() -> tuple[str, list[dict[int, Any]]]:
        stages = _Stages()
        jobs = _jobs(SqliteJobStore(tmp_path), stages, adapters)
        jobs.start()
        with pytest.raises(RequestError) as unknown:
            await jobs.create(VideoCreateRequest(prompt="a fox", model="tiny-wan:pop"), [])
        assert unknown.value.status == 404
        job = await jobs.create(VideoCreateRequest(prompt="a fox", model="tiny-wan:ink"), [])
        await asyncio.wait_for(stages.started.wait(), 10)
        await jobs.close()
        return job.model, stages.adapters

    model, picked = asyncio.run(scenario())
    # The job says what the caller asked for, and its run carries the DiT's adapter.
    assert model == "tiny-wan:ink"
    assert [{stage: a.name for stage, a in run.items()} for run in picked] == [{0: "ink"}]


def test_a_size_the_dit_cannot_make_is_refused_at_creation(tmp_path: Path) -> None:
    """The DiT's multiple, once a replica says it (router.endpoints.videos reads it from
    the replicas' reports, else asks a describe()), refuses a size at creation; while none
    can say, the stage checks when the job runs."""
    asked: list[int | None] = [None, 32]

    async def size_multiple() -> int | None:
        return asked[0]

    async def scenario() -> tuple[str, str]:
        recipe = FAMILIES["wan2.2"].dit.video
        assert recipe is not None
        jobs = VideoJobs(
            SqliteJobStore(tmp_path),
            _Stages(),  # type: ignore[arg-type]
            VideoJobsConfig(),
            recipe,
            model_name="tiny-wan",
            limits=RouterLimits(),
            size_multiple=size_multiple,
        )
        unknown = await jobs.create(VideoCreateRequest(prompt="a fox", size="7x9"), [])
        asked.pop(0)
        with pytest.raises(RequestError) as refused:
            await jobs.create(VideoCreateRequest(prompt="a fox", size="96x48"), [])
        assert refused.value.param == "size"
        made = await jobs.create(VideoCreateRequest(prompt="a fox", size="96x64"), [])
        await jobs.close()
        return unknown.status, refused.value.message + " / " + made.size

    queued, said = asyncio.run(scenario())
    assert queued == "queued"
    assert "multiples of 32" in said
    assert "such as 96x64" in said
    assert said.endswith("/ 96x64")
