"""Conversions between the wire's image arrays (uint8 RGB, [H, W, 3]) and image files."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image


def to_uint8(images: Any) -> np.ndarray:
    """A pipeline's float images in [0, 1] (``output_type="np"``) as the wire's uint8,
    rounded to the nearest level."""
    return np.clip(np.round(np.asarray(images) * 255.0), 0, 255).astype(np.uint8)


def encode_png(image: np.ndarray) -> bytes:
    """PNG bytes of one uint8 RGB image; the same pixels always give the same bytes."""
    buffer = io.BytesIO()
    Image.fromarray(np.asarray(image, dtype=np.uint8), mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def decode_image(data: bytes, max_pixels: int | None = None) -> np.ndarray:
    """A uint8 RGB array from PNG/JPEG/... bytes; ValueError if they are not an image, or
    if it has more than ``max_pixels`` pixels (checked from the header, before decoding)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            if max_pixels is not None and image.width * image.height > max_pixels:
                raise ValueError(
                    f"the image is {image.width}x{image.height}; at most {max_pixels} pixels"
                )
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"not a readable image: {e}") from e
