"""Model architectures of our own, registered with vLLM as a general plugin.

vLLM runs the ``vllm.general_plugins`` entry points (pyproject.toml) in every process it
starts: the caller's, the engine core's and each worker's. A registration made at import
time in the caller would reach none of the processes vLLM spawns. An engine picks one of
these with ``hf_overrides={"architectures": [name]}`` (``hf_overrides`` below: with the
config fix an architecture needs, where it has one).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Architecture name -> "module:class": vLLM imports the class only when an engine uses it,
# so loading the plugin costs no import of torch models.
ARCHITECTURES = {
    "OmniQwen3PenultimateModel": (
        "omni_runtime.engine.models.qwen3_penultimate:OmniQwen3PenultimateModel"
    ),
    "OmniBagelThinker": "omni_runtime.engine.models.bagel_thinker:OmniBagelThinker",
    "OmniQwen2AntepenultimateModel": (
        "omni_runtime.engine.models.hidden_layers:OmniQwen2AntepenultimateModel"
    ),
    "OmniQwen3OmniThinker": "omni_runtime.engine.models.qwen3_omni:OmniQwen3OmniThinker",
    "OmniQwen3OmniTalker": "omni_runtime.engine.models.qwen3_omni:OmniQwen3OmniTalker",
}

# Architectures that keep state per request and say something per request beside their
# tokens (step_state.StepStateModel): their engines run the worker that tells them.
STEP_STATE_ARCHITECTURES = frozenset({"OmniQwen3OmniThinker", "OmniQwen3OmniTalker"})
STEP_STATE_WORKER = "omni_runtime.engine.models.step_state.StepStateCPUWorker"
STEP_STATE_GPU_WORKER = "omni_runtime.engine.models.step_state_gpu.StepStateGPUWorker"
# vLLM's V1 runner is the one subclassed: a CUDA build would otherwise run its V2 runner.
STEP_STATE_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def step_state_worker() -> str:
    """vLLM's ``worker_cls`` for an engine of a step-state architecture, on this platform."""
    from vllm.platforms import current_platform

    return STEP_STATE_WORKER if current_platform.is_cpu() else STEP_STATE_GPU_WORKER


# Architecture name -> "module:function" that turns the checkpoint's HF config into the one
# the architecture reads, where a fixed override cannot say it (it depends on the
# checkpoint): HunyuanVideo-1.5's text encoder is Qwen2.5-VL's language model alone, whose
# M-RoPE declaration vLLM's Qwen2 must not see.
CONFIG_FIXES = {
    "OmniQwen2AntepenultimateModel": (
        "omni_runtime.engine.models.hidden_layers:text_only_qwen2_5_vl"
    ),
    # The talker's engine reads the checkpoint's talker config.
    "OmniQwen3OmniTalker": "omni_runtime.engine.models.qwen3_omni:talker_config",
}


# A request's SamplingParams.extra_args key: a speaking family's thinker says this
# request's rows (what its talker reads) beside its tokens.
HIDDEN_ROWS = "omni_hidden_rows"


@dataclass(frozen=True)
class StepHandOff:
    """What the stage of a step-state architecture hands the next of what its model says
    beside each step's tokens, gathered over the request."""

    # The hand-off's name: what the model said, every step's rows in order.
    said: str
    # Its request's prompt token ids too, under this name (None: not).
    prompt: str | None = None
    # What it says are frames of integer codes, handed off as int64 from the last chunk's
    # end, after the frames before them that the consumer decodes first (``meta``'s
    # ``context``): whole when the request finishes, or where the pipeline streams between
    # stages (asyncChunk) in chunks as they are said.
    frames: bool = False
    # Every request says it; otherwise only those that ask (HIDDEN_ROWS in extra_args).
    always: bool = False


# Architecture name -> what its stage hands off of what it says (STEP_STATE_ARCHITECTURES).
STEP_HAND_OFFS = {
    "OmniQwen3OmniThinker": StepHandOff("thinker_rows", prompt="thinker_prompt"),
    "OmniQwen3OmniTalker": StepHandOff("codes", frames=True, always=True),
}

# Architecture name -> "module:class" of how a request of the architecture is made from the
# arrays an upstream stage handed off (its ``inputs``: a talker's, the thinker's rows and
# prompt ids) and its own params (a voice): called with the stage's HF config. The stage
# server checks the params and names the inputs (``take_params``, ``inputs``); the engine
# core fetches the arrays and finishes the request (``issue``, ``prepare``), so that the
# arrays go from the producer to the process that computes on them, never through the
# stage server.
INPUT_PROMPTS = {
    "OmniQwen3OmniTalker": "omni_runtime.engine.models.qwen3_omni:TalkerPrompt",
}


def input_prompt(architecture: str, config: Any) -> Any:
    """How requests of ``architecture`` are made from their inputs; None if it reads none."""
    target = INPUT_PROMPTS.get(architecture)
    if target is None:
        return None
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)(config)


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


@dataclass(frozen=True)
class FixedConfig:
    """vLLM's ``hf_overrides`` as a function of the checkpoint's config: the overrides, set
    as vLLM sets a dict's, then the architecture's config fix (``CONFIG_FIXES``). Plain
    data, so that it pickles into the engine core's process with the rest of the config."""

    overrides: tuple[tuple[str, Any], ...]
    fix: str

    def __call__(self, config: Any) -> Any:
        for key, value in self.overrides:
            nested = getattr(config, key, None)
            if isinstance(value, Mapping) and hasattr(nested, "to_dict"):
                for name, item in value.items():
                    setattr(nested, name, item)
            else:
                setattr(config, key, value)
        module_name, _, function = self.fix.partition(":")
        return getattr(importlib.import_module(module_name), function)(config)


def hf_overrides(architecture: str, overrides: Mapping[str, Any]) -> Any:
    """vLLM's ``hf_overrides`` for an engine of ``architecture`` given the stage's own
    ``overrides``: those with the architecture named, and its config fix if it has one."""
    named = {**overrides, "architectures": [architecture]}
    fix = CONFIG_FIXES.get(architecture)
    if fix is None:
        return named
    return FixedConfig(tuple(named.items()), fix)
