"""The orchestrator's hand-back retries and revision pinning, over fake replicas (the
integration suite shows the same with real stage processes)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fake_replica import FakeReplica
from omni_runtime.config import PipelineConfig
from omni_runtime.connectors import ConnectorHandle
from omni_runtime.engine.stage.stage_core_types import (
    HandOff,
    StageError,
    StageErrorCode,
    StageServerOutput,
    StageServerRequest,
)
from omni_runtime.router.orchestrator import (
    HANDBACK_RETRIES,
    PipelineError,
    PipelineOrchestrator,
    PipelineRequest,
)
from omni_runtime.router.stage_replica_pool import StageReplicaPool

PIPELINE = PipelineConfig.model_validate(
    {"model": "m", "stages": [{"stageId": 0, "name": "dit", "type": "diffusion"}]}
)
DRAINING = StageError(StageErrorCode.DRAINING, "draining")


class DrainingReplica(FakeReplica):
    """Hands every request back, as a draining stage server does, and says it drains."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.is_draining = False

    @property
    def draining(self) -> bool:
        return self.is_draining

    async def add_request_async(self, request: object) -> None:
        await super().add_request_async(request)  # type: ignore[arg-type]
        self.is_draining = True
        self.answer(self.received[-1], error=DRAINING)


class AnsweringReplica(FakeReplica):
    async def add_request_async(self, request: object) -> None:
        await super().add_request_async(request)  # type: ignore[arg-type]
        self.answer(self.received[-1], "image")


def orchestrator(pool: StageReplicaPool) -> tuple[PipelineOrchestrator, list[tuple[str, ...]]]:
    events: list[tuple[str, ...]] = []
    return (
        PipelineOrchestrator(
            PIPELINE,
            {0: pool},
            on_retry=lambda stage, why: events.append(("retry", stage, why)),
            on_served=lambda stage, replica, rev: events.append(("served", str(replica), rev)),
            on_revision=lambda rev: events.append(("revision", rev)),
        ),
        events,
    )


async def test_a_handed_back_request_runs_on_another_replica_of_its_revision() -> None:
    pool = StageReplicaPool("dit")
    draining, other, stranger = DrainingReplica("a"), AnsweringReplica("b"), AnsweringReplica("c")
    pool.add_replica(draining, "a", revision="2-x")
    pool.add_replica(other, "b", revision="2-x")
    pool.add_replica(stranger, "c", revision="1-y")
    run, events = orchestrator(pool)
    outputs = await asyncio.wait_for(run.complete(PipelineRequest("r1", prompt="p")), 5)
    assert outputs[-1].text == "image"
    assert draining.received == ["r1"]
    assert other.received == ["r1"]
    assert stranger.received == []  # an older revision, never mixed in
    assert ("retry", "dit", "handed_back") in events
    assert ("served", "1", "2-x") in events
    assert ("revision", "2-x") in events
    assert pool.live_replica_count == 2  # the draining one takes nothing more


async def test_hand_backs_are_bounded_then_the_request_restarts_then_fails() -> None:
    pool = StageReplicaPool("dit")
    replicas = [DrainingReplica(str(n)) for n in range(HANDBACK_RETRIES + 3)]
    for n, replica in enumerate(replicas):
        pool.add_replica(replica, str(n), revision="1-a")
    # Every replica the pool picks drains at once; none is left to restart on.
    run, events = orchestrator(pool)
    with pytest.raises(PipelineError) as failed:
        await asyncio.wait_for(run.complete(PipelineRequest("r1", prompt="p")), 5)
    assert failed.value.status == 503
    tried = sum(len(r.received) for r in replicas)
    assert tried <= 2 * (HANDBACK_RETRIES + 1)
    assert [e for e in events if e[0] == "revision"] == []


