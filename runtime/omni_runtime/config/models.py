"""A pipeline: its model, stages, connectors, router and adapters, and the rules that tie
them together (its stage graph, its family's, GPU memory, adapters)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

from pydantic import Field, model_validator

from omni_runtime.families import (
    FAMILIES,
    FAMILY_NAMES,
    EncoderRecipe,
    Family,
    FamilyName,
    SpeechStage,
    family_of_model_name,
)
from omni_runtime.families.base import VideoRecipe
from omni_runtime.families.graph import StageGraph, chain_graph, outputs_hidden_states

from .adapters import AdapterConfig
from .base import SchemaModel
from .connectors import ConnectorConfig
from .errors import PipelineConfigError
from .router import RouterConfig
from .stages import DEFAULT_MAX_LORAS, GPU_SHARE_EPSILON, StageConfig


class PipelineConfig(SchemaModel):
    """A multi-stage pipeline: its model, stages, the connectors between them, the router."""

    model: str = Field(min_length=1, description="Model path or hub id, e.g. a BAGEL checkpoint.")
    async_chunk: bool = Field(
        default=False,
        description="Stream between stages (the seed's async_chunk): in a pipeline whose "
        "family speaks, the talker hands code2wav its codes every few frames and code2wav's "
        "audio reaches the caller chunk by chunk; off, each stage hands off its whole "
        "output. Other pipelines hand off whole outputs (their DiTs take nothing partial) "
        "and refuse it.",
    )
    family: FamilyName | None = Field(
        default=None,
        description="The model family whose encoder and DiT the stages split: "
        + ", ".join(FAMILY_NAMES)
        + ". Found from the model's name or its model_index.json where left out; none: an "
        "LLM's last hidden states condition the DiT as they are.",
    )
    stages: list[StageConfig] = Field(min_length=1, description="The stages, by stageId.")
    connectors: dict[str, ConnectorConfig] = Field(
        default_factory=dict,
        description="Named connectors; a stage's inputConnectors refer to them by name.",
    )
    router: RouterConfig = Field(default_factory=RouterConfig, description="The HTTP router.")
    # None, not [], when unset: a pipeline that declares none keeps its revision.
    adapters: list[AdapterConfig] | None = Field(
        default=None,
        max_length=64,
        description="LoRA adapters of its stages, which requests pick by name (model "
        "'<servedModelName>:<adapter>', one adapter per stage joined by '+'); each replica "
        "of a stage loads one on first use and holds its stage's maxLoras at most.",
    )

    missing_hints = {
        "model": "the model path or hub id (set model, or pass it apart from the file)",
        "stages": "a list of stages, each with at least stageId",
    }

    @model_validator(mode="before")
    @classmethod
    def _apply_topology(cls, data: Any) -> Any:
        # Runs before the stages are validated, so a known model's stages need no type.
        if not isinstance(data, Mapping):
            return data
        model, stages = data.get("model"), data.get("stages")
        family = data.get("family")
        found = family_of_model_name(model) if isinstance(model, str) else None
        if family is None and found is not None:
            data = {**data, "family": found.name}
        # The family named, else the model's (a misspelt family is refused by name, and its
        # model's stages still get their types).
        named = FAMILIES.get(family) if isinstance(family, str) else None
        known_family = named or found
        if known_family is None or not isinstance(stages, list):
            return data
        topology = known_family.topology
        by_id = {known.stage_id: known for known in topology}
        filled: list[Any] = []
        for stage in stages:
            stage_id = (
                stage.get("stageId", stage.get("stage_id")) if isinstance(stage, Mapping) else None
            )
            known = by_id.get(stage_id) if type(stage_id) is int else None
            if known is not None:
                defaults: dict[str, Any] = {"type": known.type, "name": known.name}
                if known.output is not None:
                    defaults["output"] = known.output
                stage = {**defaults, **stage}
            filled.append(stage)
        return {**data, "stages": filled}

    @model_validator(mode="after")
    def _check_stage_graph(self) -> Self:
        issues: list[tuple[str, str]] = []
        index_of_id: dict[int, int] = {}
        index_of_name: dict[str, int] = {}
        for index, stage in enumerate(self.stages):
            if stage.stage_id in index_of_id:
                issues.append(
                    (
                        f"stages[{index}].stageId",
                        f"stage id {stage.stage_id} is already used by "
                        f"stages[{index_of_id[stage.stage_id]}]; stage ids must be unique",
                    )
                )
            else:
                index_of_id[stage.stage_id] = index
            if stage.name in index_of_name:
                issues.append(
                    (
                        f"stages[{index}].name",
                        f"name {stage.name!r} is already used by "
                        f"stages[{index_of_name[stage.name]}]; stage names must be unique",
                    )
                )
            else:
                index_of_name[stage.name] = index

        stage_ids = ", ".join(map(str, sorted(index_of_id)))
        connectors = ", ".join(self.connectors) or "none (define them under connectors)"
        for index, stage in enumerate(self.stages):
            for key, connector in stage.input_connectors.items():
                path = f"stages[{index}].inputConnectors.{key}"
                upstream = int(key.removeprefix("from_stage_"))
                if upstream not in index_of_id:
                    issues.append((path, f"no stage has id {upstream}; stage ids: {stage_ids}"))
                if connector not in self.connectors:
                    issues.append(
                        (path, f"unknown connector {connector!r}; defined connectors: {connectors}")
                    )
        family = self.family_recipe
        if family is not None:
            issues += family.pipeline_issues(self.stages, index_of_id)
        if self.async_chunk and (family is None or family.speech is None):
            speaking = ", ".join(name for name, f in FAMILIES.items() if f.speech is not None)
            issues.append(
                (
                    "asyncChunk",
                    f"only a pipeline whose family speaks ({speaking}) streams between "
                    "stages; this one hands off whole outputs",
                )
            )
        for index, stage in enumerate(self.stages):
            if stage.step_cache is None or stage.type != "diffusion":
                continue
            if family is None or family.dit.step_cache is None:
                cached = " or ".join(n for n, f in FAMILIES.items() if f.dit.step_cache)
                issues.append(
                    (
                        f"stages[{index}].stepCache",
                        f"only the DiT of a {cached} pipeline caches steps"
                        + (f" (this is a {family.name} pipeline)" if family else ""),
                    )
                )
        for index, stage in enumerate(self.stages):
            if stage.torch_compile and family is not None and family.dit.engine is not None:
                issues.append(
                    (
                        f"stages[{index}].torchCompile",
                        f"a {family.name} DiT runs on its own engine, not a diffusers "
                        "transformer with repeated blocks; remove torchCompile",
                    )
                )
        thinkers = ", ".join(name for name, f in FAMILIES.items() if f.thinks)
        for index, stage in enumerate(self.stages):
            if stage.think and (family is None or not family.thinks or stage.type != "llm"):
                issues.append(
                    (f"stages[{index}].think", f"only the encoder of a {thinkers} pipeline thinks")
                )
        issues += self._gpu_memory_issues()
        issues += self._adapter_issues()
        if issues:
            raise PipelineConfigError(issues)
        return self

    def adapter_stage_issue(self, stage: StageConfig) -> str | None:
        """Why ``stage`` cannot take LoRA adapters, or None where it can."""
        family = self.family_recipe
        if stage.type == "diffusion":
            if family is not None and family.dit.engine is not None:
                return (
                    f"a {family.name} DiT runs on its own engine, not a diffusers pipeline "
                    "that loads LoRA adapters"
                )
            return None
        if self.speech_stage(stage) is not None:
            return (
                "a speaking family's thinker and talker keep per-request state that vLLM's "
                "LoRA does not reach"
            )
        if stage.output != "text":
            return (
                "an encoder stage's hidden states condition the DiT as the family's recipe "
                "computes them; adapters apply to llm stages that generate text and to "
                "diffusers DiTs"
            )
        return None

    def _adapter_issues(self) -> list[tuple[str, str]]:
        issues: list[tuple[str, str]] = []
        by_name = {stage.name: stage for stage in self.stages}
        served = self.served_model_name
        seen: dict[str, int] = {}
        for index, adapter in enumerate(self.adapters or ()):
            path = f"adapters[{index}]"
            if adapter.name in seen:
                issues.append(
                    (
                        f"{path}.name",
                        f"{adapter.name!r} is already the name of adapters[{seen[adapter.name]}]"
                        "; adapter names must be unique",
                    )
                )
            else:
                seen[adapter.name] = index
            if adapter.name == served:
                issues.append(
                    (
                        f"{path}.name",
                        f"{adapter.name!r} is the pipeline's served model name; a request "
                        "naming it would be ambiguous",
                    )
                )
            stage = by_name.get(adapter.stage)
            if stage is None:
                issues.append(
                    (
                        f"{path}.stage",
                        f"no stage is named {adapter.stage!r}; stages: {', '.join(by_name)}",
                    )
                )
                continue
            why = self.adapter_stage_issue(stage)
            if why is not None:
                issues.append((f"{path}.stage", f"stage {stage.name!r} takes no adapters: {why}"))
                continue
            if stage.type == "llm" and adapter.source.startswith("https://"):
                issues.append(
                    (
                        f"{path}.source",
                        "an llm stage's adapter is a directory (adapter_config.json and its "
                        "weights): give a path in the pod or a hub id, not a URL",
                    )
                )
            if stage.type == "llm" and adapter.scale != 1.0:
                issues.append(
                    (
                        f"{path}.scale",
                        "vLLM applies an llm stage's adapter at its trained scale; leave "
                        "scale at 1",
                    )
                )
        for index, stage in enumerate(self.stages):
            if stage.max_loras is not None:
                why = self.adapter_stage_issue(stage)
                if why is not None:
                    issues.append(
                        (f"stages[{index}].maxLoras", f"this stage takes no adapters: {why}")
                    )
            if stage.max_lora_rank is not None and not self.adapter_capacity(stage):
                issues.append(
                    (
                        f"stages[{index}].maxLoraRank",
                        "the stage takes no adapters: declare one under adapters, or set maxLoras",
                    )
                )
        return issues

    def adapter_capacity(self, stage: StageConfig) -> int:
        """How many adapters a replica of ``stage`` holds loaded: 0 where it takes none."""
        if self.adapter_stage_issue(stage) is not None:
            return 0
        if stage.max_loras is not None:
            return stage.max_loras
        declared = any(adapter.stage == stage.name for adapter in self.adapters or ())
        return DEFAULT_MAX_LORAS if declared else 0

    @property
    def served_model_name(self) -> str:
        """The model name clients send: the router's setting, else the model's last path
        part."""
        if self.router.served_model_name:
            return self.router.served_model_name
        return self.model.rstrip("/").rsplit("/", 1)[-1] or self.model

    def _gpu_memory_issues(self) -> list[tuple[str, str]]:
        """One issue per GPU id whose stages' shares of its memory sum past 1 (see
        stages.VLLM_DEFAULT_GPU_MEMORY_UTILIZATION for what an unset share counts as)."""
        on_gpu: dict[int, list[int]] = {}
        for index, stage in enumerate(self.stages):
            for gpu in stage.gpu_ids:
                on_gpu.setdefault(gpu, []).append(index)
        issues: list[tuple[str, str]] = []
        for gpu, indices in sorted(on_gpu.items()):
            total = sum(self.stages[i].gpu_share or 0.0 for i in indices)
            if total <= 1 + GPU_SHARE_EPSILON:
                continue
            shares = ", ".join(
                f"{self.stages[i].name} (stages[{i}]) {_describe_share(self.stages[i])}"
                for i in indices
            )
            issues.append(
                (
                    "stages",
                    f"GPU {gpu} is over-subscribed: the gpuMemoryUtilization of the stages on "
                    f"it sum to {total:.4g}, more than 1 ({shares}); lower them so that they "
                    "sum to at most 1",
                )
            )
        return issues

    @property
    def family_recipe(self) -> Family | None:
        """The pipeline's model family (``omni_runtime.families``), if it names one."""
        return FAMILIES.get(self.family) if self.family is not None else None

    @property
    def video_recipe(self) -> VideoRecipe | None:
        """How the pipeline's clips play, where its family's DiT makes videos."""
        family = self.family_recipe
        return family.dit.video if family is not None else None

    @property
    def step_cache_tiers(self) -> tuple[str, ...]:
        """The step-cache tiers a request may name (its DiT's, off first); () where its DiT
        declares none."""
        for stage in self.stages:
            if stage.step_cache is not None and stage.type == "diffusion":
                return stage.step_cache.tier_names
        return ()

    def encoder_recipe(self, stage: StageConfig) -> EncoderRecipe | None:
        """How ``stage`` encodes for the DiT after it, if it is its family's encoder."""
        family = self.family_recipe
        return family.encoder if family is not None and family.is_encoder(stage) else None

    @property
    def graph(self) -> StageGraph:
        """The stages as the pipeline's family connects them (``families.graph``); a
        pipeline of no family: one chain, each LLM stage that outputs hidden states handing
        them to the next, any other writing its prompt."""
        family = self.family_recipe
        if family is not None:
            return family.graph(self.stages, self.async_chunk)
        return chain_graph(self.stages, "image", outputs_hidden_states)

    def speech_stage(self, stage: StageConfig) -> SpeechStage | None:
        """The part ``stage`` plays where the pipeline's family speaks (its thinker or its
        talker); None otherwise."""
        family = self.family_recipe
        return family.speech_stage(stage, self.stages) if family is not None else None

    def output_connector(self, stage_id: int) -> str | None:
        """The connector stage ``stage_id`` hands its output to the next stage with: what
        that stage's inputConnectors name for the edge (None: no stage reads from it)."""
        for stage in sorted(self.stages, key=lambda s: s.stage_id):
            name = stage.input_stages.get(stage_id)
            if name is not None:
                return name
        return None

    def stage_model(self, stage: StageConfig) -> str:
        """The model ``stage`` loads: its own, else the pipeline's."""
        return stage.model or self.model

    def stage(self, stage_id: int) -> StageConfig:
        """The stage with ``stage_id``; KeyError if there is none."""
        for stage in self.stages:
            if stage.stage_id == stage_id:
                return stage
        raise KeyError(stage_id)


def _describe_share(stage: StageConfig) -> str:
    """``stage``'s share of a GPU as an over-subscription message names it."""
    if stage.gpu_memory_utilization is not None:
        return f"{stage.gpu_memory_utilization:g}"
    if stage.gpu_share is not None:
        return f"unset: vLLM's default {stage.gpu_share:g}"
    return "unset: an uncapped diffusion stage, not counted"
