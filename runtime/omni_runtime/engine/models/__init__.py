"""Model architectures of our own, registered with vLLM as a general plugin.

vLLM runs the ``vllm.general_plugins`` entry points (pyproject.toml) in every process it
starts: the caller's, the engine core's and each worker's. A registration made at import
time in the caller would reach none of the processes vLLM spawns. An engine picks one of
these with ``hf_overrides={"architectures": [name]}``.
"""

from __future__ import annotations

# Architecture name -> "module:class": vLLM imports the class only when an engine uses it,
# so loading the plugin costs no import of torch models.
ARCHITECTURES = {
    "OmniQwen3PenultimateModel": (
        "omni_runtime.engine.models.qwen3_penultimate:OmniQwen3PenultimateModel"
    ),
    "OmniBagelThinker": "omni_runtime.engine.models.bagel_thinker:OmniBagelThinker",
}


def register_models() -> None:
    """Register the architectures of ARCHITECTURES with vLLM's model registry; a second
    call changes nothing."""
    from vllm import ModelRegistry

    known = ModelRegistry.get_supported_archs()
    for name, target in ARCHITECTURES.items():
        if name not in known:
            ModelRegistry.register_model(name, target)
