"""omni_runtime.audio: input_audio parts decoded to a model's samples, and a model's samples
encoded as each output format OpenAI defines."""

from __future__ import annotations

import base64
import io
import struct
import wave
from typing import Any

import av
import numpy as np
import pytest

from omni_runtime.audio import (
    AUDIO_FORMATS,
    MEDIA_TYPES,
    STREAM_FORMATS,
    InvalidAudioError,
    decode_input_audio,
    encode_audio,
    pcm16_bytes,
)

PART = "messages[0].content[1].input_audio"
RATE = 16_000  # what Qwen3-Omni's processor takes
MODEL_RATE = 24_000  # what Qwen3-Omni's talker outputs
LSB = 1 / 32768


def _sine(rate: int, seconds: float = 1.0, hz: float = 440.0, amplitude: float = 0.5) -> Any:
    t = np.arange(round(rate * seconds)) / rate
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def _dominant_hz(samples: Any, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum) * rate / len(samples))


def _rms(samples: Any) -> float:
    return float(np.sqrt(np.mean(np.square(samples, dtype=np.float64))))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _decode(data: bytes, audio_format: str, max_seconds: float = 30.0) -> Any:
    return decode_input_audio(
        _b64(data), audio_format, sample_rate=RATE, max_seconds=max_seconds, param=PART
    )


def _stdlib_wav(channels: list[Any], rate: int, sample_width: int = 2) -> bytes:
    """A PCM WAV written by the stdlib, not by the module under test: int samples per
    channel, in the range of ``sample_width`` bytes (8-bit is unsigned, as WAV has it)."""
    interleaved = np.stack(channels, axis=1).reshape(-1)
    if sample_width == 1:
        raw = interleaved.astype(np.uint8).tobytes()
    elif sample_width == 3:
        raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in interleaved)
    else:
        raw = interleaved.astype(f"<i{sample_width}").tobytes()
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(len(channels))
        w.setsampwidth(sample_width)
        w.setframerate(rate)
        w.writeframes(raw)
    return out.getvalue()


