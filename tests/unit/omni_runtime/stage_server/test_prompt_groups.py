"""A request and its companion prompts answered once by the stage that runs them (the real
stage runs them in tests/integration: a guided family image equals its pipeline's)."""

from __future__ import annotations

from typing import Any

from omni_runtime.connectors import ConnectorHandle
from omni_runtime.engine.stage.stage_core_types import (
    HandOff,
    StageError,
    StageErrorCode,
    StageServerOutput,
)
from omni_runtime.stage_server.prompt_groups import PromptGroups


def hand_off(key: str) -> HandOff:
    return HandOff(ConnectorHandle("shm", key, "float32", [1, 4], 16))


def final(request_id: str, **fields: Any) -> StageServerOutput:
    return StageServerOutput(request_id, finished=True, **{"finish_reason": "stop", **fields})


def test_the_request_is_answered_once_with_every_prompts_hand_offs() -> None:
    groups = PromptGroups()
    ids = groups.start("r", {"negative": {"prompt_embeds": "negative_prompt_embeds"}})
    assert ids == ["r-negative"]
    assert groups.owner("r-negative") == "r"
    # The request finishes first: held until its companion has.
    own = final("r", hand_offs={"prompt_embeds": hand_off("r")})
    assert groups.take(own) == (None, [])
    assert groups.running("r") == ["r-negative"]
    answer, abort = groups.take(final("r-negative", hand_offs={"prompt_embeds": hand_off("n")}))
    assert abort == []
    assert answer is own
    assert {name: h.handle.key for name, h in answer.hand_offs.items()} == {
        "prompt_embeds": "r",
        "negative_prompt_embeds": "n",
    }
    # Forgotten once answered: a later output of the same ids passes as anyone's.
    assert groups.running("r") == []
    assert groups.owner("r-negative") == "r-negative"


def test_a_companion_that_finishes_first_waits_and_steps_pass_through() -> None:
    groups = PromptGroups()
    groups.start("r", {"no-image": {"context_kv": "no_image_context_kv"}})
    step = StageServerOutput("r", text="a plan")
    assert groups.take(step) == (step, [])
    assert groups.take(StageServerOutput("r-no-image", text="x")) == (None, [])
    assert groups.take(final("r-no-image", hand_offs={"context_kv": hand_off("c")})) == (
        None,
        [],
    )
    answer, _ = groups.take(final("r", hand_offs={"context_kv": hand_off("r")}))
    assert answer is not None
    assert set(answer.hand_offs) == {"context_kv", "no_image_context_kv"}


def test_a_failed_companion_fails_the_request_and_the_rest_is_aborted() -> None:
    groups = PromptGroups()
    groups.start("r", {"negative": {}, "other": {}})
    error = StageError.bad_request("prompt: too long", "prompt")
    answer, abort = groups.take(
        StageServerOutput("r-negative", finished=True, finish_reason="error", error=error)
    )
    assert answer is not None
    assert answer.request_id == "r"
    assert answer.finished
    assert answer.error is not None
    assert answer.error.code is StageErrorCode.BAD_REQUEST
    assert answer.error.message == "companion 'negative': prompt: too long"
    assert answer.error.param == "prompt"
    assert abort == ["r", "r-other"]
    # What the aborted prompts answer is dropped: the request was answered.
    assert groups.take(final("r", finish_reason="abort")) == (None, [])
    assert groups.take(final("r-other", finish_reason="abort")) == (None, [])
    assert groups.running("r") == []


def test_an_aborted_request_answers_as_itself_and_its_companions_are_aborted() -> None:
    groups = PromptGroups()
    groups.start("r", {"negative": {}})
    aborted = final("r", finish_reason="abort")
    assert groups.take(aborted) == (aborted, ["r", "r-negative"])


def test_a_companion_failing_after_its_request_finished_releases_the_requests_hand_off() -> None:
    groups = PromptGroups()
    groups.start("r", {"negative": {}})
    assert groups.take(final("r", hand_offs={"prompt_embeds": hand_off("r")})) == (None, [])
    error = StageError.bad_request("prompt: too long", "prompt")
    answer, abort = groups.take(final("r-negative", finish_reason="error", error=error))
    assert answer is not None
    assert answer.error is not None
    assert answer.hand_offs == {}
    # The request finished: its abort is what releases the hand-off it made.
    assert abort == ["r"]


def test_a_request_without_companions_passes_through() -> None:
    groups = PromptGroups()
    output = final("plain")
    assert groups.take(output) == (output, [])
