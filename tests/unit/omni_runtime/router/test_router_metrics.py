"""The router's queue under vLLM's metric names (router.metrics): what running and waiting
count, and that /metrics shows them with the served model's name."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from omni_runtime.config import PipelineConfig
from omni_runtime.router.app import create_app
from omni_runtime.router.metrics import batch_slots, pipeline_running
from omni_runtime.router.stage_replica_pool import StageReplicaPool


@pytest.mark.parametrize(
    ("in_flight", "replicas", "slots", "running"),
    [
        (0, {"dit": [0, 0]}, {"dit": 1}, 0),
        # One DiT replica runs one of its three; the other two wait in its queue.
        (3, {"dit": [3]}, {"dit": 1}, 1),
        (4, {"dit": [2, 2]}, {"dit": 1}, 2),
        # An LLM stage without maxNumSeqs runs all it holds.
        (5, {"encoder": [5], "dit": [0]}, {"encoder": None, "dit": 1}, 5),
        (9, {"encoder": [9]}, {"encoder": 4}, 4),
        # Between stages (handed off, the DiT not yet sent it): waiting, not running.
        (2, {"encoder": [0], "dit": [1]}, {"encoder": None, "dit": 1}, 1),
        # A request and its negative prompt in the encoder count as one request.
        (1, {"encoder": [2]}, {"encoder": None}, 1),
    ],
)
def test_running_counts_requests_in_batch_slots(
    in_flight: int, replicas: dict[str, list[int]], slots: dict[str, int | None], running: int
) -> None:
    assert pipeline_running(in_flight, replicas, slots) == running


def test_batch_slots_come_from_the_stage() -> None:
    pipeline = PipelineConfig.model_validate(
        {
            "model": "m",
            "stages": [
                {"stageId": 0, "name": "encoder", "type": "llm", "output": "hidden_states"},
                {"stageId": 1, "name": "dit", "type": "diffusion"},
                {"stageId": 2, "name": "other", "type": "llm", "maxNumSeqs": 8},
            ],
        }
    )
    assert [batch_slots(s) for s in pipeline.stages] == [None, 1, 8]


def test_metrics_show_the_queue_under_vllms_names_with_the_model() -> None:
    pipeline = PipelineConfig.model_validate(
        {
            "model": "org/some-model",
            "stages": [{"stageId": 0, "name": "chat", "type": "llm"}],
        }
    )
    pools = {0: StageReplicaPool("chat", "round-robin")}
    with TestClient(create_app(pipeline, pools)) as http:
        text = http.get("/metrics").text
    assert 'vllm:num_requests_running{model_name="some-model"} 0.0' in text
    assert 'vllm:num_requests_waiting{model_name="some-model"} 0.0' in text
    assert "# TYPE vllm:num_requests_waiting gauge" in text
