"""The pure parts of LoRA adapters on a DiT (omni_runtime.diffusion.adapters): the checks of
an adapter's weights against the DiT's modules, the LoRA switches a batch needs, and the
cache's reads, injections and evictions against a recording stand-in for a pipeline."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_runtime.diffusion.adapters import (
    AdapterLoadError,
    DiTAdapters,
    LoraState,
    ReadAdapter,
    adapter_file,
    after_steps,
    check_fits,
    lora_steps,
    lora_target,
    peft_name,
)
from omni_runtime.engine.stage.stage_core_types import StageAdapter, StageErrorCode

MODULES: dict[str, tuple[int, int] | None] = {
    "layers.0.attention.to_q": (64, 64),
    "layers.0.feed_forward.w1": (64, 170),
    "layers.0.norm": None,
}
WHERE = "adapter 'ink' (/loras/ink.safetensors)"


def lora(module: str, rank: int, features: tuple[int, int]) -> dict[str, np.ndarray]:
    return {
        f"transformer.{module}.lora_A.weight": np.zeros((rank, features[0])),
        f"transformer.{module}.lora_B.weight": np.zeros((features[1], rank)),
    }


def load_error(state: dict[str, Any]) -> str:
    with pytest.raises(AdapterLoadError) as caught:
        check_fits(state, MODULES, WHERE)
    error = caught.value.error
    assert error.code is StageErrorCode.BAD_REQUEST
    assert error.param == "model"
    assert WHERE in error.message
    return error.message


def test_weights_that_fit_pass() -> None:
    state = {
        **lora("layers.0.attention.to_q", 4, (64, 64)),
        **lora("layers.0.feed_forward.w1", 8, (64, 170)),
        "transformer.layers.0.feed_forward.w1.lora_B.bias": np.zeros(170),
    }
    check_fits(state, MODULES, WHERE)


@pytest.mark.parametrize(
    ("state", "why"),
    [
        ({}, "holds no weights"),
        (
            {"unet.down.0.lora_A.weight": np.zeros((4, 64))},
            "none of its 1 keys is of the DiT",
        ),
        ({"transformer.layers.0.attention.to_q.weight": np.zeros((64, 64))}, "not LoRA"),
        (lora("down_blocks.0.proj_in", 4, (64, 64)), "modules the DiT does not have"),
        (lora("layers.0.attention.to_q", 4, (32, 64)), "takes 64 in_features"),
        (lora("layers.0.feed_forward.w1", 4, (64, 64)), "makes 170 out_features"),
        (
            {"transformer.layers.0.attention.to_q.lora_A.weight": np.zeros((4, 64))},
            "has no lora_B",
        ),
        (
            {
                "transformer.layers.0.attention.to_q.lora_A.weight": np.zeros((4, 64)),
                "transformer.layers.0.attention.to_q.lora_B.weight": np.zeros((64, 8)),
            },
            "rank 4 but its lora_B of rank 8",
        ),
    ],
)
def test_weights_that_do_not_fit_are_refused_naming_the_file(
    state: dict[str, Any], why: str
) -> None:
    assert why in load_error(state)


def test_many_offending_keys_are_listed_in_part() -> None:
    state: dict[str, Any] = {}
    for index in range(5):
        state.update(lora(f"other.{index}", 2, (8, 8)))
    assert "and 2 more" in load_error(state)


def test_lora_target_splits_peft_keys() -> None:
    assert lora_target("a.b.lora_A.weight") == ("a.b", "A")
    assert lora_target("a.b.lora_B.weight") == ("a.b", "B")
    assert lora_target("a.b.lora_B.bias") == ("a.b", "B.bias")
    assert lora_target("a.b.weight") is None
    assert lora_target("a.b.lora_down.weight") is None


def test_peft_names_are_identifiers_and_distinct() -> None:
    names = ["half", "pixel.art", "pixel_art", "pixel-art"]
    inside = {peft_name(name) for name in names}
    assert len(inside) == len(names)
    assert all(name.isidentifier() for name in inside)
    assert peft_name("half") == peft_name("half")


def test_adapter_file_takes_a_file_or_a_directory_of_one(tmp_path: Path) -> None:
    one = tmp_path / "one"
    one.mkdir()
    (one / "adapter_model.safetensors").write_bytes(b"x")
    (one / "adapter_config.json").write_text("{}")
    assert adapter_file(one) == one / "adapter_model.safetensors"
    assert adapter_file(one / "adapter_model.safetensors") == one / "adapter_model.safetensors"
    (one / "other.safetensors").write_bytes(b"y")
    with pytest.raises(AdapterLoadError, match=r"found adapter_model\.safetensors, other"):
        adapter_file(one)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AdapterLoadError, match=r"found none"):
        adapter_file(empty)
    with pytest.raises(AdapterLoadError, match=r"must be \.safetensors"):
        adapter_file(one / "adapter_config.json")


@pytest.mark.parametrize(
    ("state", "wanted", "held", "steps"),
    [
        # Nothing ever loaded: a request without an adapter touches nothing.
        (LoraState(), None, False, []),
        (LoraState(), None, True, ["disable"]),
        (LoraState(enabled=False), None, True, []),
        (LoraState(enabled=None), None, True, ["disable"]),
        (LoraState(), ("ink", 1.0), True, ["set"]),
        (LoraState(active=("ink", 1.0)), ("ink", 1.0), True, []),
        (LoraState(active=("ink", 1.0)), ("ink", 0.5), True, ["set"]),
        (LoraState(active=("ink", 1.0)), ("neon", 1.0), True, ["set"]),
        (LoraState(enabled=False, active=("ink", 1.0)), ("ink", 1.0), True, ["enable", "set"]),
        (LoraState(enabled=None, active=None), ("ink", 1.0), True, ["enable", "set"]),
    ],
)
def test_lora_steps(
    state: LoraState, wanted: tuple[str, float] | None, held: bool, steps: list[str]
) -> None:
    assert lora_steps(state, wanted, held) == steps
    after = after_steps(state, wanted, lora_steps(state, wanted, held))
    # Once there, the same batch again needs nothing.
    assert lora_steps(after, wanted, held) == []


class RecordingPipeline:
    """Records what DiTAdapters asks of a pipeline; its transformer's peft_config holds the
    injected adapters. An adapter whose weights hold "fail" fails its injection part way."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.transformer = _Transformer()

    def load_lora_into_transformer(self, state_dict: dict[str, Any], **kwargs: Any) -> None:
        name = kwargs["adapter_name"]
        self.calls.append(("load", name))
        self.transformer.peft_config[name] = kwargs["metadata"]
        if "fail" in state_dict:
            raise RuntimeError("size mismatch for layers.0.attention.to_q")

    def delete_adapters(self, name: str) -> None:
        self.calls.append(("delete", name))
        del self.transformer.peft_config[name]

    def set_adapters(self, names: list[str], adapter_weights: list[float]) -> None:
        self.calls.append(("set", (names, adapter_weights)))

    def enable_lora(self) -> None:
        self.calls.append(("enable", None))

    def disable_lora(self) -> None:
        self.calls.append(("disable", None))


