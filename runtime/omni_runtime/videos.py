"""Videos as the Videos API hands them out: MP4 (H.264) from a pipeline's frames, and the
frame count a clip's length asks of a video pipeline.

PyAV carries FFmpeg's libraries (libx264 among them) inside its wheel, so neither the
router's image nor a developer's machine needs a system FFmpeg.
"""

from __future__ import annotations

import io
import math
from fractions import Fraction

import numpy as np

# x264's constant-rate factor: 18 is visually lossless for most content, at a fraction of
# the size of lossless coding; a generated clip is the product, not a draft.
_CRF = "18"


def encode_mp4(frames: np.ndarray, fps: float) -> bytes:
    """An MP4 (H.264, yuv420p, ``fps`` frames a second) of ``frames``: uint8 RGB
    [frames, height, width, 3], each side even (4:2:0 chroma halves them). Blocks for
    milliseconds per frame: call it off the event loop."""
    import av

    if frames.ndim != 4 or frames.shape[3] != 3 or frames.dtype != np.uint8:
        raise ValueError(
            f"frames: expected uint8 RGB [frames, height, width, 3], got {frames.dtype} "
            f"{list(frames.shape)}"
        )
    count, height, width, _ = frames.shape
    if count < 1 or height % 2 or width % 2:
        raise ValueError(f"frames: at least one, of even sides, got {list(frames.shape)}")
    if not (math.isfinite(fps) and fps > 0):
        raise ValueError(f"fps: a positive number, got {fps}")
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=_rate(fps))
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": _CRF}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():  # what the encoder still holds
            container.mux(packet)
    return out.getvalue()


def _rate(fps: float) -> Fraction:
    # Exact in the container's time base: 24, or 23.976 as 2997/125, not a binary float.
    return Fraction(fps).limit_denominator(1001)


def frames_for(seconds: float, fps: float, step: int) -> int:
    """The frames of a clip about ``seconds`` long at ``fps``, as a video VAE that
    compresses ``step`` frames into one latent frame (after the first) takes them:
    1 + k x step, at least 1 + step."""
    k = max(1, round((seconds * fps - 1) / step))
    return 1 + k * step
