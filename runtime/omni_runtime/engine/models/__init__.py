"""Model architectures of our own, registered with vLLM as a general plugin.

vLLM runs the ``vllm.general_plugins`` entry points (pyproject.toml) in every process it
starts: the caller's, the engine core's and each worker's. A registration made at import
time in the caller would reach none of the processes vLLM spawns. An engine picks one of
these with ``hf_overrides={"architectures": [name]}``.
"""

from __future__ import annotations

import importlib
from typing import Any

# Architecture name -> "module:class": vLLM imports the class only when an engine uses it,
# so loading the plugin costs no import of torch models.
ARCHITECTURES = {
    "OmniQwen3PenultimateModel": (
        "omni_runtime.engine.models.qwen3_penultimate:OmniQwen3PenultimateModel"
    ),
    "OmniBagelThinker": "omni_runtime.engine.models.bagel_thinker:OmniBagelThinker",
}


# A request's PoolingParams.extra_kwargs key: in think mode, the most tokens of the plan an
# encoder architecture writes before it hands its context off (BAGEL's thinker).
THINK_TOKENS = "think_tokens"

# Architecture name -> "module:class" of what shapes its pooled rows into the context KV
# hand-off a DiT reads (EncoderRecipe.hand_off "context_kv"): called with the rows, the
# context's token ids and its prompt's length, it returns the array and the hand-off's meta.
CONTEXT_HAND_OFFS = {
    "OmniBagelThinker": "omni_runtime.engine.models.bagel_thinker:ContextHandOff",
}


def context_hand_off(architecture: str, model: str, tokenizer: Any) -> Any:
    """The context KV hand-off of ``architecture`` for ``model``; ValueError if it has none."""
    target = CONTEXT_HAND_OFFS.get(architecture)
    if target is None:
        raise ValueError(f"architecture {architecture!r} hands off no context KV")
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)(model, tokenizer)


def register_models() -> None:
    """Register the architectures of ARCHITECTURES with vLLM's model registry; a second
    call changes nothing."""
    from vllm import ModelRegistry

    known = ModelRegistry.get_supported_archs()
    for name, target in ARCHITECTURES.items():
        if name not in known:
            ModelRegistry.register_model(name, target)
