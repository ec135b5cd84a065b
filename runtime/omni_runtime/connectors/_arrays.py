"""What the connectors share about arrays: dtype names, raw bytes in, tensors out.

Every connector moves an array as its raw bytes plus (dtype, shape); the dtype is named in
torch's spelling so that bfloat16 (which numpy lacks) survives. torch is imported only
inside functions: a process that only ever puts numpy arrays never loads it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from omni_runtime.connectors.base import ConnectorError

if TYPE_CHECKING:
    import torch

# Plain numeric dtypes only: a handle naming anything else is refused, so a handle can never
# make a consumer build an object array (or look up an arbitrary torch attribute).
DTYPES = frozenset(
    {
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    }
)
_ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}

Array = Any  # torch.Tensor | np.ndarray, kept loose so that callers need no torch import


def is_torch_tensor(obj: object) -> bool:
    # By class name, so that checking a numpy array never imports torch.
    cls = type(obj)
    return cls.__module__.startswith("torch") and cls.__name__ in {"Tensor", "Parameter"}


def describe(array: Array) -> tuple[str, list[int], int]:
    """(dtype name, shape, nbytes) of a numpy array or torch tensor; ConnectorError if the
    dtype is not a plain numeric one."""
    if is_torch_tensor(array):
        name = str(array.dtype).removeprefix("torch.")
        shape = [int(d) for d in array.shape]
    elif isinstance(array, np.ndarray):
        name = array.dtype.name if array.dtype.kind in "biufc" else ""
        shape = [int(d) for d in array.shape]
    else:
        raise ConnectorError(f"cannot send {type(array).__name__}: a numpy array or torch tensor")
    if name not in DTYPES:
        raise ConnectorError(f"cannot send arrays of dtype {array.dtype} (plain numeric only)")
    return name, shape, math.prod(shape) * _ITEMSIZE[name]


def check_layout(dtype: str, shape: list[int], nbytes: int, what: str) -> None:
    """ConnectorError unless (dtype, shape, nbytes), as read from a handle or a peer, agree."""
    if dtype not in DTYPES:
        raise ConnectorError(f"{what}: unsupported dtype {dtype!r}")
    if any(d < 0 for d in shape) or math.prod(shape) * _ITEMSIZE[dtype] != nbytes:
        raise ConnectorError(f"{what}: shape {shape} of {dtype} does not make {nbytes} bytes")


def is_cpu(array: Array) -> bool:
    return not is_torch_tensor(array) or array.device.type == "cpu"


def host_bytes(array: Array) -> memoryview:
    """The array's bytes in host memory as one flat memoryview, which keeps them alive.

    No copy where the array is a contiguous CPU array in native byte order: the view is
    of the caller's own memory. Anything else is copied into that layout; a GPU tensor is
    staged through page-locked memory from torch's caching host allocator (pinned: four
    times the pageable rate, and reused, so pinning costs nothing per call).
    """
    if isinstance(array, np.ndarray):
        if array.flags.c_contiguous and array.dtype.isnative:
            return array.reshape(-1).view(np.uint8).data
        copy = np.empty(array.shape, array.dtype.newbyteorder("="))
        np.copyto(copy, array)
        return copy.reshape(-1).view(np.uint8).data
    import torch

    tensor = array.detach()
    if tensor.device.type != "cpu":
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        staged.copy_(tensor)
        tensor = staged
    source = _cpu_tensor_as_numpy(tensor)
    if not source.flags.c_contiguous:
        source = np.ascontiguousarray(source)
    return source.reshape(-1).view(np.uint8).data


def copy_into(array: Array, buffer: Any, offset: int) -> None:
    """Write the array's bytes into the writable ``buffer`` (an mmap) at ``offset``.

    CPU data goes through numpy's single-threaded memcpy: torch's parallel copy was slower
    here (its threads contend with the caller's). A GPU tensor is copied by the device into
    ``buffer`` directly; the caller makes ``buffer`` page-locked for that to run at speed.
    """
    if isinstance(array, np.ndarray):
        target = np.ndarray(array.shape, array.dtype.newbyteorder("="), buffer, offset)
        np.copyto(target, array)
        return
    tensor = array.detach()
    if tensor.device.type == "cpu":
        source = _cpu_tensor_as_numpy(tensor)
        np.copyto(np.ndarray(source.shape, source.dtype, buffer, offset), source)
        return
    name = str(tensor.dtype).removeprefix("torch.")
    tensor_over_array(np.ndarray(tensor.shape, numpy_dtype(name), buffer, offset), name).copy_(
        tensor
    )


def _cpu_tensor_as_numpy(tensor: torch.Tensor) -> np.ndarray:
    import torch

    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    try:
        array: np.ndarray = tensor.numpy()
    except RuntimeError:  # conjugate or negative bit set: resolve it into a copy
        array = tensor.resolve_conj().resolve_neg().numpy()
    return array


def torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise ConnectorError(f"unsupported dtype {name!r}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def check_device(device: str) -> None:
    """ConnectorError for a device this process cannot put a tensor on, before any transfer
    starts (a failed copy after the producer let go would lose the array)."""
    if device == "cpu":
        return
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ConnectorError(f"not a device: {device!r} ({e})") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConnectorError(f"cannot fetch onto {device}: no CUDA device is visible here")


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype that holds ``name``'s bytes (bfloat16: its raw 16-bit words)."""
    return np.dtype(np.int16 if name == "bfloat16" else name)


def tensor_over_array(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (it keeps ``array`` alive), ``array`` being
    of :func:`numpy_dtype` (``dtype``)."""
    import torch

    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def empty_tensor(dtype: str, shape: list[int], device: str) -> torch.Tensor:
    import torch

    return torch.empty(shape, dtype=torch_dtype(dtype), device=device)
