"""Qwen3-Omni's code2wav stage engine (``Code2WavEngine``) on the tiny checkpoint.

The talker's side is this test process: it puts codec frames into real connectors (shared
memory and TCP) and hands them to the engine as the ``codes`` input, which the engine
fetches itself. Its waveform must be transformers' own ``code2wav.chunked_decode`` of the
same frames from the whole model, bit for bit (both float32 on the CPU). A request the
engine refuses, aborts or cannot decode answers with an output saying so and frees the
producer's copy, and the engine serves the next one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_runtime.config import ConnectorConfig
from omni_runtime.connectors import ConnectorError, StageConnectors
from omni_runtime.diffusion.code2wav_engine import SAMPLE_RATE, Code2WavEngine
from omni_runtime.diffusion.engine import DiffusionEngineConfig
from omni_runtime.engine.stage.stage_core_types import (
    HandOff,
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
    StageErrorCode,
)
from omni_runtime.tiny_models import QWEN3_OMNI_SUBDIR
from omni_runtime.tiny_models.qwen3_omni import CODEBOOK_SIZE, NUM_CODE_GROUPS, SAMPLES_PER_CODE

pytestmark = pytest.mark.integration

CONNECTORS: dict[str, dict[str, Any]] = {
    "shm": {"name": "SharedMemoryConnector"},
    "tcp": {"name": "TCPConnector", "extra": {"bind_host": "127.0.0.1"}},
}
FRAMES = 15


@pytest.fixture(scope="module")
def checkpoint(tiny_models: Path) -> Path:
    return tiny_models / QWEN3_OMNI_SUBDIR


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[Code2WavEngine]:
    # Built directly: the loader picks it by the family's DiTRecipe.engine.
    config = DiffusionEngineConfig(
        model=str(checkpoint), family="qwen3-omni", connectors=CONNECTORS, device="cpu"
    )
    built = Code2WavEngine(config)
    yield built
    built.close()


@pytest.fixture(scope="module")
def producer() -> Iterator[StageConnectors]:
    """The talker's side of the connectors, in this process."""
    connectors = StageConnectors(
        {name: ConnectorConfig.model_validate(c) for name, c in CONNECTORS.items()}
    )
    yield connectors
    connectors.close()