def _float_wav(samples: Any, rate: int) -> bytes:
    """A WAVE_FORMAT_IEEE_FLOAT (32-bit) mono WAV: the one WAV that can hold values past
    full scale."""
    data = np.asarray(samples, dtype="<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _av_mp3(channels: list[Any], rate: int) -> bytes:
    """An MP3 of float channels, encoded here with PyAV (stereo, which the module never
    writes)."""
    layout = {1: "mono", 2: "stereo"}[len(channels)]
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp3") as container:
        stream = container.add_stream("libmp3lame", rate=rate)
        assert isinstance(stream, av.AudioStream)
        stream.layout = layout
        frame = av.AudioFrame.from_ndarray(
            np.stack(channels).astype(np.float32), format="fltp", layout=layout
        )
        frame.sample_rate = rate
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return out.getvalue()


def _av_decode(data: bytes, container_format: str) -> tuple[Any, int]:
    """Decoded by PyAV alone, to mono float: what any client's decoder would hear."""
    chunks = []
    rate = 0
    with av.open(io.BytesIO(data), mode="r", format=container_format) as container:
        resampler = av.AudioResampler(format="flt", layout="mono")
        for frame in container.decode(audio=0):
            rate = frame.sample_rate
            chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
    return np.concatenate(chunks), rate


# input_audio


def test_wav_at_the_model_rate_comes_back_sample_for_sample() -> None:
    sine = _sine(RATE)
    decoded = _decode(encode_audio(sine, RATE, "wav"), "wav")
    assert decoded.dtype == np.float32
    assert decoded.shape == sine.shape
    assert np.max(np.abs(decoded - sine)) <= LSB
    assert _dominant_hz(decoded, RATE) == pytest.approx(440, abs=1)


@pytest.mark.parametrize("audio_format", ["wav", "mp3"])
def test_a_sine_round_trips_and_is_resampled_to_16k(audio_format: str) -> None:
    sine = _sine(MODEL_RATE)
    decoded = _decode(encode_audio(sine, MODEL_RATE, audio_format), audio_format)
    assert decoded.dtype == np.float32
    assert decoded.ndim == 1
    # 1 s at 16 kHz; MP3 may add part of a frame of encoder delay or padding.
    assert abs(len(decoded) - RATE) <= 0.02 * RATE
    assert _dominant_hz(decoded, RATE) == pytest.approx(440, abs=1)
    assert _rms(decoded) == pytest.approx(0.5 / np.sqrt(2), rel=0.05)


def test_44k1_input_is_resampled_to_16k() -> None:
    rate = 44_100
    pcm = np.rint(_sine(rate, seconds=2.0) * 32767).astype(np.int16)
    decoded = _decode(_stdlib_wav([pcm], rate), "wav")
    assert len(decoded) / len(pcm) == pytest.approx(RATE / rate, abs=1e-4)
    assert _dominant_hz(decoded, RATE) == pytest.approx(440, abs=1)


def test_stereo_wav_is_the_average_of_its_channels() -> None:
    left = np.rint(_sine(RATE, amplitude=0.8) * 32767).astype(np.int16)
    right = np.rint(_sine(RATE, hz=1000, amplitude=0.2) * 32767).astype(np.int16)
    decoded = _decode(_stdlib_wav([left, right], RATE), "wav")
    expected = (left.astype(np.float64) + right) / 2 / 32768
    # Not FFmpeg's own down-mix, which scales each channel by 0.707.
    np.testing.assert_allclose(decoded, expected, atol=1e-6)


def test_stereo_mp3_is_the_average_of_its_channels() -> None:
    # MP3 decodes to planar float: the other path through the channel reader.
    sine = _sine(MODEL_RATE, amplitude=0.6)
    decoded = _decode(_av_mp3([sine, np.zeros_like(sine)], MODEL_RATE), "mp3")
    assert _rms(decoded) == pytest.approx(0.3 / np.sqrt(2), rel=0.05)
    assert _dominant_hz(decoded, RATE) == pytest.approx(440, abs=1)


@pytest.mark.parametrize(
    ("sample_width", "tolerance"), [(1, 1 / 128), (2, LSB), (3, LSB), (4, LSB)]
)
def test_each_pcm_sample_width_decodes_to_the_same_signal(
    sample_width: int, tolerance: float
) -> None:
    sine = _sine(RATE, seconds=0.25)
    full_scale = 2 ** (8 * sample_width - 1)
    ints = np.clip(np.rint(sine.astype(np.float64) * full_scale), -full_scale, full_scale - 1)
    if sample_width == 1:
        ints += 128  # 8-bit WAV is unsigned
    decoded = _decode(_stdlib_wav([ints.astype(np.int64)], RATE, sample_width), "wav")
    assert decoded.shape == sine.shape
    assert np.max(np.abs(decoded - sine)) <= tolerance


def test_float_wav_past_full_scale_is_clipped() -> None:
    values = np.array([0.0, 1.5, -3.0, 0.25, np.inf, np.nan] * 200, dtype=np.float32)
    decoded = _decode(_float_wav(values, RATE), "wav")
    expected = np.array([0.0, 1.0, -1.0, 0.25, 1.0, 0.0] * 200, dtype=np.float32)
    np.testing.assert_array_equal(decoded, expected)


def test_base64_wrapped_at_76_columns_is_accepted() -> None:
    sine = _sine(RATE, seconds=0.1)
    wrapped = base64.encodebytes(encode_audio(sine, RATE, "wav")).decode()
    assert "\n" in wrapped
    decoded = decode_input_audio(wrapped, "wav", sample_rate=RATE, max_seconds=1, param=PART)
    assert np.max(np.abs(decoded - sine)) <= LSB


def test_audio_of_exactly_the_limit_is_accepted() -> None:
    decoded = _decode(encode_audio(_sine(RATE, seconds=2.0), RATE, "wav"), "wav", max_seconds=2)
    assert len(decoded) == 2 * RATE


# input_audio errors


def _raises(data: str, audio_format: str, max_seconds: float = 30.0) -> InvalidAudioError:
    with pytest.raises(InvalidAudioError) as caught:
        decode_input_audio(
            data, audio_format, sample_rate=RATE, max_seconds=max_seconds, param=PART
        )
    assert isinstance(caught.value, ValueError)
    assert str(caught.value) == caught.value.message
    return caught.value


@pytest.mark.parametrize("audio_format", ["ogg", "WAV", "flac", "", "x" * 500])
def test_a_format_other_than_wav_or_mp3_names_the_allowed_ones(audio_format: str) -> None:
    error = _raises(_b64(encode_audio(_sine(RATE), RATE, "wav")), audio_format)
    assert error.param == f"{PART}.format"
    assert "'wav', 'mp3'" in error.message
    assert repr(audio_format)[:20] in error.message
    assert len(error.message) < 200  # a huge value is cut, not echoed whole


@pytest.mark.parametrize("data", ["not base64!", "QUJDR", "QUJDRA", "AAA\u00e9"])
def test_data_that_is_not_base64_says_what_is_allowed(data: str) -> None:
    error = _raises(data, "wav")
    assert error.param == f"{PART}.data"
    assert "not valid base64" in error.message
    assert "standard base64" in error.message


def test_a_data_url_is_refused_with_its_own_reason() -> None:
    error = _raises("data:audio/wav;base64," + _b64(b"RIFF"), "wav")
    assert error.param == f"{PART}.data"
    assert "not a data: URL" in error.message


def test_empty_data_is_refused() -> None:
    error = _raises("", "mp3")
    assert error.param == f"{PART}.data"
    assert "empty" in error.message
    assert "MP3" in error.message


@pytest.mark.parametrize(
    ("sent_as", "actual"), [("wav", "mp3"), ("mp3", "wav"), ("wav", "text"), ("mp3", "text")]
)
def test_data_in_another_format_does_not_decode(sent_as: str, actual: str) -> None:
    if actual == "text":
        data = b"this is a text file, not audio\n" * 50
    else:
        data = encode_audio(_sine(MODEL_RATE), MODEL_RATE, actual)
    error = _raises(_b64(data), sent_as)
    assert error.param == f"{PART}.data"
    assert f"does not decode as {sent_as}" in error.message
    assert "'wav', 'mp3'" in error.message


def test_a_wav_with_no_samples_is_refused() -> None:
    error = _raises(_b64(encode_audio(np.zeros(0, np.float32), RATE, "wav")), "wav")
    assert error.param == f"{PART}.data"
    assert "no audio samples" in error.message


def test_a_file_with_no_audio_stream_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # FFmpeg's WAV and MP3 demuxers fail rather than open without an audio stream; this
    # stands in for one that opens empty.
    class Streams:
        audio: list[object] = []

    class Container:
        streams = Streams()

        def __enter__(self) -> Container:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(av, "open", lambda *args, **kwargs: Container())
    error = _raises(_b64(b"RIFF...."), "wav")
    assert error.param == f"{PART}.data"
    assert "no audio stream" in error.message


@pytest.mark.parametrize("audio_format", ["wav", "mp3"])
def test_audio_longer_than_the_limit_states_limit_and_length(audio_format: str) -> None:
    data = encode_audio(_sine(MODEL_RATE, seconds=5.0), MODEL_RATE, audio_format)
    error = _raises(_b64(data), audio_format, max_seconds=2.5)
    assert error.param == f"{PART}.data"
    assert "2.5 s allowed" in error.message
    assert "about 5.0 s" in error.message


def test_a_wav_claiming_an_absurd_sample_rate_is_refused_quickly() -> None:
    # Resampling from ~100 MHz costs seconds of CPU; the rate is refused before that.
    data = bytearray(encode_audio(_sine(RATE), RATE, "wav"))
    struct.pack_into("<II", data, 24, 99_999_989, 199_999_978)
    error = _raises(_b64(bytes(data)), "wav")
    assert error.param == f"{PART}.data"
    assert "99999989 Hz" in error.message
    assert "384000 Hz" in error.message


@pytest.mark.timeout(10)
@pytest.mark.parametrize("size", [1, 100, 4096, 1_000_000])
def test_random_bytes_as_mp3_are_invalid_audio(size: int) -> None:
    garbage = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    error = _raises(_b64(garbage), "mp3")
    assert error.param == f"{PART}.data"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("audio_format", ["wav", "mp3"])
def test_damaged_files_decode_or_are_invalid_audio_and_nothing_else(audio_format: str) -> None:
    original = encode_audio(_sine(MODEL_RATE), MODEL_RATE, audio_format)
    rng = np.random.default_rng(7)
    outcomes = {"decoded": 0, "invalid": 0}
    params: set[str] = set()
    for attempt in range(150):
        damaged = bytearray(original)
        if attempt % 3 == 0:
            damaged = damaged[: int(rng.integers(1, len(damaged)))]
        else:
            # Headers most often, where damage changes what the rest is read as.
            span = 64 if attempt % 3 == 1 else len(damaged)
            for _ in range(int(rng.integers(1, 20))):
                damaged[int(rng.integers(0, span))] = int(rng.integers(0, 256))
        decoded: Any = None
        try:
            decoded = _decode(bytes(damaged), audio_format)
        except InvalidAudioError as error:
            params.add(error.param)
        if decoded is None:
            outcomes["invalid"] += 1
        else:
            assert decoded.dtype == np.float32
            assert decoded.ndim == 1
            assert decoded.size > 0
            assert np.all(np.abs(decoded) <= 1.0)
            outcomes["decoded"] += 1
    # Both branches were taken: the damage was neither all harmless nor all fatal.
    assert outcomes["decoded"] > 0
    assert outcomes["invalid"] > 0
    assert params == {f"{PART}.data"}


# output audio


def test_this_build_writes_every_format_openai_defines() -> None:
    assert set(AUDIO_FORMATS) == {"wav", "mp3", "flac", "opus", "aac", "pcm16"}
    assert set(MEDIA_TYPES) == set(AUDIO_FORMATS)
    assert MEDIA_TYPES["mp3"] == "audio/mpeg"
    assert STREAM_FORMATS == ("pcm16",)


_CONTAINERS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "opus": "ogg", "aac": "aac"}


