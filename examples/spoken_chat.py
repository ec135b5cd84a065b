"""A spoken answer from a real three-stage Qwen3-Omni pipeline, on this machine.

Builds the tiny models (once), starts ``omni-runtime serve -f examples/tiny-qwen3-omni.yaml``
(a tiny Qwen3-Omni: its thinker and talker on vLLM, its code2wav vocoder in a process of its
own, shared memory between them, behind the OpenAI-compatible router), asks it for a spoken
answer with the official ``openai`` client (a chat completion with ``modalities: ["text",
"audio"]``; a question recorded in a WAV or MP3 goes in as an ``input_audio`` part), writes
the audio, prints its transcript and length, and stops everything. With ``--stream`` the
answer arrives as chunks of 16-bit PCM (the one format OpenAI streams audio in), joined and
written as a WAV. The weights are random: the transcript is gibberish and the voice is
noise; the machinery is real.

    .venv/bin/python examples/spoken_chat.py [--out out] [--prompt "..."] [--voice ethan]
        [--format wav] [--audio question.wav] [--stream]
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import time
import wave
from pathlib import Path
from typing import Any

import openai
from _serving import serving

PIPELINE = Path(__file__).resolve().parent / "tiny-qwen3-omni.yaml"
# Qwen3-Omni speaks at 24 kHz, which is also the rate of OpenAI's raw pcm16.
SAMPLE_RATE = 24_000
VOICES = ("ethan", "chelsie", "aiden")
FORMATS = ("wav", "mp3", "flac", "opus", "aac", "pcm16")
INPUT_FORMATS = ("wav", "mp3")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--prompt", default="Tell me a short story about a lighthouse.")
    parser.add_argument("--voice", default="ethan", choices=VOICES)
    parser.add_argument(
        "--format", default="wav", choices=FORMATS, help="pcm16 is written as a WAV"
    )
    parser.add_argument("--audio", type=Path, help="a spoken question (.wav or .mp3)")
    parser.add_argument(
        "--stream", action="store_true", help="stream the answer as pcm16, written as a WAV"
    )
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for serve")
    args = parser.parse_args()
    if args.stream and args.format not in ("wav", "pcm16"):
        parser.error("--stream: audio streams as pcm16 only (written as a WAV); drop --format")
    audio_format = "pcm16" if args.stream else args.format
    # Checked before the pipeline starts: a wrong file fails in a second, not after startup.
    content = _content(parser, args.prompt, args.audio)

    with serving(PIPELINE, args.port, args.timeout) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=300)
        model = client.models.list().data[0].id
        how = "streamed pcm16" if args.stream else audio_format
        print(f"asking {model} at {base_url} for a spoken answer ({args.voice}, {how})")
        start = time.perf_counter()
        request = _request(model, content, args.voice, audio_format)
        ask = _ask_streamed if args.stream else _ask
        transcript, audio = ask(client, request)
        elapsed = time.perf_counter() - start
        path = _write(audio, audio_format, args.out)
        print(f"transcript: {transcript!r}")
        print(f"wrote {path} ({_seconds(path):.2f} s of audio, {elapsed:.2f} s for the request)")
    return 0


def _content(
    parser: argparse.ArgumentParser, prompt: str, audio: Path | None
) -> str | list[dict[str, Any]]:
    """The user message's content: the prompt, after the spoken question if there is one
    (the thinker hears it first, then reads what to do with it)."""
    if audio is None:
        return prompt
    audio_format = audio.suffix.lower().removeprefix(".")
    if audio_format not in INPUT_FORMATS:
        parser.error(f"--audio: a .wav or .mp3 file, not {audio.name}")
    if not audio.is_file():
        parser.error(f"--audio: no file {audio}")
    data = base64.b64encode(audio.read_bytes()).decode()
    return [
        {"type": "input_audio", "input_audio": {"data": data, "format": audio_format}},
        {"type": "text", "text": prompt},
    ]


def _request(
    model: str, content: str | list[dict[str, Any]], voice: str, audio_format: str
) -> dict[str, Any]:
    """A chat completion that asks for the answer spoken as well as written."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "modalities": ["text", "audio"],
        "audio": {"voice": voice, "format": audio_format},
    }


def _ask(client: openai.OpenAI, request: dict[str, Any]) -> tuple[str, bytes]:
    """The whole answer at once: its transcript and the audio file's bytes."""
    response = client.chat.completions.create(**request)
    audio = response.choices[0].message.audio
    if audio is None:
        raise SystemExit(f"no audio in the answer: {response.choices[0].message!r}")
    return audio.transcript, base64.b64decode(audio.data)


def _ask_streamed(client: openai.OpenAI, request: dict[str, Any]) -> tuple[str, bytes]:
    """The answer as it is spoken: the transcript comes first, then the samples chunk by
    chunk (each could be played as it arrives); both joined."""
    transcript: list[str] = []
    chunks: list[bytes] = []
    for chunk in client.chat.completions.create(**request, stream=True):
        if not chunk.choices or chunk.choices[0].delta.audio is None:
            continue
        audio = chunk.choices[0].delta.audio
        if audio.transcript:
            transcript.append(audio.transcript)
        if audio.data:
            chunks.append(base64.b64decode(audio.data))
    if not chunks:
        raise SystemExit("the stream ended without audio")
    print(f"received {len(chunks)} chunks of audio")
    return "".join(transcript), b"".join(chunks)


def _write(audio: bytes, audio_format: str, out: Path) -> Path:
    """``out/answer.<format>``; raw pcm16 gets a WAV header, so that any player opens it."""
    out.mkdir(parents=True, exist_ok=True)
    if audio_format != "pcm16":
        path = (out / f"answer.{audio_format}").resolve()
        path.write_bytes(audio)
        return path
    path = (out / "answer.wav").resolve()
    with wave.open(str(path), "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(SAMPLE_RATE)
        file.writeframes(audio)
    return path


def _seconds(path: Path) -> float:
    """The audio's length, from its samples (a compressed file's header may not say it)."""
    if path.suffix == ".wav":
        with wave.open(str(path), "rb") as file:
            return file.getnframes() / file.getframerate()
    import av  # FFmpeg's decoders, as the runtime encodes with them

    with av.open(str(path)) as container:
        return sum(frame.samples / frame.sample_rate for frame in container.decode(audio=0))


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.exit(main())
