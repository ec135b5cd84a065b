"""Input media of a request, decoded within the limits: images (data URLs in a chat
message, files of a form) and audio (a chat message's input_audio parts); each refusal
names where in the request the media was."""

from __future__ import annotations

import base64
import binascii
import re

import numpy as np

from omni_runtime import audio as audio_codec
from omni_runtime.images import decode_image
from omni_runtime.router.errors import RequestError
from omni_runtime.router.limits import RouterLimits, image_too_large

_DATA_URL = re.compile(r"data:(image/[a-z0-9.+-]+)?(;[^,]*)?,", re.IGNORECASE)


def decode_data_url(url: str, limits: RouterLimits, where: str) -> np.ndarray:
    """The image of a ``data:image/...;base64,...`` URL as uint8 RGB."""
    match = _DATA_URL.match(url)
    if match is None or match.group(1) is None or ";base64" not in (match.group(2) or ""):
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise RequestError(
            400,
            f"{where}: only base64 data URLs of images are accepted "
            f"(data:image/png;base64,...); got {shown!r}",
            param=where,
        )
    payload = url[match.end() :]
    if len(payload) * 3 // 4 > limits.max_input_image_bytes:
        raise image_too_large(limits, where)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, f"{where}: the data URL is not valid base64", param=where) from None
    return decode_input_image(data, limits, where)


def decode_input_image(data: bytes, limits: RouterLimits, where: str) -> np.ndarray:
    """An input image file's bytes as uint8 RGB, within the limits; RequestError naming
    ``where`` (413 over the bytes limit, 400 over the pixels limit, read from the header
    before the pixels are decoded, or not an image)."""
    if len(data) > limits.max_input_image_bytes:
        raise image_too_large(limits, where)
    try:
        return decode_image(data, max_pixels=limits.max_input_image_pixels)
    except ValueError as e:
        raise RequestError(400, f"{where}: {e}", param=where) from None


def too_many_images(most: int, count: int | None = None) -> str:
    """Why a request with ``count`` input images (None: more than ``most``) is refused."""
    if most == 0:
        return "this pipeline takes no input image"
    got = f" (got {count})" if count is not None else ""
    if most == 1:
        return f"at most one input image per request{got}"
    return f"at most {most} input images per request{got}"


def decode_audio(
    data: str, audio_format: str, *, sample_rate: int, max_seconds: float, where: str
) -> np.ndarray:
    """An input_audio part's samples at ``sample_rate``; RequestError naming ``where``."""
    try:
        return audio_codec.decode_input_audio(
            data, audio_format, sample_rate=sample_rate, max_seconds=max_seconds, param=where
        )
    except audio_codec.InvalidAudioError as e:
        raise RequestError(400, f"{e.param}: {e.message}", e.param) from None
