"""From the pipeline schema to vLLM: the engine configuration of one LLM stage.

A stage's fields map onto vLLM's ``EngineArgs`` one to one; ``engineArgs`` passes further
arguments through (the schema already refuses the ones that have a field of their own).
``output`` chooses the runner, since vLLM 0.32 runs one runner per engine: ``text`` the
generate runner, ``hidden_states`` the pooling runner with the ``embed`` conversion, whose
``token_embed`` task returns each prompt token's hidden state after the final norm.
``devices`` is not an engine argument: whoever starts the stage's process places it
(CUDA_VISIBLE_DEVICES), and vLLM uses what it sees. A stage that takes LoRA adapters
(``PipelineConfig.adapter_capacity``) turns vLLM's LoRA on, sized by that capacity: as many
adapters in one batch (``max_loras``) as the replica holds loaded (``max_cpu_loras``), so
that every adapter it holds can run at once; on vLLM's CPU platform one more, for the zero
adapter that requests without one run with there (``lora_needs_zero_adapter``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
from typing import Any

import pydantic
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.usage.usage_lib import UsageContext

from omni_runtime.config import StageConfig
from omni_runtime.config.stages import DEFAULT_MAX_LORA_RANK, ENGINE_ARG_FIELDS
from omni_runtime.engine.models import STEP_STATE_ENV, hf_overrides, step_state_worker
from omni_runtime.families import MODEL_INDEX, EncoderRecipe, SpeechStage
from omni_runtime.paths import cache_dir

_ENGINE_ARG_NAMES = frozenset(field.name for field in dataclasses.fields(EngineArgs))


def lora_needs_zero_adapter() -> bool:
    """Whether requests without an adapter must run with a zero adapter on an engine that
    serves LoRA adapters here.

    vLLM's CPU LoRA kernels (the torch ops behind PunicaWrapperCPU) index the stacked
    adapter weights with each row's adapter slot, and a row without an adapter has slot
    -1, which Python reads as the last slot: in a batch that mixes requests with and
    without adapters, the latter get the last slot's adapter applied, silently (vLLM
    0.32's lora/ops/torch_ops: ``lora_b_weights[lora_indices_tensor]``, unmasked). Slots
    fill from the first, so the last holds an adapter only once every slot has held one: a
    stage's first adapter load also loads a zero adapter, which those requests run with
    from then on, keeping them exact while they share batches; its slot is one more than
    the adapters a replica holds."""
    wrapper: str = current_platform.get_punica_wrapper()
    return wrapper.endswith(".PunicaWrapperCPU")


class StageLLMConfigError(ValueError):
    """A stage that cannot become a vLLM engine; the message names the field."""


def make_stage_llm_engine_args(
    stage: StageConfig,
    model: str,
    encoder: EncoderRecipe | None = None,
    speech: SpeechStage | None = None,
    adapter_capacity: int = 0,
) -> EngineArgs:
    """vLLM's engine arguments for ``stage`` serving ``model`` (a path or hub id).

    An encoder stage of a model family (``encoder``) given the family's whole diffusers
    checkpoint loads only its text encoder (and the tokenizer or processor beside it),
    with the architecture that returns the layer the family's DiT reads. A stage of a
    speaking family (``speech``: Qwen3-Omni's thinker or talker) runs its part's
    architecture, which keeps state per request (engine.models.step_state).
    ``adapter_capacity``: how many LoRA adapters a replica holds loaded
    (``PipelineConfig.adapter_capacity``); 0, the stage takes none and vLLM's LoRA stays
    off."""
    if stage.type != "llm":
        raise StageLLMConfigError(f"type: stage {stage.stage_id} is a {stage.type} stage")
    unknown = sorted(set(stage.engine_args) - _ENGINE_ARG_NAMES)
    if unknown:
        raise StageLLMConfigError(
            f"engineArgs.{unknown[0]}: not an engine argument of vLLM "
            f"(unknown: {', '.join(unknown)})"
        )
    args: dict[str, Any] = {
        name: value for name in ENGINE_ARG_FIELDS if (value := getattr(stage, name)) is not None
    }
    if stage.output == "hidden_states" or encoder is not None:
        args.update(runner="pooling", convert="embed")
    else:
        args.update(runner="generate")
    if adapter_capacity > 0:
        if "max_cpu_loras" in stage.engine_args:
            # The stage's replica keeps a mirror of vLLM's adapter cache, which the router
            # reads: both must hold the same number.
            raise StageLLMConfigError(
                "engineArgs.max_cpu_loras: set by the stage's maxLoras (the adapters a "
                "replica holds loaded); leave it out"
            )
        slots = adapter_capacity + 1 if lora_needs_zero_adapter() else adapter_capacity
        args.update(
            enable_lora=True,
            max_loras=slots,
            max_cpu_loras=slots,
            max_lora_rank=stage.max_lora_rank or DEFAULT_MAX_LORA_RANK,
        )
    if encoder is not None and encoder.context_kv:
        # The thinker prefills each prompt whole (its attention spans the whole context)
        # and keeps no cache to share between prompts; its forward walks each prompt's
        # spans in Python, which a captured graph cannot replay.
        args.update(enable_chunked_prefill=False, enable_prefix_caching=False, enforce_eager=True)
    extra = dict(stage.engine_args)
    if speech is not None:
        extra["hf_overrides"] = hf_overrides(
            speech.architecture, dict(extra.get("hf_overrides") or {})
        )
        extra["worker_cls"] = step_state_worker()
        # Every prompt token is computed, never read from the prefix cache: the thinker
        # says each one's rows, and the talker's prompt is placeholder ids standing for
        # rows that differ from request to request (a cached prefix would be another's).
        args["enable_prefix_caching"] = False
        if speech.role == "talker":
            # It reads and writes codec tokens: no text, no tokenizer.
            args["skip_tokenizer_init"] = True
        for name, value in STEP_STATE_ENV.items():
            os.environ.setdefault(name, value)
    if encoder is not None:
        if encoder.architecture is not None:
            # The architecture named, and the checkpoint's config fixed for it where it
            # needs that (omni_runtime.engine.models.CONFIG_FIXES).
            extra["hf_overrides"] = hf_overrides(
                encoder.architecture, dict(extra.get("hf_overrides") or {})
            )
        if encoder.vision_language and not encoder.takes_image:
            # A vision-language text encoder that reads text only: no vision tower, and no
            # image processor to find.
            extra.setdefault("language_model_only", True)
    return EngineArgs(model=model, **args, **extra)


def encoder_model_view(checkpoint: str, encoder: EncoderRecipe) -> str:
    """One directory vLLM can load a family's encoder from: the files of the diffusers
    checkpoint's text encoder and of its tokenizer (or processor) folder, linked side by
    side (vLLM takes the weights, the tokenizer and the image processor all from its
    ``model``); the weights' own files win where both folders have one.

    Made once under the cache directory, keyed by what it links, and moved into place
    whole: replicas of a stage starting together on one machine share it, and none sees
    it half made."""
    checkpoint = os.path.abspath(checkpoint)
    links: dict[str, str] = {}
    for folder in (encoder.text_encoder_subfolder, encoder.tokenizer_subfolder):
        source = os.path.join(checkpoint, folder)
        if not os.path.isdir(source):
            raise StageLLMConfigError(
                f"model: {checkpoint} has no {folder}/ (the {encoder.text_encoder_subfolder} "
                f"and {encoder.tokenizer_subfolder} folders of a diffusers checkpoint are "
                "what its encoder stage loads)"
            )
        for name in sorted(os.listdir(source)):
            links.setdefault(name, os.path.join(source, name))
    key = hashlib.sha256(repr(sorted(links.items())).encode()).hexdigest()[:16]
    views = os.fspath(cache_dir() / "encoder-views")
    view = os.path.join(views, key)
    if os.path.isdir(view):
        return view
    os.makedirs(views, exist_ok=True)
    building = tempfile.mkdtemp(dir=views, prefix=".building-")
    for name, target in links.items():
        os.symlink(target, os.path.join(building, name))
    try:
        os.rename(building, view)
    except OSError:
        # Another replica moved the same view into place first.
        shutil.rmtree(building, ignore_errors=True)
        if not os.path.isdir(view):
            raise
    return view


def make_stage_llm_vllm_config(
    stage: StageConfig,
    model: str,
    encoder: EncoderRecipe | None = None,
    speech: SpeechStage | None = None,
    adapter_capacity: int = 0,
) -> VllmConfig:
    """The VllmConfig of ``stage``: what StageLLMCoreProcManager and the clients take
    (``adapter_capacity`` as make_stage_llm_engine_args takes it).

    An engine of one worker (no tensor or pipeline parallelism) runs its worker inside the
    engine-core process (vLLM's uniprocess executor), unless ``engineArgs`` names a
    backend: a stage is then two processes, client and core, not three. vLLM's CPU
    platform turns "uni" into "mp" while building the config (it expects the uniprocess
    executor only in the caller's own process), so the choice is made after it.
    """
    if model.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(model)):
        raise StageLLMConfigError(
            f"model: {model} is not a directory (a local model must exist; a hub id reads org/name)"
        )
    if encoder is not None and os.path.isfile(os.path.join(model, MODEL_INDEX)):
        model = encoder_model_view(model, encoder)
    engine_args = make_stage_llm_engine_args(stage, model, encoder, speech, adapter_capacity)
    try:
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.ENGINE_CONTEXT)
    except (ValueError, OSError) as e:
        # vLLM's message says what is wrong and what is allowed; its traceback does not.
        raise StageLLMConfigError(
            f"stage {stage.name!r}: vLLM refuses its engine configuration: {_reason(e)}"
        ) from e
    parallel_config = vllm_config.parallel_config
    if parallel_config.data_parallel_size > 1 and vllm_config.model_config.is_moe:
        # vLLM runs such ranks in lockstep (DPEngineCoreProc and its wave coordination),
        # which a stage core does not do.
        raise StageLLMConfigError(
            "dataParallelSize: data parallelism of a mixture-of-experts model is not "
            "supported by LLM stages; use replicas instead"
        )
    if "distributed_executor_backend" not in stage.engine_args and parallel_config.world_size == 1:
        parallel_config.distributed_executor_backend = "uni"
    return vllm_config


def _reason(error: Exception) -> str:
    if isinstance(error, pydantic.ValidationError):
        messages = [item["msg"].removeprefix("Value error, ") for item in error.errors()]
    else:
        messages = [str(error)]
    return " ".join("; ".join(messages).split())
