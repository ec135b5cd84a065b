"""Qwen3 as Z-Image's text encoder: the residual stream before the last decoder layer.

Z-Image conditions its DiT on transformers' ``hidden_states[-2]``: the output of the first
N-1 decoder layers, without the final norm. vLLM's pooling runner returns what the model's
forward returns, which for vLLM's Qwen3 is the last layer after the final norm; this model
stops one layer earlier and ends in the plain residual sum instead.

It is a ``Qwen3ForCausalLM``, not a ``Qwen3Model``, because that is the shape vLLM's
``convert="embed"`` adapter (``as_embedding_model``) wraps: the adapter drops the LM head,
adds the token-embedding pooler, and loads checkpoints of either form (``Qwen3ForCausalLM``
weights under ``model.``, ``Qwen3Model`` weights without it), prefixing the latter, so that
this class sees every name under ``model.``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.utils import PPMissingLayer


class _ResidualSum(nn.Module):  # type: ignore[misc]
    """Takes the final RMSNorm's place: vLLM's decoder layers hand on their output and the
    residual apart, and the model's forward ends in ``norm(hidden_states, residual)``."""

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # No residual only when no layer ran (N = 1): the embeddings are the answer then.
        summed = hidden_states if residual is None else hidden_states + residual
        return summed, summed


class OmniQwen3PenultimateModel(Qwen3ForCausalLM):  # type: ignore[misc]
    """vLLM's Qwen3 with N-1 decoder layers and no final norm (``hidden_states[-2]``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_config.get_text_config()
        # Built with one layer fewer, so that the last layer gets no attention layer (and so
        # no KV cache) and pipeline parallelism splits the layers that run; the config goes
        # back to describing the checkpoint afterwards.
        config.num_hidden_layers -= 1
        try:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        finally:
            config.num_hidden_layers += 1
        if not isinstance(self.model.norm, PPMissingLayer):
            self.model.norm = _ResidualSum()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # The checkpoint still holds the last layer and the final norm; vLLM's loader
        # refuses weights that have no parameter.
        last = self.model.config.num_hidden_layers - 1
        dropped = (f"model.layers.{last}.", "model.norm.")
        kept = ((name, weight) for name, weight in weights if not name.startswith(dropped))
        loaded: set[str] = super().load_weights(kept)
        return loaded
