"""Qwen3-Omni served: ``omni-runtime serve`` of the tiny checkpoint as its three stages
(thinker and talker on vLLM, code2wav on its own engine, shared memory between them), asked
with the official client, against transformers' ``generate(..., return_audio=True)`` on the
same weights, greedy.

The served audio is 16-bit PCM (every OpenAI format is), so a waveform is compared with the
reference's as 16-bit samples: within one step of it. The stages' own float outputs are
compared exactly where they are made: the talker's codes in test_tiny_qwen3_omni.py,
code2wav's waveform in test_code2wav_engine.py.
"""

from __future__ import annotations

import base64
import io
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import yaml
from serving import serving, wait_until

from omni_runtime.audio import pcm16_bytes
from omni_runtime.tiny_models import QWEN3_OMNI_SUBDIR
from omni_runtime.tiny_models.qwen3_omni import AUDIO_SAMPLE_RATE, OUTPUT_SAMPLE_RATE

pytestmark = pytest.mark.integration
pytest.importorskip("torchvision", reason="Qwen3OmniMoeProcessor needs torchvision")

PROMPT = "draw a red cat under the moon"
MODEL = "tiny-qwen3-omni"
THINKER_TOKENS = 16
# Long enough that an abort lands while the talker speaks.
TALKER_TOKENS = 200
REPETITION_PENALTY = 1.05


def config(checkpoint: Path) -> dict[str, Any]:
    example = yaml.safe_load(
        (Path(__file__).parents[2] / "examples" / "tiny-qwen3-omni.yaml").read_text()
    )
    example["model"] = str(checkpoint)
    talker = example["stages"][1]
    talker["defaultSamplingParams"]["max_tokens"] = TALKER_TOKENS
    return dict(example)


@pytest.fixture(scope="module")
def checkpoint(tiny_models: Path) -> Path:
    return tiny_models / QWEN3_OMNI_SUBDIR


@pytest.fixture(scope="module")
def served(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("qwen3-omni-serve")
    path = work / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config(checkpoint)))
    with serving(path, work, timeout=400) as url:
        yield url


@pytest.fixture(scope="module")
def client(served: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=served, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def processor(checkpoint: Path) -> Any:
    from transformers import Qwen3OmniMoeProcessor

    return Qwen3OmniMoeProcessor.from_pretrained(checkpoint, local_files_only=True)


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> Any:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    loaded = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32, local_files_only=True
    )
    return loaded.eval()


def sine(frequency: float, seconds: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * AUDIO_SAMPLE_RATE)) / AUDIO_SAMPLE_RATE
    return (0.5 * np.sin(2 * np.pi * frequency * t)).astype(np.float32)


def wav_base64(samples: np.ndarray) -> str:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(AUDIO_SAMPLE_RATE)
        out.writeframes(pcm16_bytes(samples))
    return base64.b64encode(buffer.getvalue()).decode()


def reference(
    model: Any,
    processor: Any,
    audio: np.ndarray | None,
    speak: bool,
    image: np.ndarray | None = None,
) -> tuple[str, np.ndarray | None]:
    """transformers' answer, greedy: its text, and its waveform where it speaks."""
    from PIL import Image

    content: list[dict[str, Any]] = [{"type": "text", "text": PROMPT}]
    if audio is not None:
        content.insert(0, {"type": "input_audio"})
    if image is not None:
        content.insert(0, {"type": "image"})
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    inputs = processor(
        text=text,
        audio=[audio] if audio is not None else None,
        images=[Image.fromarray(image)] if image is not None else None,
        return_tensors="pt",
    )
    with torch.no_grad():
        result = model.generate(
            **inputs,
            return_audio=speak,
            speaker="Ethan",
            thinker_max_new_tokens=THINKER_TOKENS,
            thinker_do_sample=False,
            thinker_eos_token_id=model.config.im_end_token_id,
            talker_max_new_tokens=TALKER_TOKENS,
            talker_do_sample=False,
            talker_repetition_penalty=REPETITION_PENALTY,
        )
    sequences, waveform = result if speak else (result, None)
    tokens = sequences[0, inputs["input_ids"].shape[1] :]
    # As vLLM's incremental detokenizer ends a text: random weights write random bytes, and
    # those of a last character left incomplete are dropped, not shown as U+FFFD.
    answer = processor.tokenizer.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
    samples = waveform.reshape(-1).numpy() if waveform is not None else None
    return answer, samples


