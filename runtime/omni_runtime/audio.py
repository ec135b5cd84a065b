"""Audio in OpenAI's chat completions: the ``input_audio`` content parts a request carries
(base64 WAV or MP3, decoded to the mono float samples a model's processor takes), and the
``audio`` a response returns (a model's samples encoded as the format the request asked for).

PyAV carries FFmpeg's libraries (its decoders, the LAME, Opus and AAC encoders) inside its
wheel, so neither the router's image nor a developer's machine needs a system FFmpeg. WAV and
raw PCM are written here directly: they are a header and the samples.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
from fractions import Fraction

import av
import av.codec
import numpy as np

# What OpenAI's input_audio.format allows.
INPUT_FORMATS: tuple[str, ...] = ("wav", "mp3")
_FILE_NAMES = {"wav": "a WAV file", "mp3": "an MP3 file"}

# Above any rate audio is recorded at. A WAV header may claim any 32-bit rate, and resampling
# from a rate like 99999989 Hz costs seconds of CPU for a few milliseconds of sound.
_MAX_INPUT_RATE = 384_000

# An input format's FFmpeg demuxer: named, never probed, so an MP3 sent as "wav" fails
# rather than being decoded as whatever FFmpeg guesses it is.
_DEMUXERS = {"wav": "wav", "mp3": "mp3"}


class InvalidAudioError(ValueError):
    """An ``input_audio`` part the request cannot be served with: the client's fault (a 400),
    with ``param`` the request field at fault, as OpenAI's error object names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def decode_input_audio(
    data: str, audio_format: str, *, sample_rate: int, max_seconds: float, param: str
) -> np.ndarray:
    """The mono float32 samples, in [-1, 1] at ``sample_rate``, of an ``input_audio`` part:
    ``data`` base64 of a file in ``audio_format``. Channels are averaged. ``param`` is the
    part's field path (``messages[0].content[1].input_audio``); errors name its ``.data`` or
    ``.format``. Raises :class:`InvalidAudioError` for anything the client sent wrong,
    including audio longer than ``max_seconds``. Blocks for milliseconds per second of audio:
    call it off the event loop."""
    if audio_format not in INPUT_FORMATS:
        raise InvalidAudioError(
            f"input_audio.format must be one of {_quoted(INPUT_FORMATS)}, "
            f"got {_short_repr(audio_format)}",
            f"{param}.format",
        )
    data_param = f"{param}.data"
    raw = _b64decode(data, audio_format, data_param)
    if not raw:
        raise InvalidAudioError(
            f"input_audio.data is empty: send base64 of {_FILE_NAMES[audio_format]}", data_param
        )
    try:
        return _decode(raw, audio_format, sample_rate, max_seconds, data_param)
    except InvalidAudioError:
        raise
    # FFmpeg's errors, and PyAV's ValueErrors for what its frames cannot hold: all of them
    # say the bytes are not audio this can decode, never that the server is broken.
    except (av.FFmpegError, ValueError, EOFError) as exc:
        raise InvalidAudioError(
            f"input_audio.data does not decode as {audio_format} ({_ffmpeg_reason(exc)}): "
            f"send {_FILE_NAMES[audio_format]}, or set input_audio.format to the file's format "
            f"(one of {_quoted(INPUT_FORMATS)})",
            data_param,
        ) from exc


def _b64decode(data: str, audio_format: str, param: str) -> bytes:
    if not isinstance(data, str):
        raise InvalidAudioError(
            f"input_audio.data must be a string of base64, got {type(data).__name__}", param
        )
    if data.startswith("data:"):
        # A common slip: OpenAI's image_url takes data: URLs, its input_audio does not.
        raise InvalidAudioError(
            f"input_audio.data must be plain base64 of {_FILE_NAMES[audio_format]}, "
            "not a data: URL",
            param,
        )
    try:
        # Whitespace dropped first: base64 tools wrap their output at 76 columns. Anything
        # else outside the standard alphabet is refused rather than silently skipped.
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidAudioError(
            f"input_audio.data is not valid base64 ({exc}): send {_FILE_NAMES[audio_format]} "
            "in standard base64 (A-Z, a-z, 0-9, +, / and = padding)",
            param,
        ) from exc


