"""Text encoders that stop before their last decoder layers: a DiT conditioned on
transformers' ``hidden_states[-(k + 1)]``, the residual stream after N-k layers with no
final norm, gets it from an LLM stage through one of these.

vLLM's pooling runner returns what the model's forward returns, which for a decoder LLM is
its last layer after the final norm. ``SkipsLastLayers`` builds the model with k layers
fewer (so that the skipped ones get no attention layer, no KV cache, and pipeline
parallelism splits the layers that run) and ends it in the plain residual sum in place of
the final RMSNorm:

- Z-Image: Qwen3's ``hidden_states[-2]`` (k = 1; ``qwen3_penultimate``);
- HunyuanVideo-1.5: Qwen2.5-VL's language model's ``hidden_states[-3]`` (k = 2;
  ``OmniQwen2AntepenultimateModel`` below).

Each is a ``...ForCausalLM``, not a ``...Model``, because that is the shape vLLM's
``convert="embed"`` adapter (``as_embedding_model``) wraps: the adapter drops the LM head,
adds the token-embedding pooler, and loads checkpoints of either form (``ForCausalLM``
weights under ``model.``, bare ``Model`` weights without it), prefixing the latter, so that
these classes see every name under ``model.``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.utils import PPMissingLayer


class _ResidualSum(nn.Module):  # type: ignore[misc]
    """Takes the final RMSNorm's place: vLLM's decoder layers hand on their output and the
    residual apart, and the model's forward ends in ``norm(hidden_states, residual)``."""

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # No residual only when no layer ran (N = k): the embeddings are the answer then.
        summed = hidden_states if residual is None else hidden_states + residual
        return summed, summed


class SkipsLastLayers:
    """Mixed in before a vLLM ``...ForCausalLM`` whose decoder is ``self.model`` (its layers
    ``model.layers``, its final norm ``model.norm``): the model runs all but its last
    ``skipped_layers`` decoder layers and returns the residual stream, no final norm."""

    skipped_layers: ClassVar[int]
    model: Any

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_config.get_text_config()
        if config.num_hidden_layers < self.skipped_layers:
            raise ValueError(
                f"{type(self).__name__} skips the last {self.skipped_layers} decoder layers; "
                f"the checkpoint has {config.num_hidden_layers}"
            )
        # Built with the skipped layers left out; the config goes back to describing the
        # checkpoint afterwards.
        config.num_hidden_layers -= self.skipped_layers
        try:
            super().__init__(vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
        finally:
            config.num_hidden_layers += self.skipped_layers
        if not isinstance(self.model.norm, PPMissingLayer):
            self.model.norm = _ResidualSum()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # The checkpoint still holds the skipped layers and the final norm; vLLM's loader
        # refuses weights that have no parameter.
        layers = self.model.config.num_hidden_layers
        dropped = (
            *(f"model.layers.{n}." for n in range(layers - self.skipped_layers, layers)),
            "model.norm.",
        )
        kept = ((name, weight) for name, weight in weights if not name.startswith(dropped))
        loaded: set[str] = super().load_weights(kept)  # type: ignore[misc]
        return loaded


class OmniQwen2AntepenultimateModel(SkipsLastLayers, Qwen2ForCausalLM):  # type: ignore[misc]
    """vLLM's Qwen2 with N-2 decoder layers and no final norm (``hidden_states[-3]``): the
    text encoder of HunyuanVideo-1.5, Qwen2.5-VL's language model alone, whose text-only
    forward is Qwen2's (see ``text_only_qwen2_5_vl``)."""

    skipped_layers = 2


def text_only_qwen2_5_vl(config: Any) -> Any:
    """The HF config of Qwen2.5-VL's language model alone (``Qwen2_5_VLTextModel``, model type
    ``qwen2_5_vl_text``: HunyuanVideo-1.5's ``text_encoder/``) as vLLM's Qwen2 reads it:
    plain RoPE at the checkpoint's own base, and no tied LM head (the folder holds none).

    M-RoPE rotates a text token by its position in all three of its sections, which is
    plain RoPE; left declared, vLLM would ask the model for 3-D positions."""
    for rope in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if isinstance(rope, dict):
            rope.pop("mrope_section", None)
            rope.pop("mrope_interleaved", None)
            if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
                rope["rope_type"] = "default"
                rope.pop("type", None)
    config.tie_word_embeddings = False
    return config
