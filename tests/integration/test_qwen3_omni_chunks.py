"""Qwen3-Omni served with asyncChunk: the talker hands code2wav its codes every
``chunk_frames`` frames, code2wav decodes each chunk as it comes (after its left context),
and the caller gets the audio chunk by chunk; over each connector.

The answer is transformers' ``code2wav.chunked_decode`` of transformers' codes with the same
chunk and context sizes: chunked decoding is what the stream computes, whether the caller
reads it streamed or whole (a whole decode of every frame at once differs from it in the
samples near each chunk's start, where the convolutions see less context).
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import yaml
from serving import mooncake_unavailable, serving, wait_until
from test_qwen3_omni_serving import (
    MODEL,
    PROMPT,
    REPETITION_PENALTY,
    THINKER_TOKENS,
    as_pcm16,
    ask,
    stage_in_flight,
)
from test_serving import omni_shm_files

from omni_runtime.connectors.mooncake import with_mooncake_library_path
from omni_runtime.families import FAMILIES
from omni_runtime.tiny_models import QWEN3_OMNI_SUBDIR

pytestmark = pytest.mark.integration
pytest.importorskip("torchvision", reason="Qwen3OmniMoeProcessor needs torchvision")

SPEECH = FAMILIES["qwen3-omni"].speech
assert SPEECH is not None
# Eight chunks of codes, and a last of what is left.
TALKER_TOKENS = 8 * SPEECH.chunk_frames + 7
CONNECTORS: dict[str, dict[str, Any]] = {
    "shm": {"name": "SharedMemoryConnector"},
    "tcp": {"name": "TCPConnector"},
    "mooncake": {
        "name": "MooncakeTransferEngineConnector",
        "extra": {
            "host": "127.0.0.1",
            "zmq_port": 0,
            "protocol": "tcp",
            "memory_pool_size": 64 * 1024 * 1024,
        },
    },
}


@pytest.fixture(scope="module", params=list(CONNECTORS))
def served(
    request: pytest.FixtureRequest, tiny_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    connector: str = request.param
    if connector == "mooncake" and (why := mooncake_unavailable()):
        message = f"Mooncake's engine cannot load here ({why}); run scripts/mooncake_libs.sh"
        if os.environ.get("OMNI_REQUIRE_MOONCAKE") == "1":
            pytest.fail(message)
        pytest.skip(message)
    example = yaml.safe_load(
        (Path(__file__).parents[2] / "examples" / "tiny-qwen3-omni.yaml").read_text()
    )
    example["model"] = str(tiny_models / QWEN3_OMNI_SUBDIR)
    example["asyncChunk"] = True
    example["connectors"] = {connector: CONNECTORS[connector]}
    for stage in example["stages"][1:]:
        stage["inputConnectors"] = {f"from_stage_{stage['stageId'] - 1}": connector}
    example["stages"][1]["defaultSamplingParams"]["max_tokens"] = TALKER_TOKENS
    work = tmp_path_factory.mktemp(f"qwen3-omni-chunks-{connector}")
    path = work / "pipeline.yaml"
    path.write_text(yaml.safe_dump(example))
    with serving(path, work, timeout=400, env=with_mooncake_library_path(os.environ)) as url:
        yield connector, url


@pytest.fixture(scope="module")
def client(served: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1], api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def chunked_reference(tiny_models: Path) -> np.ndarray:
    """transformers' greedy answer, its codes decoded chunk by chunk as the stream does."""
    from transformers import Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeProcessor

    checkpoint = tiny_models / QWEN3_OMNI_SUBDIR
    processor = Qwen3OmniMoeProcessor.from_pretrained(checkpoint, local_files_only=True)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32, local_files_only=True
    ).eval()
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    codes: list[torch.Tensor] = []
    hook = model.code2wav.register_forward_pre_hook(
        lambda _module, args: codes.append(args[0].clone())
    )
    try:
        with torch.no_grad():
            model.generate(
                **processor(text=text, return_tensors="pt"),
                return_audio=True,
                speaker="Ethan",
                thinker_max_new_tokens=THINKER_TOKENS,
                thinker_do_sample=False,
                thinker_eos_token_id=model.config.im_end_token_id,
                talker_max_new_tokens=TALKER_TOKENS,
                talker_do_sample=False,
                talker_repetition_penalty=REPETITION_PENALTY,
            )
    finally:
        hook.remove()
    assert codes[0].shape[-1] == TALKER_TOKENS - 1
    with torch.no_grad():
        chunked = model.code2wav.chunked_decode(
            codes[0], chunk_size=SPEECH.chunk_frames, left_context_size=SPEECH.context_frames
        )
    samples: np.ndarray = chunked.reshape(-1).numpy()
    return samples


