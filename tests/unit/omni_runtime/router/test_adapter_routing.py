"""LoRA adapters on the router's side: which adapters a request's model name picks, the
load/unload paths, the pool's affinity for replicas that hold an adapter, and the metrics.

The stages are stand-ins (tests/fake_replica.py) that report the adapters they hold as a
stage server does; the real stages load adapters in tests/integration/test_dit_adapters.py,
test_llm_adapters.py and test_adapter_serving.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from fake_replica import FakeReplica
from omni_runtime.config import PipelineConfig
from omni_runtime.engine.stage.stage_core_types import StageAdapter, StageLoad, StageServerRequest
from omni_runtime.router.adapters import AdapterCatalog
from omni_runtime.router.app import create_app
from omni_runtime.router.errors import RequestError
from omni_runtime.router.replica_policies import (
    ADAPTER_AFFINITY_SLACK,
    ReplicaCandidate,
    adapter_affinity,
    rendezvous_score,
)
from omni_runtime.router.stage_replica_pool import StageReplicaPool

PIPELINE: dict[str, Any] = {
    "model": "/models/z-image",
    "family": "z-image",
    "router": {"servedModelName": "zi"},
    "connectors": {"shm": {"name": "SharedMemoryConnector"}},
    "stages": [
        {"stageId": 0, "output": "hidden_states"},
        {"stageId": 1, "inputConnectors": {"from_stage_0": "shm"}, "maxLoras": 2},
    ],
    "adapters": [
        {"name": "ink", "stage": "dit", "source": "/loras/ink.safetensors", "scale": 0.8},
        {"name": "neon", "stage": "dit", "source": "/loras/neon.safetensors"},
    ],
}


def catalog(**changes: Any) -> AdapterCatalog:
    return AdapterCatalog(PipelineConfig.model_validate({**PIPELINE, **changes}), "zi")


# -- which adapters a model name picks ---------------------------------------------------


def test_the_served_name_or_none_picks_no_adapter() -> None:
    assert catalog().pick(None) == {}
    assert catalog().pick("zi") == {}


@pytest.mark.parametrize("model", ["ink", "zi:ink"])
def test_an_adapter_is_picked_by_its_name_alone_or_after_the_served_name(model: str) -> None:
    assert catalog().pick(model) == {1: StageAdapter("ink", "/loras/ink.safetensors", 0.8)}


def test_lora_scale_replaces_the_dits_adapter_scale() -> None:
    assert catalog().pick("zi:neon", 0.5) == {
        1: StageAdapter("neon", "/loras/neon.safetensors", 0.5)
    }


def test_lora_scale_without_a_dit_adapter_is_refused_naming_it() -> None:
    with pytest.raises(RequestError) as refused:
        catalog().pick("zi", 0.5)
    assert (refused.value.status, refused.value.param) == (400, "lora_scale")


@pytest.mark.parametrize(
    ("model", "status", "says"),
    [
        ("zi:pop", 404, "names adapter 'pop', which is not served here"),
        ("pop", 404, "'pop' is not served here"),
        ("other:ink", 404, "'other:ink' is not served here"),
        ("zi:ink+neon", 400, "names two adapters of stage 'dit' (ink and neon)"),
    ],
)
def test_a_name_not_served_is_a_404_and_two_adapters_of_a_stage_a_400(
    model: str, status: int, says: str
) -> None:
    with pytest.raises(RequestError) as refused:
        catalog().pick(model)
    assert (refused.value.status, refused.value.param) == (status, "model")
    assert says in refused.value.message


def test_one_adapter_per_stage_joined_by_plus() -> None:
    pipeline = {
        "model": "/models/llm",
        "router": {"servedModelName": "chat"},
        "stages": [
            {"stageId": 0, "name": "thinker", "type": "llm"},
            {"stageId": 1, "name": "dit", "type": "diffusion"},
        ],
        "adapters": [
            {"name": "pirate", "stage": "thinker", "source": "/loras/pirate"},
            {"name": "ink", "stage": "dit", "source": "/loras/ink.safetensors"},
        ],
    }
    picked = AdapterCatalog(PipelineConfig.model_validate(pipeline), "chat").pick("chat:pirate+ink")
    assert {stage: adapter.name for stage, adapter in picked.items()} == {0: "pirate", 1: "ink"}


# -- adapters added and removed at run time ----------------------------------------------


def test_an_adapter_added_at_run_time_is_picked_then_removed() -> None:
    adapters = catalog()
    entry = adapters.add("pop", "https://example.com/pop.safetensors", None, 1.0)
    assert entry.stage.name == "dit"
    assert not entry.declared
    assert adapters.pick("zi:pop")[1].source == "https://example.com/pop.safetensors"
    adapters.remove("pop")
    with pytest.raises(RequestError) as refused:
        adapters.pick("zi:pop")
    assert refused.value.status == 404


@pytest.mark.parametrize(
    ("args", "param", "says"),
    [
        (("ink", "/loras/x.safetensors", None, 1.0), "lora_name", "has already been loaded"),
        (("Bad:name", "/loras/x.safetensors", None, 1.0), "lora_name", "not an adapter name"),
        (("zi", "/loras/x.safetensors", None, 1.0), "lora_name", "the served model's name"),
        (("pop", "relative.safetensors", None, 1.0), "lora_path", "is not an absolute path"),
        (("pop", "http://example.com/p.safetensors", None, 1.0), "lora_path", "over https"),
        (("pop", "/loras/p.safetensors", "encoder", 1.0), "stage", "not a stage that takes"),
    ],
)
def test_a_bad_load_is_refused_naming_the_field(
    args: tuple[str, str, str | None, float], param: str, says: str
) -> None:
    with pytest.raises(RequestError) as refused:
        catalog().add(*args)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert says in refused.value.message


def test_a_declared_adapter_is_not_unloaded_and_an_unknown_one_is_a_404() -> None:
    adapters = catalog()
    with pytest.raises(RequestError) as declared:
        adapters.remove("ink")
    assert declared.value.status == 400
    assert "declared in the pipeline" in declared.value.message
    with pytest.raises(RequestError) as unknown:
        adapters.remove("pop")
    assert unknown.value.status == 404


def test_the_app_lists_adapters_and_serves_vllms_load_paths() -> None:
    pipeline = PipelineConfig.model_validate(PIPELINE)
    pools = {stage.stage_id: StageReplicaPool(stage.name) for stage in pipeline.stages}
    dit = FakeReplica("dit")
    # The replica's frontend loads what it is given (the real ones: test_adapter_serving).
    dit.utility_answers["load_adapter"] = {}
    pools[1].add_replica(dit, "10.0.0.1:1")
    with TestClient(create_app(pipeline, pools)) as http:
        models = http.get("/v1/models").json()["data"]
        assert [(m["id"], m.get("parent"), m.get("stage")) for m in models] == [
            ("zi", None, None),
            ("ink", "zi", "dit"),
            ("neon", "zi", "dit"),
        ]
        loaded = http.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "pop", "lora_path": "/loras/pop.safetensors", "scale": 0.3},
        )
        assert loaded.status_code == 200, loaded.text
        assert loaded.text == "Success: LoRA adapter 'pop' added successfully."
        assert dit.utility_calls == [
            ("load_adapter", {"name": "pop", "source": "/loras/pop.safetensors", "scale": 0.3})
        ]
        assert "pop" in [m["id"] for m in http.get("/v1/models").json()["data"]]
        again = http.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "pop", "lora_path": "/loras/pop.safetensors"},
        )
        assert again.status_code == 400
        assert again.json()["error"]["param"] == "lora_name"
        # An unknown adapter in an image request: a 404 naming it, before any stage.
        unknown = http.post("/v1/images/generations", json={"prompt": "x", "model": "zi:nope"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["param"] == "model"
        assert "'nope'" in unknown.json()["error"]["message"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "pop"}).status_code == 200
        assert "pop" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
        schema = http.get("/openapi.json").json()
        assert "/v1/load_lora_adapter" in schema["paths"]
        assert (
            "lora_scale" in schema["components"]["schemas"]["ImageGenerationRequest"]["properties"]
        )


def test_a_pipeline_without_adapters_has_no_load_paths() -> None:
    pipeline = PipelineConfig.model_validate(
        {
            **PIPELINE,
            "adapters": None,
            "stages": [
                {"stageId": 0, "output": "hidden_states"},
                {"stageId": 1, "inputConnectors": {"from_stage_0": "shm"}},
            ],
        }
    )
    pools = {stage.stage_id: StageReplicaPool(stage.name) for stage in pipeline.stages}
    with TestClient(create_app(pipeline, pools)) as http:
        answer = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
        assert answer.status_code == 404
        schema = http.get("/openapi.json").json()
        assert "/v1/load_lora_adapter" not in schema["paths"]
        assert (
            "lora_scale"
            not in schema["components"]["schemas"]["ImageGenerationRequest"]["properties"]
        )


# -- affinity: the pure choice -----------------------------------------------------------


def candidate(replica_id: int, in_flight: int = 0, holds: bool = False) -> ReplicaCandidate:
    return ReplicaCandidate(replica_id, in_flight, f"10.0.0.{replica_id}:1", holds_adapter=holds)


def test_a_holder_within_the_slack_is_chosen() -> None:
    chosen = adapter_affinity(
        [candidate(0), candidate(1, ADAPTER_AFFINITY_SLACK, holds=True)], "ink"
    )
    assert [c.replica_id for c in chosen] == [1]


def test_a_holder_past_the_slack_is_passed_over_for_the_adapters_home() -> None:
    chosen = adapter_affinity(
        [candidate(0), candidate(1), candidate(2, ADAPTER_AFFINITY_SLACK + 1, holds=True)], "ink"
    )
    (home,) = chosen
    assert home.replica_id in (0, 1)
    assert home.replica_id == max((0, 1), key=lambda i: rendezvous_score("ink", f"10.0.0.{i}:1"))


def test_each_adapter_has_one_home_and_eight_spread_over_two_replicas() -> None:
    replicas = [candidate(0), candidate(1)]
    homes = {name: adapter_affinity(replicas, name)[0].replica_id for name in map(str, range(8))}
    # The same answer every time (every router agrees), and both replicas are homes.
    assert homes == {
        name: adapter_affinity(replicas, name)[0].replica_id for name in map(str, range(8))
    }
    assert set(homes.values()) == {0, 1}


# -- affinity: the pool over stand-in replicas -------------------------------------------


class ReportingReplica(FakeReplica):
    """A stand-in that reports the adapters it holds, as a stage server's StageLoad."""

    def __init__(self, name: str, held: list[str]) -> None:
        super().__init__(name)
        self.load = StageLoad(1, "dit", True, adapters=held, max_adapters=2)