class LostInputReplica(FakeReplica):
    """Cannot fetch the hand-off its request names, as a DiT whose thinker replica went
    away in a rollout before the hidden states were fetched; answers later requests."""

    def __init__(self, name: str, losses: int = 1) -> None:
        super().__init__(name)
        self.losses = losses

    async def add_request_async(self, request: object) -> None:
        await super().add_request_async(request)  # type: ignore[arg-type]
        if self.losses > 0:
            self.losses -= 1
            lost = StageError(
                StageErrorCode.STAGE_FAILED,
                "prompt_embeds: cannot fetch key 'r1': 10.0.0.9:7000 closed the connection",
                "prompt_embeds",
            )
            self.answer(self.received[-1], error=lost)
        else:
            self.answer(self.received[-1], "image")


ENCODER_THEN_DIT = PipelineConfig.model_validate(
    {
        "model": "m",
        "stages": [
            {"stageId": 0, "name": "encoder", "type": "llm", "output": "hidden_states"},
            {"stageId": 1, "name": "dit", "type": "diffusion"},
        ],
    }
)


def encoder_then_dit(dit: FakeReplica) -> tuple[PipelineOrchestrator, list[tuple[str, ...]]]:
    encoder_pool, dit_pool = StageReplicaPool("encoder"), StageReplicaPool("dit")
    encoder_pool.add_replica(EncodingReplica("e"), "e", revision="1-a")
    dit_pool.add_replica(dit, "d", revision="1-a")
    events: list[tuple[str, ...]] = []
    run = PipelineOrchestrator(
        ENCODER_THEN_DIT,
        {0: encoder_pool, 1: dit_pool},
        on_retry=lambda stage, why: events.append(("retry", stage, why)),
    )
    return run, events


async def test_a_lost_hand_off_restarts_the_request_once_then_fails_with_a_503() -> None:
    replica = LostInputReplica("a")
    run, events = encoder_then_dit(replica)
    outputs = await asyncio.wait_for(run.complete(PipelineRequest("r1", prompt="p")), 5)
    assert outputs[-1].text == "image"
    assert len(replica.received) == 2
    assert ("retry", "dit", "input_lost") in events
    # Lost again on the restart: a 503 (try again), never a 500 for a rollout's race.
    run, _ = encoder_then_dit(LostInputReplica("b", losses=2))
    with pytest.raises(PipelineError) as failed:
        await asyncio.wait_for(run.complete(PipelineRequest("r2", prompt="p")), 5)
    assert failed.value.status == 503
    assert "cannot fetch key" in str(failed.value)


class BrokenReplica(FakeReplica):
    async def add_request_async(self, request: object) -> None:
        await super().add_request_async(request)  # type: ignore[arg-type]
        error = StageError(StageErrorCode.STAGE_FAILED, "the engine failed this request")
        self.answer(self.received[-1], error=error)


@pytest.mark.parametrize(
    "replica",
    [
        BrokenReplica("a"),
        # It names prompt_embeds, but the request was given none: the stage broke, nothing
        # handed off was lost.
        LostInputReplica("a"),
    ],
)
async def test_a_stage_failure_that_names_no_hand_off_of_its_request_is_not_retried(
    replica: FakeReplica,
) -> None:
    pool = StageReplicaPool("dit")
    pool.add_replica(replica, "a", revision="1-a")
    run, events = orchestrator(pool)
    with pytest.raises(PipelineError) as failed:
        await asyncio.wait_for(run.complete(PipelineRequest("r1", prompt="p")), 5)
    assert failed.value.status == 500
    assert replica.received == ["r1"]
    assert not [e for e in events if e[0] == "retry"]


async def test_no_complete_revision_is_a_503_saying_so() -> None:
    pool = StageReplicaPool("dit")
    run, _ = orchestrator(pool)
    with pytest.raises(PipelineError, match=r"no live replica for stage\(s\): dit") as failed:
        await asyncio.wait_for(run.complete(PipelineRequest("r1", prompt="p")), 5)
    assert failed.value.status == 503


TWO_STAGES = PipelineConfig.model_validate(
    {
        "model": "m",
        "stages": [
            {"stageId": 0, "name": "thinker", "type": "llm"},
            {"stageId": 1, "name": "dit", "type": "diffusion"},
        ],
    }
)


