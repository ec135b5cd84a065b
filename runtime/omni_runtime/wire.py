"""The stage wire format: msgspec MessagePack, with arrays as separate raw frames.

A message is a list of ZMQ frames: frame 0 is the msgpack body; each array of at least
``INLINE_LIMIT`` bytes travels as its own frame, referenced from the body by index, so a
large tensor or image is never copied into (or parsed out of) the msgpack body. Smaller
arrays are inlined. Arrays are described by dtype and shape only: there is no pickle
anywhere, and a decoder accepts plain numeric dtypes and nothing else.

numpy arrays decode as read-only numpy arrays over the received frame (zero-copy); torch
tensors decode as torch tensors (torch is imported only when one arrives, so processes that
never see a tensor never import torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import zmq

# msgpack extension type codes used on stage sockets.
_EXT_NDARRAY = 1
_EXT_TENSOR = 2
INLINE_LIMIT = 256

# Array kinds a peer may send: bool, signed/unsigned ints, floats, complex. Object ("O"),
# void/structured ("V") and string dtypes are refused: they are not numeric payloads.
_ALLOWED_KINDS = frozenset("biufc")
# numpy has no bfloat16; tensors of that type travel as their raw 16-bit words.
_BFLOAT16 = "bfloat16"

# What may be sent (bytes, buffers) and received (zmq.Frame with copy=False) as a frame.
Frame = bytes | memoryview | zmq.Frame


class WireError(ValueError):
    """A message that cannot be decoded: corrupt, or not of this protocol."""


class WireEncoder:
    """Encodes msgspec structs (or plain data) into a list of frames."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list[Frame] | None = None

    def encode(self, obj: Any) -> list[Frame]:
        frames: list[Frame] = [b""]
        self._frames = frames
        try:
            frames[0] = self._encoder.encode(obj)
        finally:
            self._frames = None
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self._array_ext(_EXT_NDARRAY, obj, obj.dtype.str)
        if _is_torch_tensor(obj):
            return self._tensor_ext(obj)
        raise NotImplementedError(f"cannot send {type(obj).__name__} on a stage socket")

    def _tensor_ext(self, tensor: Any) -> msgspec.msgpack.Ext:
        import torch

        tensor = tensor.detach().cpu().contiguous()
        if tensor.dtype == torch.bfloat16:
            return self._array_ext(_EXT_TENSOR, tensor.view(torch.int16).numpy(), _BFLOAT16)
        array = tensor.numpy()
        return self._array_ext(_EXT_TENSOR, array, array.dtype.str)

    def _array_ext(self, code: int, array: np.ndarray, dtype: str) -> msgspec.msgpack.Ext:
        if array.dtype.kind not in _ALLOWED_KINDS:
            raise TypeError(f"arrays of dtype {array.dtype} cannot be sent (numeric only)")
        array = np.ascontiguousarray(array)
        assert self._frames is not None
        data: int | bytes
        if array.nbytes < INLINE_LIMIT:
            data = array.tobytes()
        else:
            data = len(self._frames)
            self._frames.append(array.data.cast("B"))
        return msgspec.msgpack.Ext(code, msgspec.msgpack.encode((dtype, array.shape, data)))


class WireDecoder:
    """Decodes frames made by :class:`WireEncoder` into ``type``."""

    def __init__(self, type: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type, ext_hook=self._ext_hook, dec_hook=_dec_hook)
        self._frames: Sequence[Frame] = ()

    def decode(self, frames: Sequence[Frame]) -> Any:
        if not frames:
            raise WireError("empty message")
        self._frames = frames
        try:
            body = frames[0]
            return self._decoder.decode(body.buffer if isinstance(body, zmq.Frame) else body)
        except msgspec.DecodeError as e:
            raise WireError(str(e)) from e
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, payload: memoryview) -> Any:
        if code not in (_EXT_NDARRAY, _EXT_TENSOR):
            raise WireError(f"unknown extension type {code}")
        dtype_name, shape, data = msgspec.msgpack.decode(
            payload, type=tuple[str, list[int], int | bytes]
        )
        raw = data if isinstance(data, bytes) else self._frame(data)
        bfloat16 = dtype_name == _BFLOAT16
        dtype = np.dtype(np.int16 if bfloat16 else dtype_name)
        if dtype.kind not in _ALLOWED_KINDS:
            raise WireError(f"refusing array of dtype {dtype_name}")
        array = np.frombuffer(raw, dtype=dtype).reshape(shape)
        if code == _EXT_NDARRAY:
            return array
        import torch

        tensor = torch.from_numpy(array.copy() if not array.flags.writeable else array)
        return tensor.view(torch.bfloat16) if bfloat16 else tensor

    def _frame(self, index: int) -> bytes | memoryview:
        if not 0 < index < len(self._frames):
            raise WireError(f"message refers to frame {index} of {len(self._frames)}")
        frame = self._frames[index]
        return frame.buffer if isinstance(frame, zmq.Frame) else frame


def _dec_hook(type_: type, obj: Any) -> Any:
    # Fields annotated with np.ndarray / torch.Tensor receive what _ext_hook built.
    if isinstance(obj, type_):
        return obj
    raise msgspec.ValidationError(f"expected {type_.__name__}, got {type(obj).__name__}")


def _is_torch_tensor(obj: Any) -> bool:
    # Checked by name so that this module never imports torch itself.
    cls = type(obj)
    return cls.__module__.startswith("torch") and cls.__name__ in {"Tensor", "Parameter"}