def _decode(
    raw: bytes, audio_format: str, sample_rate: int, max_seconds: float, param: str
) -> np.ndarray:
    chunks: list[np.ndarray] = []
    decoded_seconds = Fraction(0)
    resampler: av.AudioResampler | None = None
    resampler_rate = 0
    with av.open(io.BytesIO(raw), mode="r", format=_DEMUXERS[audio_format]) as container:
        if not container.streams.audio:
            raise InvalidAudioError(
                f"input_audio.data holds no audio stream: send {_FILE_NAMES[audio_format]} with "
                "sound in it",
                param,
            )
        stream = container.streams.audio[0]
        for frame in container.decode(stream):
            if frame.samples == 0:
                continue
            if not 0 < frame.sample_rate <= _MAX_INPUT_RATE:
                raise InvalidAudioError(
                    f"input_audio.data is audio at {frame.sample_rate} Hz: send audio "
                    f"sampled at up to {_MAX_INPUT_RATE} Hz",
                    param,
                )
            # Counted before any resampling, so an over-long upload costs at most
            # max_seconds of decoding (the whole input is bounded by the body limit).
            # Exact, so audio of just the limit is not refused by rounding.
            decoded_seconds += Fraction(frame.samples, frame.sample_rate)
            if decoded_seconds > max_seconds:
                raise InvalidAudioError(
                    f"input_audio.data is {_length(container.duration, max_seconds)} of "
                    f"audio, longer than the {max_seconds:g} s allowed: send at most "
                    f"{max_seconds:g} s",
                    param,
                )
            mono = _mono(frame)
            # A stream may change rate midway (concatenated MP3s); a resampler is built for
            # one input rate, so the old one is drained and a new one takes over.
            if resampler is None or frame.sample_rate != resampler_rate:
                if resampler is not None:
                    chunks.extend(_samples(resampler.resample(None)))
                resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
                resampler_rate = frame.sample_rate
            chunks.extend(_samples(resampler.resample(_frame(mono, frame.sample_rate))))
        if resampler is not None:
            chunks.extend(_samples(resampler.resample(None)))
    samples = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    if samples.size == 0:
        raise InvalidAudioError(
            f"input_audio.data holds no audio samples (or under a millisecond of them): send "
            f"{_FILE_NAMES[audio_format]} with sound in it",
            param,
        )
    # Float WAV may carry values past full scale, or NaN; the model's processor expects
    # [-1, 1].
    return _clip(samples)


# FFmpeg's sample formats (packed names; a planar one adds "p") as numpy reads them, with
# the divisor that takes an integer format to [-1, 1): FFmpeg's own convention, so a 16-bit
# sample s comes back as exactly s / 32768.
_SAMPLE_TYPES: dict[str, tuple[type[np.generic], float]] = {
    "u8": (np.uint8, 128.0),
    "s16": (np.int16, 32768.0),
    "s32": (np.int32, 2.0**31),
    "s64": (np.int64, 2.0**63),
    "flt": (np.float32, 1.0),
    "dbl": (np.float64, 1.0),
}


def _mono(frame: av.AudioFrame) -> np.ndarray:
    # Read by hand rather than through a resampler to mono: FFmpeg's down-mix scales each
    # channel by 1/sqrt(2) (0.707 of a stereo signal, more than 1 for 5.1), where a model
    # wants the plain average of what each channel heard.
    fmt = frame.format
    dtype, scale = _SAMPLE_TYPES[fmt.packed.name]
    count, channels = frame.samples, frame.layout.nb_channels
    if fmt.is_planar:
        planes = np.stack(
            [np.frombuffer(memoryview(plane), dtype=dtype, count=count) for plane in frame.planes]
        )
    else:
        planes = np.frombuffer(memoryview(frame.planes[0]), dtype=dtype, count=count * channels)
        planes = planes.reshape(count, channels).T
    values = planes.astype(np.float64)
    if dtype is np.uint8:
        values -= 128.0
    mono: np.ndarray = values.mean(axis=0) / scale
    return mono.astype(np.float32)