async def test_a_terminating_replica_serves_only_where_no_revision_is_complete_without_it() -> None:
    # Mid-rollout at one replica per stage: the old DiT's pod is terminating (still
    # serving) and the new DiT is live, but this router has not connected the new thinker.
    thinker, dit = StageReplicaPool("thinker"), StageReplicaPool("dit")
    old_thinker, old_dit, new_dit = (AnsweringReplica(n) for n in ("t1", "d1", "d2"))
    thinker.add_replica(old_thinker, "t1", revision="1-old")
    old_dit_id = dit.add_replica(old_dit, "d1", revision="1-old")
    dit.add_replica(new_dit, "d2", revision="2-new")
    dit.set_terminating(old_dit_id, True)
    run = PipelineOrchestrator(TWO_STAGES, {0: thinker, 1: dit})
    try:
        assert dit.revisions() == {"2-new"}
        assert dit.revisions(terminating=True) == {"1-old", "2-new"}
        outputs = await asyncio.wait_for(run.complete(PipelineRequest("r1", prompt="p")), 5)
        assert outputs[-1].text == "image"
        assert old_thinker.received == ["r1"]
        assert old_dit.received == ["r1"]  # the old revision, whole only with it
        assert new_dit.received == []  # never paired with the old thinker

        # Once the new thinker is live, the new revision is complete without the
        # terminating replica, and takes every request.
        new_thinker = AnsweringReplica("t2")
        thinker.add_replica(new_thinker, "t2", revision="2-new")
        await asyncio.wait_for(run.complete(PipelineRequest("r2", prompt="p")), 5)
        assert (new_thinker.received, new_dit.received) == (["r2"], ["r2"])
        assert old_dit.received == ["r1"]

        # Without it, and with no complete revision at all, the 503 says what is live.
        dit.set_terminating(old_dit_id, False)
        await dit.remove_replica(old_dit_id)
        thinker_ids = {s.address: s.replica_id for s in thinker.stats()}
        await thinker.remove_replica(thinker_ids["t2"])
        with pytest.raises(PipelineError, match="thinker: 1-old; dit: 2-new") as failed:
            await asyncio.wait_for(run.complete(PipelineRequest("r3", prompt="p")), 5)
        assert failed.value.status == 503
    finally:
        await thinker.close()
        await dit.close()


def companion_hand_offs(request: StageServerRequest, name: str) -> dict[str, HandOff]:
    """What a stage hands off for ``request``'s companions, under the names they ask for, as
    a real stage does (tests/integration: a family's served images equal its pipeline's)."""
    hand_offs = {}
    for companion in request.companions:
        key = f"{request.request_id}-{companion.suffix}"
        handle = ConnectorHandle("shm", key, "float32", [1, 4], 16)
        hand_offs[companion.names.get(name, name)] = HandOff(handle)
    return hand_offs