@pytest.mark.parametrize("audio_format", sorted(_CONTAINERS))
def test_each_file_format_decodes_to_the_sine_it_was_given(audio_format: str) -> None:
    sine = _sine(MODEL_RATE)
    decoded, rate = _av_decode(
        encode_audio(sine, MODEL_RATE, audio_format), _CONTAINERS[audio_format]
    )
    # AAC in ADTS keeps its 1024 samples of encoder priming: 43 ms at 24 kHz.
    assert len(decoded) / rate == pytest.approx(1.0, abs=0.075)
    assert _dominant_hz(decoded, rate) == pytest.approx(440, abs=2)
    assert _rms(decoded) == pytest.approx(0.5 / np.sqrt(2), rel=0.1)


@pytest.mark.parametrize(("audio_format", "rate"), [("opus", 44_100), ("mp3", 22_050)])
def test_a_rate_the_encoder_may_not_take_still_encodes(audio_format: str, rate: int) -> None:
    # Opus takes 8-48 kHz in steps (not 44.1); MP3 takes 22.05 natively.
    decoded, out_rate = _av_decode(
        encode_audio(_sine(rate), rate, audio_format), _CONTAINERS[audio_format]
    )
    assert len(decoded) / out_rate == pytest.approx(1.0, abs=0.075)
    assert _dominant_hz(decoded, out_rate) == pytest.approx(440, abs=2)


