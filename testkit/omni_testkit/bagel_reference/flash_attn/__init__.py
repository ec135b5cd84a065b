"""A CPU stand-in for the `flash_attn` package, for running BAGEL's reference code.

The reference imports `from flash_attn import flash_attn_varlen_func`; this module provides
that one function with flash-attn 2's semantics, computed with torch's scaled dot-product
attention one packed segment at a time. It is put on PYTHONPATH only when the reference
runs (tests/integration/bagel_reference/run_reference.py); it is not installed anywhere.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["flash_attn_varlen_func"]
__version__ = "2.0.0+sdpa-standin"

# Arguments flash-attn accepts that change the result; anything but their neutral value
# is refused rather than silently ignored.
_NEUTRAL = {
    "window_size": (-1, -1),
    "softcap": 0.0,
    "alibi_slopes": None,
    "return_attn_probs": False,
    "block_table": None,
}


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    **kw: Any,
) -> torch.Tensor:
    """Attention over packed variable-length sequences.

    q: [total_q, heads, head_dim]; k, v: [total_k, kv_heads, head_dim] with heads a multiple
    of kv_heads (GQA: query head h reads kv head h // (heads // kv_heads)). Segment i is
    q[cu_seqlens_q[i]:cu_seqlens_q[i+1]] against k/v[cu_seqlens_k[i]:cu_seqlens_k[i+1]].
    `causal` is aligned to the bottom-right corner when a segment's q is shorter than its k
    (flash-attn >= 2.1): query row r sees keys j <= r + (len_k - len_q). A query row that
    sees no key gives zeros, as flash-attn does. Returns [total_q, heads, head_dim] in q's
    dtype.
    """
    for name, neutral in _NEUTRAL.items():
        value = kw.get(name, neutral)
        if name == "window_size":
            value = tuple(value)
        if value != neutral:
            raise NotImplementedError(f"flash_attn stand-in: {name}={value!r} is not supported")
    if dropout_p:
        raise NotImplementedError("flash_attn stand-in: dropout is not supported")
    total_q, heads = q.shape[0], q.shape[1]
    kv_heads = k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    groups = heads // kv_heads
    cu_q = [int(x) for x in cu_seqlens_q.tolist()]
    cu_k = [int(x) for x in cu_seqlens_k.tolist()]
    if len(cu_q) != len(cu_k):
        raise ValueError("cu_seqlens_q and cu_seqlens_k hold different numbers of segments")
    out = q.new_zeros((total_q, heads, v.shape[-1]))
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        len_q, len_k = q1 - q0, k1 - k0
        if len_q == 0:
            continue
        if len_k == 0:
            continue  # no key: flash-attn's output is zero
        qs = q[q0:q1].transpose(0, 1)  # [heads, len_q, dim]
        ks = k[k0:k1].transpose(0, 1)  # [kv_heads, len_k, dim]
        vs = v[k0:k1].transpose(0, 1)
        if groups > 1:
            ks = ks.repeat_interleave(groups, dim=0)
            vs = vs.repeat_interleave(groups, dim=0)
        mask = None
        seen = None
        if causal:
            rows = torch.arange(len_q, device=q.device)[:, None]
            cols = torch.arange(len_k, device=q.device)[None, :]
            mask = cols <= rows + (len_k - len_q)
            seen = mask.any(dim=1)
        o = F.scaled_dot_product_attention(
            qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), attn_mask=mask, scale=softmax_scale
        )[0].transpose(0, 1)  # [len_q, heads, dim]
        if seen is not None and not bool(seen.all()):
            o = torch.where(seen[:, None, None], o, torch.zeros((), dtype=o.dtype))
        out[q0:q1] = o.to(out.dtype)
    return out
