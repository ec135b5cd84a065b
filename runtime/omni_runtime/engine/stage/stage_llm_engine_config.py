"""From the pipeline schema to vLLM: the engine configuration of one LLM stage.

A stage's fields map onto vLLM's ``EngineArgs`` one to one; ``engineArgs`` passes further
arguments through (the schema already refuses the ones that have a field of their own).
``output`` chooses the runner, since vLLM 0.32 runs one runner per engine: ``text`` the
generate runner, ``hidden_states`` the pooling runner with the ``embed`` conversion, whose
``token_embed`` task returns each prompt token's hidden state after the final norm.
``devices`` is not an engine argument: whoever starts the stage's process places it
(CUDA_VISIBLE_DEVICES), and vLLM uses what it sees.
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
from vllm.usage.usage_lib import UsageContext

from omni_runtime.config import StageConfig
from omni_runtime.config.models import ENGINE_ARG_FIELDS
from omni_runtime.engine.models import STEP_STATE_ENV, hf_overrides, step_state_worker
from omni_runtime.families import MODEL_INDEX, EncoderRecipe, SpeechStage

_ENGINE_ARG_NAMES = frozenset(field.name for field in dataclasses.fields(EngineArgs))


class StageLLMConfigError(ValueError):
    """A stage that cannot become a vLLM engine; the message names the field."""


def make_stage_llm_engine_args(
    stage: StageConfig,
    model: str,
    encoder: EncoderRecipe | None = None,
    speech: SpeechStage | None = None,
) -> EngineArgs:
    """vLLM's engine arguments for ``stage`` serving ``model`` (a path or hub id).

    An encoder stage of a model family (``encoder``) given the family's whole diffusers
    checkpoint loads only its text encoder (and the tokenizer or processor beside it),
    with the architecture that returns the layer the family's DiT reads. A stage of a
    speaking family (``speech``: Qwen3-Omni's thinker or talker) runs its part's
    architecture, which keeps state per request (engine.models.step_state)."""
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
    cache = os.environ.get("OMNI_CACHE_DIR") or os.path.expanduser("~/.cache/omni-operator")
    views = os.path.join(cache, "encoder-views")
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
) -> VllmConfig:
    """The VllmConfig of ``stage``: what StageLLMCoreProcManager and the clients take.

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
    engine_args = make_stage_llm_engine_args(stage, model, encoder, speech)
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
