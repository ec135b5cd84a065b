"""Qwen3 as Z-Image's text encoder: the residual stream before the last decoder layer.

Z-Image conditions its DiT on transformers' ``hidden_states[-2]``: the output of the first
N-1 decoder layers, without the final norm. vLLM's pooling runner returns what the model's
forward returns, which for vLLM's Qwen3 is the last layer after the final norm; this model
stops one layer earlier and ends in the plain residual sum instead (``SkipsLastLayers``,
which says why it is a ``Qwen3ForCausalLM``).
"""

from __future__ import annotations

from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from omni_runtime.engine.models.hidden_layers import SkipsLastLayers


class OmniQwen3PenultimateModel(SkipsLastLayers, Qwen3ForCausalLM):  # type: ignore[misc]
    """vLLM's Qwen3 with N-1 decoder layers and no final norm (``hidden_states[-2]``)."""

    skipped_layers = 1