def _spoken(client: openai.OpenAI) -> np.ndarray:
    answer = ask(
        client, PROMPT, modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"}
    )
    return np.frombuffer(base64.b64decode(answer.choices[0].message.audio.data), "<i2")


def test_a_chunked_answer_is_transformers_chunked_decode(
    served: tuple[str, str], client: openai.OpenAI, chunked_reference: np.ndarray
) -> None:
    served_samples = _spoken(client).astype(np.int32)
    assert len(served_samples) == len(chunked_reference)
    assert np.abs(served_samples - as_pcm16(chunked_reference)).max() <= 1
    if served[0] == "shm":
        # Every chunk was fetched: the talker's segments are gone.
        assert not omni_shm_files()


def test_audio_reaches_the_caller_while_the_talker_still_speaks(
    served: tuple[str, str], client: openai.OpenAI
) -> None:
    whole = _spoken(client).tobytes()
    root = served[1].removesuffix("/v1")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": THINKER_TOKENS,
        "temperature": 0.0,
        "modalities": ["text", "audio"],
        "audio": {"voice": "ethan", "format": "pcm16"},
        "stream": True,
    }
    pieces: list[bytes] = []
    talking_at_first_audio: float | None = None
    with httpx.Client(base_url=root, timeout=120) as http:
        start = time.perf_counter()
        first_audio = None
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = httpx.Response(200, content=line[6:]).json()
                for choice in chunk["choices"]:
                    data = (choice["delta"].get("audio") or {}).get("data")
                    if data:
                        if first_audio is None:
                            first_audio = time.perf_counter() - start
                            talking_at_first_audio = stage_in_flight(http).get("talker", 0)
                        pieces.append(base64.b64decode(data))
        total = time.perf_counter() - start
    # The consumer started on the first chunk: code2wav's audio came while the talker had
    # most of its frames still to speak.
    assert talking_at_first_audio == 1
    assert first_audio is not None
    assert first_audio < 0.6 * total
    # The same samples as the whole answer's, within one PCM level: chunks of one answer
    # waiting together decode as one batch (code2wav_engine.batch_key), and how many wait
    # depends on the machine's load; CPU convolutions of a batch of two may differ from
    # two of one in the last bit, which can turn a rounding.
    streamed = np.frombuffer(b"".join(pieces), "<i2").astype(np.int32)
    assert len(streamed) == len(whole) // 2
    assert np.abs(streamed - np.frombuffer(whole, "<i2")).max() <= 1


def test_a_client_gone_mid_stream_frees_every_stage_and_connector(
    served: tuple[str, str],
) -> None:
    root = served[1].removesuffix("/v1")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": THINKER_TOKENS,
        "modalities": ["text", "audio"],
        "audio": {"voice": "ethan", "format": "pcm16"},
        "stream": True,
    }
    with httpx.Client(base_url=root, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if '"data":' in line:
                    break  # the first audio: chunks are in flight between the stages
        wait_until(
            lambda: (c := stage_in_flight(http)) and all(v == 0 for v in c.values()),
            30,
            "every stage free",
            0.02,
        )
        if served[0] == "shm":
            wait_until(lambda: not omni_shm_files(), 30, "the talker's chunks released")
        answer = http.post(
            "/v1/chat/completions",
            json={**body, "stream": False, "audio": {"voice": "ethan", "format": "pcm16"}},
        )
        assert answer.status_code == 200