def as_pcm16(samples: np.ndarray) -> np.ndarray:
    return np.frombuffer(pcm16_bytes(samples), dtype="<i2").astype(np.int32)


def wav_samples(data: str) -> np.ndarray:
    with wave.open(io.BytesIO(base64.b64decode(data))) as read:
        assert (read.getframerate(), read.getnchannels(), read.getsampwidth()) == (
            OUTPUT_SAMPLE_RATE,
            1,
            2,
        )
        return np.frombuffer(read.readframes(read.getnframes()), dtype="<i2").astype(np.int32)


def ask(client: openai.OpenAI, content: Any, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=THINKER_TOKENS,
        temperature=0.0,
        **kwargs,
    )


# --- Equal to transformers --------------------------------------------------------------


def test_text_alone_is_the_thinkers_answer(
    client: openai.OpenAI, model: Any, processor: Any
) -> None:
    answer = ask(client, PROMPT)
    expected, _ = reference(model, processor, None, speak=False)
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].message.audio is None


def test_a_spoken_answer_is_transformers_text_and_waveform(
    client: openai.OpenAI, model: Any, processor: Any
) -> None:
    answer = ask(
        client, PROMPT, modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"}
    )
    message = answer.choices[0].message
    expected_text, expected = reference(model, processor, None, speak=True)
    assert expected is not None
    assert message.content is None
    assert message.audio.transcript == expected_text
    assert message.audio.id.startswith("audio_")
    served = wav_samples(message.audio.data)
    # Several seconds of sound, 16-bit: within one step of the reference's every sample.
    assert len(served) == len(expected) > OUTPUT_SAMPLE_RATE
    assert np.abs(served - as_pcm16(expected)).max() <= 1
    assert served.std() > 1000  # audible
    assert answer.usage.completion_tokens == THINKER_TOKENS


def test_audio_input_reaches_the_thinker_and_is_answered_in_audio(
    client: openai.OpenAI, model: Any, processor: Any
) -> None:
    heard = sine(440.0)
    content = [
        {"type": "input_audio", "input_audio": {"data": wav_base64(heard), "format": "wav"}},
        {"type": "text", "text": PROMPT},
    ]
    answer = ask(
        client, content, modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"}
    )
    # The WAV the client sent is 16-bit: the reference hears the same quantised samples.
    quantised = (as_pcm16(heard) / 32768.0).astype(np.float32)
    expected_text, expected = reference(model, processor, quantised, speak=True)
    assert expected is not None
    assert answer.choices[0].message.audio.transcript == expected_text
    text_only, _ = reference(model, processor, None, speak=False)
    assert expected_text != text_only  # the sound changed the answer
    served = np.frombuffer(base64.b64decode(answer.choices[0].message.audio.data), "<i2")
    assert np.abs(served.astype(np.int32) - as_pcm16(expected)).max() <= 1


def png_data_url(image: np.ndarray) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_an_image_reaches_the_thinker(client: openai.OpenAI, model: Any, processor: Any) -> None:
    image = np.random.default_rng(3).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    content = [
        {"type": "image_url", "image_url": {"url": png_data_url(image)}},
        {"type": "text", "text": PROMPT},
    ]
    answer = ask(client, content)
    expected, _ = reference(model, processor, None, speak=False, image=image)
    text_only, _ = reference(model, processor, None, speak=False)
    assert answer.choices[0].message.content == expected
    assert expected != text_only  # the image changed the answer
    # A spoken answer to an image is refused before any stage runs.
    with pytest.raises(openai.BadRequestError) as refused:
        ask(
            client, content, modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"}
        )
    assert refused.value.body["param"] == "messages"  # type: ignore[index]


