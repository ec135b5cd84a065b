"""Arrays the connector suites' producer and consumer processes agree on, by spec.

A spec (``{"kind", "shape", "seed", "numpy"?}``) names the same array in every process, so
a consumer can check what it fetched by dtype, shape and digest without the producer
sending its copy another way.
"""

from __future__ import annotations

import hashlib
from typing import Any


def make_array(spec: dict[str, Any]) -> Any:
    """The array ``spec`` names (seeded): a torch tensor, or with ``numpy`` a
    non-contiguous numpy view, which a producer must copy rather than share."""
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(int(spec["seed"]))
    shape = tuple(spec["shape"])
    kind = spec["kind"]
    if kind == "int64":
        tensor = torch.randint(-(2**62), 2**62, shape, generator=g, dtype=torch.int64)
        flat = tensor.view(-1)
        if flat.numel() >= 2:
            # The extremes catch a transfer that narrows or sign-extends.
            flat[0], flat[-1] = torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max
    elif kind == "uint8":
        tensor = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    else:
        tensor = torch.randn(shape, generator=g).to(getattr(torch, kind))
    if spec.get("numpy"):
        return np.flip(tensor.numpy(), axis=0)
    return tensor


def digest(tensor: Any) -> str:
    import torch

    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def described(tensor: Any) -> tuple[str, list[int], str]:
    """dtype (torch's spelling), shape and digest of a fetched tensor."""
    return str(tensor.dtype).removeprefix("torch."), list(tensor.shape), digest(tensor)


def expected(spec: dict[str, Any]) -> tuple[str, list[int], str]:
    """What :func:`described` must say of the array ``spec`` names, once fetched."""
    import torch

    array = make_array(spec)
    tensor = array if isinstance(array, torch.Tensor) else torch.from_numpy(array.copy())
    return described(tensor)