class _Transformer:
    def __init__(self) -> None:
        self.peft_config: dict[str, Any] = {}

    def named_modules(self) -> list[tuple[str, Any]]:
        return []

    def modules(self) -> list[Any]:
        return []


class GatedReads:
    """Adapter reads that end when the test says so."""

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}
        self.reads: list[str] = []

    def gate(self, name: str) -> threading.Event:
        return self.gates.setdefault(name, threading.Event())

    def __call__(self, adapter: StageAdapter) -> ReadAdapter:
        self.reads.append(adapter.name)
        if not self.gate(adapter.name).wait(timeout=30):
            raise AssertionError(f"the read of {adapter.name} was never let through")
        if adapter.source.endswith("corrupt.safetensors"):
            raise AdapterLoadError(f"adapter {adapter.name!r} ({adapter.source}): corrupt")
        state = {"fail": 1} if "fail" in adapter.name else {"w": 1}
        return ReadAdapter(adapter.name, adapter.source, Path(adapter.source), state, None)


def ink(name: str = "ink", scale: float = 1.0, source: str = "/loras/ink.safetensors") -> Any:
    return StageAdapter(name, source, scale)


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def make(capacity: int = 2) -> tuple[DiTAdapters, RecordingPipeline, GatedReads]:
    pipeline, reads = RecordingPipeline(), GatedReads()
    return DiTAdapters(pipeline, capacity, read=reads), pipeline, reads