class EncodingReplica(FakeReplica):
    """An encoder replica: answers each request with a hidden-states handle of its own,
    and one per companion it carries."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.requests: list[StageServerRequest] = []

    async def add_request_async(self, request: object) -> None:
        await super().add_request_async(request)  # type: ignore[arg-type]
        assert isinstance(request, StageServerRequest)
        self.requests.append(request)
        request_id = self.received[-1]
        handle = ConnectorHandle("shm", request_id, "float32", [1, 4], 16)
        self.pending.discard(request_id)
        hand_offs = {
            "prompt_embeds": HandOff(handle),
            **companion_hand_offs(request, "prompt_embeds"),
        }
        self.emit(StageServerOutput(request_id, finished=True, hand_offs=hand_offs))


def shared_memory_family(replicas: int) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "model": "m",
            "family": "qwen-image",
            "stages": [
                {"stageId": 0, "name": "encoder", "type": "llm", "output": "hidden_states"},
                {
                    "stageId": 1,
                    "name": "dit",
                    "type": "diffusion",
                    "inputConnectors": {"from_stage_0": "shm"},
                    # Guidance, so that every request has a negative-prompt companion.
                    "defaultSamplingParams": {"true_cfg_scale": 4.0, "negative_prompt": "dark"},
                },
            ],
            "connectors": {"shm": {"name": "SharedMemoryConnector"}},
            "router": {"policy": "round-robin"},
        }
    )


async def test_a_stage_reading_shared_memory_runs_in_the_pod_of_its_input() -> None:
    """Two pods, each an encoder and a DiT: a request's encoder output, its negative
    prompt's (a companion, in the same message) and its DiT all land in one pod, whatever
    round-robin picks."""
    encoder, dit = StageReplicaPool("encoder"), StageReplicaPool("dit")
    encoders, dits = {}, {}
    for pod in ("10.0.0.1", "10.0.0.2"):
        encoders[pod], dits[pod] = EncodingReplica(pod), AnsweringReplica(pod)
        encoder.add_replica(encoders[pod], f"{pod}:52000")
        dit.add_replica(dits[pod], f"{pod}:52001")
    run = PipelineOrchestrator(shared_memory_family(2), {0: encoder, 1: dit})
    try:
        for n in range(6):
            await asyncio.wait_for(run.complete(PipelineRequest(f"r{n}", prompt="p")), 5)
        for pod in encoders:
            served = set(encoders[pod].received)
            assert all(
                [c.suffix for c in r.companions] == ["negative"] for r in encoders[pod].requests
            )
            assert set(dits[pod].received) == served
        assert all(dits[pod].received for pod in dits)  # both pods served
        # With no DiT in the encoder's pod, the request cannot run: a 503 that says why.
        dit_ids = {s.address: s.replica_id for s in dit.stats()}
        await dit.remove_replica(dit_ids["10.0.0.2:52001"])
        encoder_ids = {s.address: s.replica_id for s in encoder.stats()}
        await encoder.remove_replica(encoder_ids["10.0.0.1:52000"])
        with pytest.raises(PipelineError, match=r"at 10\.0\.0\.2 \(its input is in") as failed:
            await asyncio.wait_for(run.complete(PipelineRequest("s", prompt="p")), 5)
        assert failed.value.status == 503
    finally:
        await encoder.close()
        await dit.close()


class ThinkerReplica(FakeReplica):
    """A BAGEL thinker replica: answers each request with a context KV of its own, and
    keeps what it was asked."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.requests: list[StageServerRequest] = []

    async def add_request_async(self, request: object) -> None:
        await super().add_request_async(request)  # type: ignore[arg-type]
        assert isinstance(request, StageServerRequest)
        self.requests.append(request)
        request_id = request.request_id
        handle = ConnectorHandle("shm", request_id, "bfloat16", [2, 1, 3, 1, 2], 24)
        self.pending.discard(request_id)
        hand_offs = {
            "context_kv": HandOff(handle, {"rope": 3}),
            **companion_hand_offs(request, "context_kv"),
        }
        self.emit(StageServerOutput(request_id, finished=True, hand_offs=hand_offs))


class RecordingDiT(AnsweringReplica):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.requests: list[StageServerRequest] = []

    async def add_request_async(self, request: object) -> None:
        assert isinstance(request, StageServerRequest)
        self.requests.append(request)
        await super().add_request_async(request)


BAGEL_PODS = PipelineConfig.model_validate(
    {
        "model": "ByteDance-Seed/BAGEL-7B-MoT",
        "stages": [
            {"stageId": 0, "name": "thinker", "type": "llm"},
            {
                "stageId": 1,
                "name": "dit",
                "type": "diffusion",
                "inputConnectors": {"from_stage_0": "shm"},
                "defaultSamplingParams": {"seed": 52},
            },
        ],
        "connectors": {"shm": {"name": "SharedMemoryConnector"}},
        "router": {"policy": "round-robin"},
    }
)