def test_wav_is_16_bit_mono_pcm_the_stdlib_reads() -> None:
    sine = _sine(MODEL_RATE, seconds=0.5)
    with wave.open(io.BytesIO(encode_audio(sine, MODEL_RATE, "wav")), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, MODEL_RATE)
        assert w.getnframes() == len(sine)
        assert w.readframes(len(sine)) == pcm16_bytes(sine)


def test_pcm16_is_raw_little_endian_int16_rounded_to_nearest() -> None:
    sine = _sine(MODEL_RATE, seconds=0.5)
    data = encode_audio(sine, MODEL_RATE, "pcm16")
    assert len(data) == 2 * len(sine)
    assert data == pcm16_bytes(sine)
    expected = np.rint(sine.astype(np.float64) * 32768).astype(np.int16)
    np.testing.assert_array_equal(np.frombuffer(data, dtype="<i2"), expected)


def test_values_past_full_scale_are_clipped() -> None:
    values = np.array([2.0, -2.0, 1.0, -1.0, 0.5, -0.5, 1e-6, np.nan, np.inf], np.float32)
    ints = np.frombuffer(pcm16_bytes(values), dtype="<i2")
    assert ints.tolist() == [32767, -32768, 32767, -32768, 16384, -16384, 0, 0, 32767]
    # The same in a file: a clipped sine decodes flat-topped at full scale.
    loud = _sine(MODEL_RATE, amplitude=3.0)
    decoded, _ = _av_decode(encode_audio(loud, MODEL_RATE, "flac"), "flac")
    assert np.max(decoded) == pytest.approx(32767 / 32768)
    assert np.min(decoded) == -1.0


def test_pcm16_chunks_concatenate_to_the_whole() -> None:
    sine = _sine(MODEL_RATE, seconds=0.3)
    pieces = [pcm16_bytes(chunk) for chunk in np.array_split(sine, 7)]
    assert b"".join(pieces) == pcm16_bytes(sine)


@pytest.mark.parametrize(
    ("samples", "rate", "audio_format", "what"),
    [
        (np.zeros(10, np.float32), MODEL_RATE, "ogg", "audio_format"),
        (np.zeros((2, 10), np.float32), MODEL_RATE, "wav", "samples"),
        (np.zeros(10, np.float32), 0, "wav", "sample_rate"),
    ],
)
def test_encode_refuses_what_it_cannot_write(
    samples: Any, rate: int, audio_format: str, what: str
) -> None:
    with pytest.raises(ValueError, match=what):
        encode_audio(samples, rate, audio_format)
