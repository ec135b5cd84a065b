"""BAGEL's thinker on vLLM: a prompt in, the context's per-layer KV cache out.

A BAGEL thinker stage prefills a request's *context* (what the DiT's latent tokens attend
to) and hands the DiT its keys and values. vLLM 0.32's own ``BagelForConditionalGeneration``
serves only the understanding side, and its CPU attention kernel has no attention that is
full within an image span and causal elsewhere; its KV cache, where a KV connector could
read it, is paged in a layout that depends on the attention backend (on CPU, on the ISA).
So this model computes the context with :mod:`omni_runtime.modeling.bagel` (the same code
the DiT stage runs, equal to the reference's) and returns, as each prompt token's pooled
row, that token's keys and values in every layer: vLLM's pooling runner batches and
schedules the prefills, and the stage hands each request's rows to the DiT through the
pipeline's connector (``llm_frontend``).

It is attention-free as far as vLLM knows: no paged cache is allocated, every prompt is
prefilled whole in one step (the stage's engine configuration turns chunked prefill and
prefix caching off), and the prompts of one step are told apart by their positions, which
restart at 0 for each.

A prompt is the context's token ids as :func:`context_token_ids` frames them; everything
outside an image span is text, causal, one RoPE position per token.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.pooler import DispatchPooler
from vllm.model_executor.layers.pooler.tokwise.methods import AllPool
from vllm.model_executor.layers.pooler.tokwise.poolers import TokenPooler
from vllm.model_executor.models.interfaces_base import VllmModelForPooling

from omni_runtime.modeling.bagel.config import BagelShape, read_bagel_shape
from omni_runtime.modeling.bagel.model import BagelModel, ContextKV


def kv_row_width(shape: BagelShape) -> int:
    """The width of one token's pooled row: keys then values, every layer."""
    llm = shape.llm
    return 2 * llm.num_layers * llm.num_kv_heads * llm.head_dim


def rows_from_context(context: ContextKV) -> torch.Tensor:
    """``context``'s keys and values as one row per token, [tokens, 2 * layers * heads * dim],
    each row laid out [2, layers, kv_heads, head_dim]."""
    kv = torch.stack([context.keys, context.values])  # [2, layers, tokens, heads, dim]
    return kv.permute(2, 0, 1, 3, 4).reshape(context.length, -1)


def _checkpoint_dir(model: str) -> str:
    if os.path.isdir(model):
        return model
    # vLLM has fetched a hub model into the local cache by the time it builds the model.
    from huggingface_hub import snapshot_download

    return str(snapshot_download(model, local_files_only=True))


class OmniBagelThinker(nn.Module, VllmModelForPooling):  # type: ignore[misc]
    """BAGEL's context prefill as a vLLM pooling model (token_embed: one row per token)."""

    is_pooling_model: ClassVar[bool] = True
    is_attention_free: ClassVar[bool] = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        model_config = vllm_config.model_config
        root = _checkpoint_dir(model_config.model)
        self.shape = read_bagel_shape(root)
        # Built in vLLM's default dtype and device (set around this call), then loaded.
        self.bagel = BagelModel(self.shape)
        # Each prompt token's row as the forward made it: no head, so neither vLLM's float32
        # cast of pooled rows nor a normalisation touches the cache.
        self.pooler = DispatchPooler({"token_embed": TokenPooler(pooling=AllPool(), head=None)})

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeddings: torch.Tensor = self.bagel.language_model.model.embed_tokens(input_ids)
        return embeddings

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        """Each prompt's context rows, the prompts one after another as vLLM laid them out."""
        if input_ids is None:
            raise ValueError("the BAGEL thinker reads token ids (no prompt embeddings)")
        n = int(input_ids.shape[0])
        starts = (positions == 0).nonzero().flatten().tolist()
        if not starts or starts[0] != 0:
            # Not a whole prompt: only vLLM's own warm-up passes make these.
            starts = [0, *starts]
        bounds = [*starts, n]
        dtype, device = self.bagel.dtype, self.bagel.device
        rows = []
        for begin, end in itertools.pairwise(bounds):
            context = ContextKV.empty(self.shape.llm, dtype, device)
            ids = input_ids[begin:end].tolist()
            context = self.bagel.extend_with_token_ids(context, ids)
            rows.append(rows_from_context(context))
        return torch.cat(rows) if rows else torch.empty(0, kv_row_width(self.shape))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tensors by their own names (``ema.safetensors``); the VAE's
        (``ae.safetensors``) are not the thinker's."""
        params = dict(self.bagel.named_parameters())
        loaded: set[str] = set()
        for name, weight in weights:
            target = params.get(name)
            if target is None:
                continue
            with torch.no_grad():
                target.copy_(weight.to(target.dtype))
            loaded.add(f"bagel.{name}")
        missing = sorted(set(params) - {name.removeprefix("bagel.") for name in loaded})
        if missing:
            raise ValueError(
                f"the checkpoint lacks {len(missing)} of BAGEL's weights (first: {missing[0]})"
            )
        return loaded