def test_a_read_runs_in_the_background_and_says_when_it_ends() -> None:
    adapters, pipeline, reads = make()
    ended = threading.Event()
    adapters.notify_reads(ended.set)
    assert adapters.ready(None)
    assert not adapters.ready(ink())
    assert not adapters.ready(ink())  # asked again: still the one read
    wait_for(lambda: reads.reads == ["ink"], "the read to start")
    assert pipeline.calls == []  # nothing injected off the engine's thread
    reads.gate("ink").set()
    assert ended.wait(timeout=10)
    assert adapters.ready(ink())
    adapters.activate(ink(scale=0.5))
    assert reads.reads == ["ink"]
    assert pipeline.calls == [
        ("load", peft_name("ink")),
        ("enable", None),
        ("set", ([peft_name("ink")], [0.5])),
    ]
    assert adapters.held == ["ink"]
    adapters.close()


def test_batches_switch_adapters_only_when_they_change() -> None:
    adapters, pipeline, reads = make()
    reads.gate("ink").set()
    adapters.activate(None)
    assert pipeline.calls == []  # no adapter yet: a plain request touches nothing
    adapters.activate(ink())
    adapters.activate(ink())
    pipeline.calls.clear()
    adapters.activate(None)
    adapters.activate(None)
    adapters.activate(ink())
    adapters.activate(ink(scale=0.25))
    assert pipeline.calls == [
        ("disable", None),
        ("enable", None),
        ("set", ([peft_name("ink")], [1.0])),
        ("set", ([peft_name("ink")], [0.25])),
    ]
    adapters.close()


def test_the_least_recently_used_is_evicted() -> None:
    adapters, pipeline, reads = make(capacity=2)
    for name in ("a", "b", "c"):
        reads.gate(name).set()
    adapters.activate(ink("a"))
    adapters.activate(ink("b"))
    adapters.activate(ink("a"))
    adapters.activate(ink("c"))
    assert adapters.held == ["a", "c"]
    assert ("delete", peft_name("b")) in pipeline.calls
    assert set(pipeline.transformer.peft_config) == {peft_name("a"), peft_name("c")}
    # b again: read anew, evicting a (used before c).
    adapters.activate(ink("b"))
    assert adapters.held == ["c", "b"]
    assert reads.reads == ["a", "b", "c", "b"]
    adapters.close()


def test_a_failed_injection_is_removed_and_the_next_load_works() -> None:
    adapters, pipeline, reads = make(capacity=2)
    for name in ("ink", "fail"):
        reads.gate(name).set()
    adapters.activate(ink())
    with pytest.raises(AdapterLoadError, match=r"/loras/fail.safetensors.*size mismatch"):
        adapters.activate(ink("fail", source="/loras/fail.safetensors"))
    assert set(pipeline.transformer.peft_config) == {peft_name("ink")}
    assert ("delete", peft_name("fail")) in pipeline.calls
    assert adapters.held == ["ink"]
    pipeline.calls.clear()
    # The failure left the switches unknown: the next batch sets them again.
    adapters.activate(ink())
    assert pipeline.calls == [("enable", None), ("set", ([peft_name("ink")], [1.0]))]
    adapters.close()


def test_a_failed_read_fails_its_request_and_is_read_again_next_time() -> None:
    adapters, pipeline, reads = make()
    reads.gate("bad").set()
    bad = ink("bad", source="/loras/corrupt.safetensors")
    for _ in range(2):
        with pytest.raises(AdapterLoadError, match="corrupt"):
            adapters.activate(bad)
    assert reads.reads == ["bad", "bad"]
    assert adapters.held == []
    assert pipeline.calls == []
    adapters.close()


def test_a_name_from_another_source_is_replaced() -> None:
    adapters, pipeline, reads = make()
    reads.gate("ink").set()
    adapters.activate(ink())
    assert not adapters.ready(ink(source="/loras/ink-v2.safetensors"))
    adapters.activate(ink(source="/loras/ink-v2.safetensors"))
    assert reads.reads == ["ink", "ink"]
    assert adapters.held == ["ink"]
    assert [call for call, _ in pipeline.calls].count("load") == 2
    assert ("delete", peft_name("ink")) in pipeline.calls
    adapters.close()