async def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


async def test_the_pool_sends_a_request_where_its_adapter_is_held_and_counts_it() -> None:
    pool = StageReplicaPool("dit", "round-robin")
    plain, holder = ReportingReplica("plain", []), ReportingReplica("holder", ["ink"])
    pool.add_replica(plain, "10.0.0.1:1")
    pool.add_replica(holder, "10.0.0.2:1")
    placed: list[tuple[str, str, bool]] = []
    pool.on_adapter_placed = lambda stage, adapter, held: placed.append((stage, adapter, held))
    ink = StageAdapter("ink", "/loras/ink.safetensors")
    try:
        for index in range(3):
            request = StageServerRequest(f"r{index}", adapter=ink)
            await pool.add_request(request, adapter="ink")
        # Round-robin alone would have sent one of three to the other replica.
        assert holder.received == ["r0", "r1", "r2"]
        assert plain.received == []
        assert placed == [("dit", "ink", True)] * 3
        (_plain_stats, holder_stats) = sorted(pool.stats(), key=lambda s: s.address)
        assert holder_stats.running_adapters == ("ink",)
        assert holder_stats.adapters == ("ink",)
        assert holder_stats.max_adapters == 2
        # Past the slack the holder is passed over: the others' home takes the next one.
        await pool.add_request(StageServerRequest("r3", adapter=ink), adapter="ink")
        assert plain.received == ["r3"]
        assert placed[-1] == ("dit", "ink", False)
        # ... and counts as holding it until its own report can say so.
        assert "ink" in next(s for s in pool.stats() if s.address == "10.0.0.1:1").adapters
        for replica in (plain, holder):
            for request_id in list(replica.pending):
                replica.answer(request_id)
        await until(lambda: pool.in_flight == 0)
    finally:
        await pool.close()