def _frame(mono: np.ndarray, sample_rate: int) -> av.AudioFrame:
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(mono, dtype=np.float32)[np.newaxis, :], format="flt", layout="mono"
    )
    frame.sample_rate = sample_rate
    return frame


def _samples(frames: list[av.AudioFrame]) -> list[np.ndarray]:
    return [np.asarray(frame.to_ndarray(), dtype=np.float32).reshape(-1) for frame in frames]


def _length(duration_us: int | None, max_seconds: float) -> str:
    # Decoding stops at the limit, so the length is the container's own estimate where it
    # has one (a WAV header's, an MP3's Xing header or bit rate), else a bound.
    if duration_us is not None and duration_us / 1e6 > max_seconds:
        return f"about {duration_us / 1e6:.1f} s"
    return f"more than {max_seconds:g} s"


def _ffmpeg_reason(exc: Exception) -> str:
    reason = exc.strerror if isinstance(exc, av.FFmpegError) and exc.strerror else str(exc)
    return reason[:200]


def _quoted(names: tuple[str, ...]) -> str:
    return ", ".join(f"'{name}'" for name in names)


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# The output formats OpenAI defines, by what encodes them: a (container, encoder, bit rate)
# through FFmpeg, or None for what this module writes itself. Bit rates are chosen for mono
# speech: comfortable for each codec, still a fraction of 16-bit PCM's 384 kb/s at 24 kHz;
# FLAC is lossless and takes none.
_ENCODERS: dict[str, tuple[str, str, int] | None] = {
    "wav": None,
    "pcm16": None,
    "mp3": ("mp3", "libmp3lame", 96_000),
    "flac": ("flac", "flac", 0),
    # Ogg is Opus's container in OpenAI's output (and in browsers). FFmpeg's own "opus"
    # encoder is experimental and 48 kHz only, so libopus or nothing.
    "opus": ("ogg", "libopus", 48_000),
    "aac": ("adts", "aac", 96_000),
}


def _has_encoder(name: str) -> bool:
    try:
        av.codec.Codec(name, "w")
    except (av.codec.codec.UnknownCodecError, av.FFmpegError):
        return False
    return True


# The output formats this build can write. PyAV's wheel carries every encoder above, so
# there it is all six; a PyAV built against an FFmpeg without LAME or libopus drops mp3 or
# opus here instead of failing the request that asks for it.
AUDIO_FORMATS: tuple[str, ...] = tuple(
    name for name, spec in _ENCODERS.items() if spec is None or _has_encoder(spec[1])
)

# The formats a stream can send as base64 chunks that each stand alone and concatenate to the
# whole: only headerless PCM, cut at any sample. WAV's header states the total length up
# front; FLAC and Ogg Opus open with stream headers that later pieces depend on; MP3 and
# AAC frames carry encoder delay and share bits across frame boundaries, so pieces encoded
# apart click and gap where they meet. OpenAI streams pcm16 for the same reasons.
STREAM_FORMATS: tuple[str, ...] = ("pcm16",)

MEDIA_TYPES: dict[str, str] = {
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "flac": "audio/flac",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "pcm16": "audio/pcm",
}


def pcm16_bytes(samples: np.ndarray) -> bytes:
    """``samples`` (float, mono, [-1, 1]; clipped past it) as raw 16-bit little-endian PCM:
    the ``pcm16`` format, and each chunk of a streamed response's audio."""
    clipped = _clip(samples)
    # x 32768 (not 32767), the inverse of FFmpeg's s16 -> float, so PCM decoded from a file
    # re-encodes to the same integers; +1.0 is the one value past int16 and clips to 32767.
    scaled = np.clip(np.rint(clipped.astype(np.float64) * 32768.0), -32768, 32767)
    return scaled.astype("<i2").tobytes()