async def test_a_bagel_edits_companion_and_its_parent_feed_one_dit_in_their_pod() -> None:
    """Two pods, each a thinker and a DiT: an edit's context and its image-dropped
    companion's are prefilled in one pod, and the DiT there gets both; text to image needs
    no companion. The thinker gets what its VAE sample needs: the seed and the size."""
    thinker, dit = StageReplicaPool("thinker"), StageReplicaPool("dit")
    thinkers, dits = {}, {}
    for pod in ("10.0.0.1", "10.0.0.2"):
        thinkers[pod], dits[pod] = ThinkerReplica(pod), RecordingDiT(pod)
        thinker.add_replica(thinkers[pod], f"{pod}:52000")
        dit.add_replica(dits[pod], f"{pod}:52001")
    run = PipelineOrchestrator(BAGEL_PODS, {0: thinker, 1: dit})
    image = np.zeros((4, 4, 3), np.uint8)
    try:
        for n in range(6):
            request = PipelineRequest(
                f"r{n}", prompt="p", images=[image], diffusion_params={"height": 32, "width": 32}
            )
            await asyncio.wait_for(run.complete(request), 5)
        await asyncio.wait_for(run.complete(PipelineRequest("t2i", prompt="p")), 5)
        for pod in thinkers:
            by_id = {r.request_id: r for r in thinkers[pod].requests}
            for request in dits[pod].requests:
                assert "context_kv" in request.inputs
                parent = request.inputs["context_kv"].handle.key
                if parent == "t2i":
                    assert by_id[parent].images == []
                    assert "no_image_context_kv" not in request.inputs
                    continue
                assert len(by_id[parent].images) == 1
                # The seed alone: the edit's size is the DiT's, not its context's.
                assert by_id[parent].params == {"seed": 52}
                assert "no_image_context_kv" in request.inputs
                assert request.inputs["no_image_context_kv"].handle.key == f"{parent}-no-image"
                (companion,) = by_id[parent].companions
                assert companion.suffix == "no-image"
                assert not companion.with_images
                assert companion.prompt == by_id[parent].prompt
        assert all(dits[pod].requests for pod in dits)  # both pods served
    finally:
        await thinker.close()
        await dit.close()


class RefusingCompanionEncoder(EncodingReplica):
    """Fails each request as a stage fails one whose companion it could not run: the
    request's own answer carries the companion's error."""

    async def add_request_async(self, request: object) -> None:
        await FakeReplica.add_request_async(self, request)  # type: ignore[arg-type]
        error = StageError.bad_request("companion 'negative': negative_prompt: too long")
        self.answer(self.received[-1], error=error)


class RefusingDiT(FakeReplica):
    async def add_request_async(self, request: object) -> None:
        await super().add_request_async(request)  # type: ignore[arg-type]
        self.answer(self.received[-1], error=StageError.bad_request("height: too large"))


@pytest.mark.parametrize(
    ("encoder_replica", "dit_replica", "released"),
    [
        # Served: the DiT fetched both, nothing to release.
        (EncodingReplica, AnsweringReplica, []),
        # The companion failed: the stage answered for both, releasing what it made.
        (RefusingCompanionEncoder, AnsweringReplica, []),
        # The DiT refused the request: the encoder releases the request's hand-offs, its
        # companion's with them.
        (EncodingReplica, RefusingDiT, ["r"]),
    ],
)
async def test_a_hand_off_no_stage_will_fetch_is_released_at_once(
    encoder_replica: type[FakeReplica], dit_replica: type[FakeReplica], released: list[str]
) -> None:
    """A failed request's hand-offs are dropped by the replicas that made them (an abort of
    a finished request releases its hand-off), not left for the connector's TTL."""
    encoder, dit = StageReplicaPool("encoder"), StageReplicaPool("dit")
    producer, consumer = encoder_replica("10.0.0.1"), dit_replica("10.0.0.1")
    encoder.add_replica(producer, "10.0.0.1:52000")
    dit.add_replica(consumer, "10.0.0.1:52001")
    run = PipelineOrchestrator(shared_memory_family(1), {0: encoder, 1: dit})
    try:
        if encoder_replica is RefusingCompanionEncoder or released:
            with pytest.raises(PipelineError) as failed:
                await asyncio.wait_for(run.complete(PipelineRequest("r", prompt="p")), 5)
            assert failed.value.status == 400
        else:
            await asyncio.wait_for(run.complete(PipelineRequest("r", prompt="p")), 5)
        assert sorted(producer.aborted) == released
        assert producer.received == ["r"]
    finally:
        await encoder.close()
        await dit.close()