async def test_a_request_without_an_adapter_ignores_what_replicas_hold() -> None:
    pool = StageReplicaPool("dit", "round-robin")
    plain, holder = ReportingReplica("plain", []), ReportingReplica("holder", ["ink"])
    pool.add_replica(plain, "10.0.0.1:1")
    pool.add_replica(holder, "10.0.0.2:1")
    try:
        for index in range(2):
            await pool.add_request(StageServerRequest(f"r{index}"))
        assert plain.received == ["r0"]
        assert holder.received == ["r1"]
    finally:
        await pool.close()


async def test_metrics_say_what_each_replica_runs_and_the_affinity_hits() -> None:
    pipeline = PipelineConfig.model_validate(PIPELINE)
    pools = {stage.stage_id: StageReplicaPool(stage.name) for stage in pipeline.stages}
    holder = ReportingReplica("holder", ["ink"])
    pools[1].add_replica(holder, "10.0.0.2:1")
    app = create_app(pipeline, pools)
    ink = StageAdapter("ink", "/loras/ink.safetensors")
    try:
        await pools[1].add_request(StageServerRequest("r0", adapter=ink), adapter="ink")
        text = generate_latest(app.state.router.metrics.registry).decode()
        info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
        assert len(info) == 1
        assert 'max_lora="2"' in info[0]
        assert 'running_lora_adapters="ink"' in info[0]
        assert 'stage="dit"' in info[0]
        assert 'omni_adapter_requests_total{adapter="ink",placement="held",stage="dit"} 1.0' in text
    finally:
        await pools[1].close()