def encode_audio(samples: np.ndarray, sample_rate: int, audio_format: str) -> bytes:
    """A file of ``samples`` (float, mono, [-1, 1]; clipped past it) at ``sample_rate`` in
    ``audio_format``, one of :data:`AUDIO_FORMATS`; ``pcm16`` is the raw samples at
    ``sample_rate`` (OpenAI's is 24 kHz, Qwen3-Omni's rate). Lossy formats are resampled
    where their encoder does not take ``sample_rate``. Blocks for milliseconds per second of
    audio: call it off the event loop."""
    if audio_format not in AUDIO_FORMATS:
        raise ValueError(
            f"audio_format: one of {_quoted(AUDIO_FORMATS)}, got {_short_repr(audio_format)}"
        )
    if not (isinstance(sample_rate, int) and 0 < sample_rate < 2**31):
        raise ValueError(f"sample_rate: a positive number of Hz, got {sample_rate!r}")
    if audio_format == "pcm16":
        return pcm16_bytes(samples)
    if audio_format == "wav":
        return _wav(pcm16_bytes(samples), sample_rate)
    spec = _ENCODERS[audio_format]
    assert spec is not None
    return _encode_av(_clip(samples), sample_rate, *spec)


def _clip(samples: np.ndarray) -> np.ndarray:
    array = np.asarray(samples, dtype=np.float32)
    if array.ndim != 1:
        raise ValueError(f"samples: expected mono [samples], got shape {list(array.shape)}")
    return np.clip(np.nan_to_num(array, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0)


def _wav(pcm: bytes, sample_rate: int) -> bytes:
    # RIFF sizes are 32-bit: 2**32 bytes of 16-bit mono is a day of audio at 24 kHz.
    if len(pcm) > 0xFFFFFFFF - 36:
        raise ValueError(f"samples: {len(pcm) // 2} are more than a WAV file can hold")
    header = struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF",
        36 + len(pcm),
        b"WAVE",
        b"fmt ",
        16,  # the fmt chunk's size for plain PCM
        1,  # WAVE_FORMAT_PCM
        1,  # channels
        sample_rate,
        sample_rate * 2,  # bytes a second
        2,  # bytes a sample frame
        16,  # bits a sample
        b"data",
        len(pcm),
    )
    return header + pcm


def _encode_av(
    samples: np.ndarray, sample_rate: int, container_format: str, encoder: str, bit_rate: int
) -> bytes:
    rate = _encoder_rate(encoder, sample_rate)
    out = io.BytesIO()
    with av.open(out, mode="w", format=container_format) as container:
        stream = container.add_stream(encoder, rate=rate)
        assert isinstance(stream, av.AudioStream)
        stream.layout = "mono"
        if bit_rate:
            stream.bit_rate = bit_rate
        # To the rate the encoder takes; PyAV's encode then converts to the encoder's sample
        # format and cuts the audio into its frame size (an MP3 or AAC frame, 20 ms of Opus).
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        frames = resampler.resample(_frame(samples, sample_rate)) if samples.size else []
        frames += resampler.resample(None)
        for frame in frames:
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))  # what the encoder still holds
    return out.getvalue()


def _encoder_rate(encoder: str, sample_rate: int) -> int:
    # MP3, AAC and Opus take a fixed set of rates (24 kHz among them for all three); another
    # rate goes up to the nearest they take, or down to their highest.
    rates = av.codec.Codec(encoder, "w").audio_rates
    if not rates or sample_rate in rates:
        return sample_rate
    higher = [rate for rate in rates if rate > sample_rate]
    return min(higher) if higher else max(rates)
