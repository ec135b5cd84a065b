"""The README's main job and examples as a newcomer runs them: real requests through real
pipelines that write PNG, MP4 and WAV files, with a readable terminal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("script", "written", "args"),
    [
        # README's first command: the seed's edit (an image and an instruction through chat
        # completions) on the tiny Qwen-Image-Edit pipeline.
        ("image_edit.py", ["input.png", "edited.png"], ["--steps", "2"]),
        ("text_to_image.py", ["text-to-image.png"], ["--size", "64x64", "--steps", "2"]),
    ],
)
def test_example_serves_the_pipeline_and_writes_a_png(
    script: str, written: list[str], args: list[str], tiny_models: Path, tmp_path: Path
) -> None:
    """An example as a newcomer runs it: serve the two-stage pipeline, ask it for an image
    with the openai client, write the PNG, stop everything."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.endswith("_VERBOSITY")}
    env["OMNI_TINY_MODELS"] = str(tiny_models)
    example = Path(__file__).parents[2] / "examples" / script
    result = subprocess.run(
        [sys.executable, str(example), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(written)
    png = out / written[-1]
    with Image.open(png) as image:
        assert image.size == (64, 64)
    lines = result.stdout.splitlines()
    assert any(line.startswith("serving http://127.0.0.1:") for line in lines), result.stdout
    assert f"wrote {png.resolve()}" in result.stdout
    assert lines[-1] == "stopped the pipeline"
    for noise in ("Traceback", "Loading pipeline components", "torchvision", "it/s]"):
        assert noise not in result.stdout + result.stderr
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("omni-")]


def test_the_video_example_writes_an_mp4(tiny_models: Path, tmp_path: Path) -> None:
    """examples/text_to_video.py as a newcomer runs it: serve the tiny Wan2.2, make a clip
    through the Videos API with the openai client, write the MP4, stop everything."""
    import av

    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.endswith("_VERBOSITY")}
    env["OMNI_TINY_MODELS"] = str(tiny_models)
    example = Path(__file__).parents[2] / "examples" / "text_to_video.py"
    result = subprocess.run(
        [sys.executable, str(example), "--out", str(out), "--frames", "5", "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    mp4 = out / "text-to-video.mp4"
    assert sorted(out.iterdir()) == [mp4]
    with av.open(str(mp4)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5
    assert frames[0].shape == (32, 64, 3)
    lines = result.stdout.splitlines()
    assert any(line.startswith(f"wrote {mp4.resolve()} (64x32, ") for line in lines), lines
    assert lines[-1] == "stopped the pipeline"
    for noise in ("Traceback", "Loading pipeline components", "it/s]", "Sora"):
        assert noise not in result.stdout + result.stderr


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_spoken_chat_example_writes_a_wav(
    stream: bool, tiny_models: Path, tmp_path: Path
) -> None:
    """examples/spoken_chat.py as a newcomer runs it: serve the tiny Qwen3-Omni (thinker,
    talker, code2wav), ask for a spoken answer with the openai client, write it as a WAV,
    stop everything. Streamed, the pcm16 chunks are joined into the WAV, and the question
    is asked aloud too (an input_audio part)."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.endswith("_VERBOSITY")}
    env["OMNI_TINY_MODELS"] = str(tiny_models)
    example = Path(__file__).parents[2] / "examples" / "spoken_chat.py"
    args = ["--out", str(out)]
    if stream:
        question = tmp_path / "question.wav"
        _write_tone(question, seconds=0.5, sample_rate=16000)
        args += ["--stream", "--audio", str(question)]
    result = subprocess.run(
        [sys.executable, str(example), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    answer = out / "answer.wav"
    assert sorted(out.iterdir()) == [answer]
    with wave.open(str(answer), "rb") as read:
        assert (read.getframerate(), read.getnchannels(), read.getsampwidth()) == (24000, 1, 2)
        frames = read.getnframes()
        samples = np.frombuffer(read.readframes(frames), dtype="<i2").astype(np.float64)
    assert len(samples) == frames > 12000  # more than half a second
    # Noise from random weights, but sound: louder than -40 dBFS (silence is all zeros).
    assert np.sqrt(np.mean(samples**2)) > 300
    lines = result.stdout.splitlines()
    wrote = f"wrote {answer.resolve()} ({frames / 24000:.2f} s of audio, "
    assert any(line.startswith(wrote) for line in lines), lines
    (transcript,) = [line for line in lines if line.startswith("transcript: ")]
    assert transcript not in ("transcript: ''", 'transcript: ""')
    chunks = [line.split()[1] for line in lines if line.startswith("received ")]
    if stream:
        (count,) = chunks
        assert int(count) > 1  # several chunks, not the whole answer in one
    else:
        assert chunks == []
    assert lines[-1] == "stopped the pipeline"
    for noise in ("Traceback", "it/s]"):
        assert noise not in result.stdout + result.stderr
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("omni-")]


def _write_tone(path: Path, seconds: float, sample_rate: int) -> None:
    """A spoken question's stand-in: an A (440 Hz) at half scale, 16-bit mono."""
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    pcm = (0.5 * 32767 * np.sin(2 * np.pi * 440.0 * t)).astype("<i2")
    with wave.open(str(path), "wb") as write:
        write.setnchannels(1)
        write.setsampwidth(2)
        write.setframerate(sample_rate)
        write.writeframes(pcm.tobytes())


REPO = Path(__file__).resolve().parents[2]
# What the setup scripts may print: their own one-line steps, and the venv's path last.
_SETUP_LINE = re.compile(r"\[setup \d\d:\d\d:\d\d\] .+|\[mooncake-libs\] .+|/.+/\.venv")


def _noise(output: str) -> list[str]:
    return [line for line in output.splitlines() if line and not _SETUP_LINE.fullmatch(line)]


def test_setup_prints_one_line_per_step_and_no_tool_noise(tmp_path: Path) -> None:
    """The first half of README's first command, as a newcomer's terminal shows it: the
    environment set up (warm here: the suite runs in it), then Mooncake's libraries fetched
    cold into an empty cache (apt-get download as root says "W: ..."; it goes to a log)."""
    setup = subprocess.run(
        [str(REPO / "scripts/setup.sh")], capture_output=True, text=True, timeout=600
    )
    assert setup.returncode == 0, setup.stderr
    assert _noise(setup.stdout + setup.stderr) == []
    assert setup.stdout.strip() == str(REPO / ".venv")

    libs = subprocess.run(
        [str(REPO / "scripts/mooncake_libs.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMNI_CACHE_DIR": str(tmp_path)},
    )
    assert libs.returncode == 0, libs.stderr
    assert "[mooncake-libs] extracting" in libs.stderr
    assert _noise(libs.stderr) == []
    assert (tmp_path / "mooncake-libs" / "download.log").read_text()  # kept, not lost


def test_the_readme_commands_are_on_the_venv_path() -> None:
    """README tells a user to run `kopf run ...`: the thin venv carries the base's
    commands, with its own interpreter (the one that sees this project)."""
    for command in ("kopf", "omni-runtime", "pytest"):
        path = REPO / ".venv" / "bin" / command
        assert path.exists(), command
        assert path.read_text().splitlines()[0] == f"#!{REPO / '.venv' / 'bin' / 'python'}"
    version = subprocess.run(
        [str(REPO / ".venv/bin/kopf"), "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.returncode == 0
    assert "kopf" in version.stdout