def test_a_streamed_answer_is_the_same_transcript_and_samples(client: openai.OpenAI) -> None:
    whole = ask(
        client, PROMPT, modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"}
    )
    stream = ask(
        client,
        PROMPT,
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"},
        stream=True,
        stream_options={"include_usage": True},
    )
    transcript: list[str] = []
    data: list[bytes] = []
    ids: set[str] = set()
    finish = None
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        # The official client's ChoiceDeltaAudio.
        audio = choice.delta.audio
        if audio is None:
            continue
        if audio.id:
            ids.add(audio.id)
        if audio.transcript:
            # The text comes before any of the audio.
            assert not data
            transcript.append(audio.transcript)
        if audio.data:
            data.append(base64.b64decode(audio.data))
        finish = choice.finish_reason or finish
    assert "".join(transcript) == whole.choices[0].message.audio.transcript
    assert b"".join(data) == base64.b64decode(whole.choices[0].message.audio.data)
    # Half a second a chunk.
    assert len(data) > 1
    assert all(len(piece) <= OUTPUT_SAMPLE_RATE for piece in data)
    assert len(ids) == 1
    assert finish == whole.choices[0].finish_reason
    assert usage is not None
    assert usage.completion_tokens == THINKER_TOKENS


# --- Bad requests -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "content", "param"),
    [
        (
            {"modalities": ["text", "audio"], "audio": {"voice": "nobody", "format": "wav"}},
            PROMPT,
            "audio.voice",
        ),
        (
            {"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "ogg"}},
            PROMPT,
            "audio.format",
        ),
        (
            {
                "modalities": ["text", "audio"],
                "audio": {"voice": "ethan", "format": "wav"},
                "stream": True,
            },
            PROMPT,
            "audio.format",
        ),
        ({"modalities": ["text", "audio"]}, PROMPT, "audio"),
        (
            {"modalities": ["audio"], "audio": {"voice": "ethan", "format": "wav"}},
            PROMPT,
            "modalities",
        ),
        ({"audio": {"voice": "ethan", "format": "wav"}}, PROMPT, "audio"),
        ({"modalities": ["image"]}, PROMPT, "modalities"),
        (
            {},
            [{"type": "input_audio", "input_audio": {"data": "bm90IGF1ZGlv", "format": "wav"}}],
            "messages[0].content[0].input_audio.data",
        ),
        (
            {},
            [{"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}],
            "messages[0].content[0].input_audio.data",
        ),
        (
            {},
            [{"type": "input_audio", "input_audio": {"data": "", "format": "flac"}}],
            "messages[0].content[0].input_audio.format",
        ),
        (
            {},
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
            "messages[0].content[0].image_url.url",
        ),
    ],
)
def test_a_malformed_audio_request_is_a_400_naming_its_field(
    client: openai.OpenAI, kwargs: dict[str, Any], content: Any, param: str
) -> None:
    # Refused before any stage is asked, so before a stream would start.
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, content, **kwargs)
    assert refused.value.body["param"] == param, refused.value.body  # type: ignore[index]


# --- Aborts -----------------------------------------------------------------------------


def stage_in_flight(http: httpx.Client) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("omni_stage_in_flight{"):
            stage = line.split('stage="', 1)[1].split('"', 1)[0]
            counts[stage] = float(line.split()[-1])
    return counts


def test_a_client_gone_while_the_talker_speaks_frees_every_stage(served: str) -> None:
    root = served.removesuffix("/v1")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": THINKER_TOKENS,
        "modalities": ["text", "audio"],
        "audio": {"voice": "ethan", "format": "pcm16"},
        "stream": True,
    }
    with httpx.Client(base_url=root, timeout=120) as http:
        start = time.perf_counter()
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            # Gone once the talker has the request: the thinker has finished its text.
            wait_until(
                lambda: stage_in_flight(http).get("talker", 0) >= 1, 60, "the talker speaking", 0.01
            )
        gone = time.perf_counter() - start
        counts = wait_until(
            lambda: (c := stage_in_flight(http)) and all(v == 0 for v in c.values()) and c,
            30,
            "every stage free",
            0.02,
        )
        assert set(counts) == {"thinker", "talker", "code2wav"}
        # The talker would have spoken TALKER_TOKENS frames; it was stopped well before.
        assert time.perf_counter() - start < gone + 10
        # And the pipeline answers the next request whole.
        answer = http.post(
            "/v1/chat/completions",
            json={**body, "stream": False, "audio": {"voice": "ethan", "format": "wav"}},
        )
        assert answer.status_code == 200
        assert len(wav_samples(answer.json()["choices"][0]["message"]["audio"]["data"])) > 0