@pytest.fixture(scope="module")
def reference_code2wav(checkpoint: Path) -> Any:
    """transformers' code2wav, as the whole model loads it."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    return model.code2wav.eval()


def codes(seed: int, frames: int = FRAMES) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(
        0, CODEBOOK_SIZE, (frames, NUM_CODE_GROUPS), generator=generator, dtype=torch.int64
    )


def hand_off(producer: StageConnectors, connector: str, key: str, array: torch.Tensor) -> HandOff:
    return HandOff(producer.get(connector).put(key, array))


def run(engine: Code2WavEngine, request: StageDiffusionCoreRequest) -> StageDiffusionCoreOutput:
    assert engine.admit(request.request_id) is None
    return engine.execute(request)


def assert_freed(producer: StageConnectors, handed: HandOff) -> None:
    with pytest.raises(ConnectorError):
        producer.get(handed.handle.connector).get(handed.handle)


@pytest.mark.parametrize("connector", sorted(CONNECTORS))
def test_waveform_is_transformers_chunked_decode(
    engine: Code2WavEngine, producer: StageConnectors, reference_code2wav: Any, connector: str
) -> None:
    frames = codes(7)
    handed = hand_off(producer, connector, f"wave-{connector}", frames)
    output = run(
        engine,
        StageDiffusionCoreRequest(
            f"wave-{connector}", prompt="the answer's text", inputs={"codes": handed}
        ),
    )
    assert output.error is None, output.error
    assert not output.aborted
    assert output.images is None
    assert output.audio is not None
    with torch.inference_mode():
        expected = reference_code2wav.chunked_decode(
            frames.T[None], chunk_size=300, left_context_size=25
        )[0, 0].numpy()
    assert output.audio.dtype == np.float32
    # Causal convolutions lose a few samples at the end, less than a frame's worth.
    full = FRAMES * SAMPLES_PER_CODE
    assert full - SAMPLES_PER_CODE < output.audio.shape[0] <= full
    assert output.audio.ndim == 1
    np.testing.assert_array_equal(output.audio, expected)
    # Not silence: equal waveforms of zeros would prove nothing.
    assert float(np.abs(output.audio).max()) > 0.01
    assert output.fetch_time > 0
    assert_freed(producer, handed)


def test_describe(engine: Code2WavEngine, checkpoint: Path) -> None:
    assert engine.describe() == {
        "model": str(checkpoint),
        "device": "cpu",
        "pipeline": "Qwen3OmniMoeCode2Wav",
        "family": "qwen3-omni",
        "sample_rate": SAMPLE_RATE,
        "num_quantizers": NUM_CODE_GROUPS,
        "codebook_size": CODEBOOK_SIZE,
        "samples_per_frame": SAMPLES_PER_CODE,
    }


def test_no_frames_is_no_samples(engine: Code2WavEngine, producer: StageConnectors) -> None:
    empty = torch.zeros((0, NUM_CODE_GROUPS), dtype=torch.int64)
    output = run(
        engine,
        StageDiffusionCoreRequest(
            "empty", inputs={"codes": hand_off(producer, "tcp", "empty", empty)}
        ),
    )
    assert output.error is None, output.error
    assert output.audio is not None
    assert output.audio.dtype == np.float32
    assert output.audio.shape == (0,)


def test_a_param_is_refused_by_name(engine: Code2WavEngine, producer: StageConnectors) -> None:
    handed = hand_off(producer, "shm", "param", codes(1))
    output = run(
        engine, StageDiffusionCoreRequest("param", params={"seed": 3}, inputs={"codes": handed})
    )
    assert output.error is not None
    assert output.error.code is StageErrorCode.BAD_REQUEST
    assert output.error.param == "seed"
    assert output.error.message.startswith("params.seed:")
    assert "takes no sampling parameters" in output.error.message
    assert output.audio is None
    assert_freed(producer, handed)


@pytest.mark.parametrize(
    ("inputs", "images", "param"),
    [
        ({}, [], "codes"),
        ({"prompt_embeds": "tcp"}, [], "prompt_embeds"),
        ({"codes": "tcp"}, [np.zeros((8, 8, 3), dtype=np.uint8)], "image"),
    ],
    ids=["no-codes", "other-input", "image"],
)
def test_inputs_other_than_codes_are_refused(
    engine: Code2WavEngine,
    producer: StageConnectors,
    inputs: dict[str, str],
    images: list[np.ndarray],
    param: str,
) -> None:
    request_id = f"inputs-{param}"
    handed = {
        name: hand_off(producer, connector, f"{request_id}-{name}", codes(2))
        for name, connector in inputs.items()
    }
    output = run(engine, StageDiffusionCoreRequest(request_id, images=images, inputs=handed))
    assert output.error is not None
    assert output.error.code is StageErrorCode.BAD_REQUEST
    assert output.error.param == param
    assert output.audio is None
    for each in handed.values():
        assert_freed(producer, each)


@pytest.mark.parametrize(
    "array",
    [
        torch.zeros((4, NUM_CODE_GROUPS - 1), dtype=torch.int64),
        torch.zeros((4, NUM_CODE_GROUPS), dtype=torch.float32),
        torch.zeros((NUM_CODE_GROUPS,), dtype=torch.int64),
    ],
    ids=["quantizers", "float", "1-d"],
)
def test_codes_of_the_wrong_shape_or_dtype_are_refused(
    engine: Code2WavEngine, producer: StageConnectors, array: torch.Tensor
) -> None:
    handed = hand_off(producer, "tcp", f"shape-{array.dtype}-{array.ndim}", array)
    output = run(engine, StageDiffusionCoreRequest("shape", inputs={"codes": handed}))
    assert output.error is not None
    assert output.error.param == "codes"
    assert output.error.message.startswith("inputs.codes:")
    assert_freed(producer, handed)


def test_an_aborted_request_frees_its_codes(
    engine: Code2WavEngine, producer: StageConnectors
) -> None:
    handed = hand_off(producer, "shm", "aborted", codes(3))
    assert engine.admit("aborted") is None
    engine.abort(["aborted"])
    output = engine.execute(StageDiffusionCoreRequest("aborted", inputs={"codes": handed}))
    assert output.aborted
    assert output.error is None
    assert output.audio is None
    assert_freed(producer, handed)


def test_codes_outside_the_codebook_fail_the_request_only(
    engine: Code2WavEngine, producer: StageConnectors, reference_code2wav: Any
) -> None:
    bad = codes(4)
    bad[5, 9] = CODEBOOK_SIZE
    output = run(
        engine,
        StageDiffusionCoreRequest(
            "outside", inputs={"codes": hand_off(producer, "tcp", "outside", bad)}
        ),
    )
    assert output.error is not None
    # Not the caller's to fix, and no lost input (no param) for the router to run again for.
    assert output.error.code is StageErrorCode.STAGE_FAILED
    assert output.error.param is None
    assert f"code {CODEBOOK_SIZE} at frame 5, quantizer 9" in output.error.message
    assert output.audio is None

    good = codes(5, frames=3)
    after = run(
        engine,
        StageDiffusionCoreRequest(
            "after", inputs={"codes": hand_off(producer, "tcp", "after", good)}
        ),
    )
    assert after.error is None, after.error
    with torch.inference_mode():
        expected = reference_code2wav.chunked_decode(good.T[None])[0, 0].numpy()
    np.testing.assert_array_equal(after.audio, expected)


def test_default_params_are_refused_at_load(checkpoint: Path) -> None:
    from omni_runtime.engine.stage.stage_core_types import InvalidStageRequestError

    config = DiffusionEngineConfig(
        model=str(checkpoint), family="qwen3-omni", default_params={"seed": 1}, device="cpu"
    )
    with pytest.raises(InvalidStageRequestError, match="takes no sampling parameters") as raised:
        Code2WavEngine(config)
    assert raised.value.param == "seed"


def sharded_copy(checkpoint: Path, target: Path, drop: str | None = None) -> Path:
    """``checkpoint`` as the real one is laid out: an index and shards, code2wav's tensors
    (but ``drop``) in a shard of their own. The other shards are named in the index and left
    out: an engine that opened them would fail."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    target.mkdir()
    (target / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as tensors:
        keys = list(tensors.keys())
        code2wav = {
            key: tensors.get_tensor(key)
            for key in keys
            if key.startswith("code2wav.") and key != drop
        }
    save_file(code2wav, str(target / "model-00002-of-00003.safetensors"))
    weight_map = {
        key: "model-00002-of-00003.safetensors"
        if key.startswith("code2wav.")
        else "model-00001-of-00003.safetensors"
        for key in keys
    }
    weight_map["talker.extra"] = "model-00003-of-00003.safetensors"
    index = {"metadata": {}, "weight_map": weight_map}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return target


def test_a_sharded_checkpoint_is_read_from_code2wavs_shards_alone(
    checkpoint: Path, tmp_path: Path, engine: Code2WavEngine
) -> None:
    sharded = Code2WavEngine(
        DiffusionEngineConfig(
            model=str(sharded_copy(checkpoint, tmp_path / "sharded")), device="cpu"
        )
    )
    try:
        mine, theirs = sharded.model.state_dict(), engine.model.state_dict()
        assert mine.keys() == theirs.keys()
        for name, tensor in mine.items():
            assert torch.equal(tensor, theirs[name]), name
    finally:
        sharded.close()


def test_a_missing_tensor_is_an_error_naming_the_checkpoint(
    checkpoint: Path, tmp_path: Path
) -> None:
    from omni_runtime.engine.stage.stage_core_types import InvalidStageRequestError

    broken = sharded_copy(checkpoint, tmp_path / "broken", drop="code2wav.code_embedding.weight")
    with pytest.raises(InvalidStageRequestError) as raised:
        Code2WavEngine(DiffusionEngineConfig(model=str(broken), device="cpu"))
    assert raised.value.param == "model"
    assert str(broken) in str(raised.value)
    assert "code2wav.code_embedding.weight" in str(raised.value)


def test_a_hub_id_fetches_config_index_and_code2wavs_shards_alone(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    from omni_runtime.diffusion import code2wav_engine

    snapshot = sharded_copy(checkpoint, tmp_path / "snapshot")
    asked: list[list[str]] = []

    def snapshot_download(repo_id: str, allow_patterns: list[str]) -> str:
        assert repo_id == "Qwen/Qwen3-Omni-30B-A3B-Instruct"
        asked.append(sorted(allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    path = code2wav_engine._local_checkpoint("Qwen/Qwen3-Omni-30B-A3B-Instruct")
    assert path == str(snapshot)
    assert asked == [
        ["config.json", "model.safetensors.index.json"],
        ["config.json", "model-00002-of-00003.safetensors", "model.safetensors.index.json"],
    ]


def test_chunks_of_one_shape_decode_in_one_batch_as_each_alone(
    engine: Code2WavEngine, producer: StageConnectors
) -> None:
    """Streamed chunks (50 frames: 25 after 25 of left context) of several answers decode
    together, each as it decodes alone; a chunk of another shape runs on its own."""
    context = 25
    arrays = [codes(20 + seed, 50) for seed in range(3)]
    alone = []
    for index, array in enumerate(arrays):
        handed = HandOff(producer.get("shm").put(f"alone-{index}", array), {"context": context})
        output = run(engine, StageDiffusionCoreRequest(f"alone-{index}", inputs={"codes": handed}))
        assert output.audio is not None
        alone.append(output.audio)
    requests = [
        StageDiffusionCoreRequest(
            f"batched-{index}",
            inputs={
                "codes": HandOff(
                    producer.get("shm").put(f"batched-{index}", array), {"context": context}
                )
            },
        )
        for index, array in enumerate(arrays)
    ]
    keys = {engine.batch_key(request) for request in requests}
    assert keys == {(50, context)}
    other = StageDiffusionCoreRequest(
        "other", inputs={"codes": HandOff(producer.get("shm").put("other", codes(9, 30)))}
    )
    assert engine.batch_key(other) not in keys
    for request in requests:
        assert engine.admit(request.request_id) is None
    outputs = engine.execute_batch(requests)
    for output, expected in zip(outputs, alone, strict=True):
        assert output.error is None, output.error
        assert output.audio is not None
        # The left context's samples are dropped: 25 frames' worth, less what the causal
        # convolutions lose at the end.
        assert output.audio.shape == expected.shape
        assert expected.shape[0] <= 25 * SAMPLES_PER_CODE
        # One matrix product over the batch rounds as one over each row may not.
        np.testing.assert_allclose(output.audio, expected, atol=1e-5)
    assert not np.allclose(outputs[0].audio, outputs[1].audio)  # type: ignore[arg-type]
    assert engine.admit("other") is None
    engine.execute(other)