class CachingReplica(FakeReplica):
    """A stand-in with an adapter cache of its own (least recently used evicted), which it
    reports as a stage server does; it counts the requests whose adapter it held."""

    def __init__(self, name: str, capacity: int) -> None:
        super().__init__(name)
        self.capacity = capacity
        self.held: list[str] = []
        self.hits = 0
        self.load = StageLoad(1, "dit", True, adapters=[], max_adapters=capacity)

    async def add_request_async(self, request: Any) -> None:
        await super().add_request_async(request)
        name = request.adapter.name
        if name in self.held:
            self.hits += 1
            self.held.remove(name)
        elif len(self.held) == self.capacity:
            self.held.pop(0)
        self.held.append(name)
        self.load = StageLoad(1, "dit", True, adapters=list(self.held), max_adapters=self.capacity)


@pytest.mark.parametrize("affinity", [True, False])
async def test_affinity_serves_more_requests_where_their_adapter_is_loaded(
    affinity: bool,
) -> None:
    """Eight adapters over two replicas that hold four each, requests four at a time: with
    affinity, nearly every request finds its adapter loaded; the policy alone (round-robin,
    as good as a random choice here) about half as often."""
    import random

    pool = StageReplicaPool("dit", "round-robin")
    replicas = [CachingReplica("a", 4), CachingReplica("b", 4)]
    for index, replica in enumerate(replicas):
        pool.add_replica(replica, f"10.0.0.{index}:1")
    rng = random.Random(3)
    adapters = [StageAdapter(f"lora-{i}", f"/loras/{i}") for i in range(8)]
    try:
        for wave in range(50):
            for index in range(4):
                lora = rng.choice(adapters)
                request = StageServerRequest(f"r{wave}-{index}", adapter=lora)
                await pool.add_request(request, adapter=lora.name if affinity else None)
            for replica in replicas:
                for request_id in list(replica.pending):
                    replica.answer(request_id)
            await until(lambda: pool.in_flight == 0)
    finally:
        await pool.close()
    hit_rate = sum(r.hits for r in replicas) / 200
    if affinity:
        assert hit_rate > 0.85, hit_rate
    else:
        assert hit_rate < 0.65, hit_rate


def test_a_load_the_replica_cannot_load_is_refused_and_not_served() -> None:
    pipeline = PipelineConfig.model_validate(PIPELINE)
    pools = {stage.stage_id: StageReplicaPool(stage.name) for stage in pipeline.stages}
    with TestClient(create_app(pipeline, pools)) as http:
        body = {"lora_name": "pop", "lora_path": "/loras/pop.safetensors"}
        # No replica to load it on: refused for now, not served unchecked.
        unplaced = http.post("/v1/load_lora_adapter", json=body)
        assert unplaced.status_code == 503
        assert "Retry-After" in unplaced.headers
        dit = FakeReplica("dit")
        dit.utility_answers["load_adapter"] = {
            "error": "adapter 'pop' (/loras/pop.safetensors): not a readable safetensors file",
            "param": "lora_path",
        }
        pools[1].add_replica(dit, "10.0.0.1:1")
        refused = http.post("/v1/load_lora_adapter", json=body)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "lora_path"
        assert "/loras/pop.safetensors" in error["message"]
        assert "pop" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
