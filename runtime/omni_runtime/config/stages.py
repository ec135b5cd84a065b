"""One stage of a pipeline, where its server listens, and what its GPUs hold."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from .base import SchemaModel
from .errors import PipelineConfigError
from .names import is_dns_label
from .step_cache import StepCacheConfig
from .topologies import STAGE_TYPES, StageType

LLMOutput = Literal["text", "hidden_states"]
Dtype = Literal["auto", "float32", "float16", "bfloat16", "half", "float"]

# Strict, so that YAML's `true` is not taken for the count 1.
PositiveInt = Annotated[StrictInt, Field(gt=0)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]

CPU = "cpu"
_GPU_ID = re.compile(r"[0-9]+")
_FROM_STAGE = re.compile(r"from_stage_(0|[1-9][0-9]*)")
_DEVICES_ALLOWED = "'cpu', '' (same as cpu), or comma-separated GPU ids such as '0' or '0,1'"

# GPU memory admission. Stages whose devices share a GPU id run on that GPU together, so
# their shares of its memory (gpuMemoryUtilization, a fraction of the whole GPU) must fit
# in it. A share left unset counts as what that stage will really take, rather than being
# an error (which would refuse the seed's BAGEL config, whose DiT declares none) or being
# ignored (which would admit two unset LLM stages on one GPU, which can never both start):
# - an llm stage: vLLM's own default (vllm.config.CacheConfig; 0.92 in vLLM 0.32, which a
#   unit test keeps in step), since vLLM reserves that much at start and refuses to start
#   when less is free.
# - a diffusion stage: nothing. Without a share its process is not capped and takes what
#   the others leave, as the seed's BAGEL deploy config (thinker at 0.45, DiT unset on the
#   same GPU) relies on; with one, the engine caps its process at that fraction.
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
# Float sums of shares that fit exactly (0.1 + 0.2 + 0.7) can land a hair above 1.
GPU_SHARE_EPSILON = 1e-9


# Where a stage server listens unless told otherwise: STAGE_PORT_BASE + its stage id, on a
# port named stage-<id>. The operator's Services, `omni-runtime stage` and the router's
# discovery all meet on it, and a port ends at 65535, which bounds the ids.
STAGE_PORT_BASE = 52000
MAX_STAGE_ID = 65535 - STAGE_PORT_BASE


def stage_port(stage_id: int) -> int:
    """The port a stage's server listens on by default."""
    return STAGE_PORT_BASE + stage_id


def stage_port_name(stage_id: int) -> str:
    """The name of a stage's port in Services and EndpointSlices."""
    return f"stage-{stage_id}"


# The stage fields that are vLLM engine arguments of the same name (what an LLM stage passes
# on to vLLM); engineArgs must not set them a second way.
ENGINE_ARG_FIELDS = (
    "tensor_parallel_size",
    "data_parallel_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "gpu_memory_utilization",
    "dtype",
    "trust_remote_code",
    "enable_prefix_caching",
    "enforce_eager",
    "max_loras",
    "max_lora_rank",
)
# How many adapters a stage that takes them holds loaded per replica unless maxLoras says.
DEFAULT_MAX_LORAS = 4
# vLLM's max_lora_rank values (vllm.config.lora.MaxLoRARanks) and its default.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_MAX_LORA_RANK = 16


class StageConfig(SchemaModel):
    """One stage of a pipeline: an LLM on vLLM or a diffusion transformer on diffusers."""

    stage_id: NonNegativeInt = Field(
        description="The stage's id, unique in the pipeline; a stage takes input only from "
        "stages with lower ids."
    )
    name: str = Field(
        description="A DNS label naming the stage's pods and Services; defaults to the "
        "topology's name, else stage-<stageId>."
    )
    type: StageType = Field(
        description="llm (vLLM) or diffusion (diffusers); defaults to the model's known "
        "topology, if any."
    )
    output: LLMOutput | None = Field(
        default=None,
        validate_default=True,
        description="LLM stages only: generate text, or encode hidden states for the next "
        "stage. Defaults to text.",
    )
    # None, not False, when unset: a pipeline that does not name it keeps its revision.
    think: bool | None = Field(
        default=None,
        description="A BAGEL thinker only: BAGEL's think mode. The thinker writes a plan "
        "(greedy, at most defaultSamplingParams.max_tokens tokens, 1000 if unset) after the "
        "prompt, under BAGEL's planning system prompt, and the image is generated from the "
        "context that holds it.",
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        description="This stage's own model (path or hub id), for pipelines whose stages "
        "load different checkpoints; defaults to the pipeline's model.",
    )
    replicas: NonNegativeInt = Field(
        default=1,
        description="Copies of the stage; stages sharing a GPU (one placement group) must "
        "have equal replicas.",
    )
    devices: str = Field(
        default=CPU,
        description="'cpu' (or '') or comma-separated GPU ids such as '0' or '0,1'. Stages "
        "whose devices share a GPU id run in one pod (a placement group).",
    )
    tensor_parallel_size: PositiveInt = Field(
        default=1, description="GPUs one replica's model is split over (vLLM tensor parallel)."
    )
    data_parallel_size: PositiveInt = Field(
        default=1, description="vLLM data-parallel engine ranks per replica."
    )
    max_num_batched_tokens: PositiveInt | None = Field(
        default=None, description="Most tokens in one engine step; the engine's default if unset."
    )
    max_num_seqs: PositiveInt | None = Field(
        default=None,
        description="Most requests in one batch: vLLM's for an llm stage (its default if "
        "unset); for a diffusion stage, the most requests one pipeline call runs together "
        "(1 if unset: each alone).",
    )
    max_model_len: PositiveInt | None = Field(
        default=None, description="Context length; the model's own if unset."
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        description="Fraction of each of its GPUs' memory the stage may use, in (0, 1]: "
        "vLLM's gpu_memory_utilization for an llm stage (vLLM's default, "
        f"{VLLM_DEFAULT_GPU_MEMORY_UTILIZATION:g}, if unset); "
        "the cap on a diffusion stage's process (uncapped if unset). The shares of the "
        "stages sharing a GPU id must sum to at most 1; an unset diffusion stage is not "
        "counted, as it takes what the others leave.",
        json_schema_extra={"exclusiveMinimum": 0, "maximum": 1},
    )
    dtype: Dtype | None = Field(
        default=None, description="Weight and activation dtype; auto: the checkpoint's."
    )
    trust_remote_code: bool = Field(
        default=False, description="Run the model repository's own code (Hugging Face)."
    )
    enable_prefix_caching: bool | None = Field(
        default=None, description="Reuse the KV cache of shared prompt prefixes."
    )
    enforce_eager: bool | None = Field(
        default=None, description="Run eagerly, without CUDA graphs (less memory, slower)."
    )
    step_cache: StepCacheConfig | None = Field(
        default=None,
        description="Diffusion stages of a family whose DiT takes one: tiers of step "
        "caching (diffusers' TaylorSeer), chosen per request by its step_cache field; "
        "unset: every step computed.",
    )
    # None rather than False when unset: the rendered config (and its hash, which rolls the
    # stage's pods) stays what it was for pipelines that do not set it.
    torch_compile: bool | None = Field(
        default=None,
        description="Diffusion stages of a diffusers pipeline: compile the DiT's repeated "
        "transformer blocks with torch.compile (regional compilation). The first request "
        "of each new shape (size, batch, guidance) waits for its compilation; the images "
        "are the eager ones (identical bytes on CPU).",
    )
    num_threads: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Diffusion stages: torch's intra-op threads (unset: torch's default, one "
        "per core). On a CPU shared with LLM stages, whose vLLM binds its threads to cores "
        "of its own, give the diffusion stage no more than the cores left: a computation "
        "spread over a busy core waits on its slowest thread.",
    )
    default_sampling_params: dict[str, Any] = Field(
        default_factory=dict,
        description="Sampling parameters for requests that give none (temperature, top_p, "
        "max_tokens, seed, ...), as written.",
    )
    input_connectors: dict[str, str] = Field(
        default_factory=dict,
        description="Where this stage's input comes from: from_stage_<id> (a stage with a "
        "lower id) -> the name of a connector in connectors.",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Further engine arguments, passed through as given; not those the stage "
        "has fields for (maxNumSeqs, dtype, ...).",
    )
    max_loras: Annotated[StrictInt, Field(ge=1, le=64)] | None = Field(
        default=None,
        description="LoRA adapters one replica holds loaded at once (least recently used "
        "evicted). Setting it lets the stage take adapters added at run time "
        "(/v1/load_lora_adapter) even where adapters declares none for it; unset: "
        f"{DEFAULT_MAX_LORAS} where adapters names the stage, else the stage takes none.",
    )
    max_lora_rank: int | None = Field(
        default=None,
        description="LLM stages that take adapters: the highest adapter rank they load "
        f"(vLLM's max_lora_rank: one of {', '.join(map(str, VLLM_LORA_RANKS))}); unset: "
        f"{DEFAULT_MAX_LORA_RANK}.",
        json_schema_extra={"enum": list(VLLM_LORA_RANKS)},
    )

    missing_hints = {
        "stage_id": "a non-negative integer, unique in the pipeline",
        "name": "a name (it defaults to stage-<stageId> once stageId is set)",
        "type": "no known topology for this model gives this stage a type; set type to one of: "
        + ", ".join(STAGE_TYPES),
    }

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or "name" in data:
            return data
        stage_id = data.get("stageId", data.get("stage_id"))
        if stage_id is None:
            return data
        if type(stage_id) is int:
            return {**data, "name": f"stage-{stage_id}"}
        # stageId will be refused; a placeholder keeps that the only error reported.
        return {**data, "name": "stage"}

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        # Stage names end up in Kubernetes object names and labels.
        if not is_dns_label(value):
            raise ValueError(
                f"{value!r} is not a valid name: use at most 63 lower-case letters, digits "
                "and '-', starting and ending with a letter or digit (e.g. thinker, stage-0)"
            )
        return value

    @field_validator("output")
    @classmethod
    def _check_output(cls, value: LLMOutput | None, info: ValidationInfo) -> LLMOutput | None:
        stage_type = info.data.get("type")
        if stage_type == "llm":
            return value or "text"
        if stage_type == "diffusion" and value is not None:
            raise ValueError(
                "only llm stages have an output kind (text or hidden_states); "
                "remove output from this diffusion stage"
            )
        return value

    @field_validator("step_cache")
    @classmethod
    def _check_step_cache(
        cls, value: StepCacheConfig | None, info: ValidationInfo
    ) -> StepCacheConfig | None:
        if value is not None and info.data.get("type") == "llm":
            raise ValueError(
                "only diffusion stages cache steps; remove stepCache from this llm stage"
            )
        return value

    @field_validator("num_threads")
    @classmethod
    def _check_num_threads(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("type") == "llm":
            raise ValueError(
                "only diffusion stages take numThreads (vLLM places an llm stage's threads "
                "itself: VLLM_CPU_OMP_THREADS_BIND); remove it from this llm stage"
            )
        return value

    @field_validator("torch_compile")
    @classmethod
    def _check_torch_compile(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("type") == "llm":
            raise ValueError(
                "only diffusion stages take torchCompile (vLLM compiles an llm stage on its "
                "own: see enforceEager); remove it from this llm stage"
            )
        return value

    @field_validator("max_lora_rank")
    @classmethod
    def _check_max_lora_rank(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None:
            return value
        if info.data.get("type") == "diffusion":
            raise ValueError(
                "only llm stages take maxLoraRank (vLLM sizes its adapter slots by it; a "
                "diffusion stage loads any rank); remove it from this diffusion stage"
            )
        if value not in VLLM_LORA_RANKS:
            raise ValueError(
                f"{value} is not one of vLLM's ranks: {', '.join(map(str, VLLM_LORA_RANKS))}"
            )
        return value

    @field_validator("devices", mode="before")
    @classmethod
    def _normalise_devices(cls, value: object) -> str:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            value = str(value)
        if not isinstance(value, str):
            raise ValueError(f"expected {_DEVICES_ALLOWED}; got {value!r}")
        text = value.strip().lower()
        if text in ("", CPU):
            return CPU
        parts = [part.strip() for part in text.split(",")]
        if not all(_GPU_ID.fullmatch(part) for part in parts):
            raise ValueError(f"expected {_DEVICES_ALLOWED}; got {value!r}")
        ids = [int(part) for part in parts]
        repeated = sorted({gpu for gpu in ids if ids.count(gpu) > 1})
        if repeated:
            raise ValueError(
                f"GPU id {', '.join(map(str, repeated))} listed more than once in {value!r}; "
                "list each GPU once"
            )
        return ",".join(map(str, ids))

    @field_validator("gpu_memory_utilization", mode="before")
    @classmethod
    def _check_gpu_memory_utilization(cls, value: object) -> object:
        allowed = "a fraction of GPU memory in (0, 1], e.g. 0.9"
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"expected {allowed}; got {value!r}")
        if not 0 < value <= 1:
            raise ValueError(f"expected {allowed}; got {value!r}")
        return float(value)

    @field_validator("input_connectors")
    @classmethod
    def _check_input_connectors(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        own_id = info.data.get("stage_id")
        issues: list[tuple[str, str]] = []
        for key in value:
            match = _FROM_STAGE.fullmatch(key)
            if match is None:
                issues.append((key, "keys must have the form from_stage_<id>, e.g. from_stage_0"))
            elif own_id is not None and int(match.group(1)) >= own_id:
                which = "itself" if int(match.group(1)) == own_id else "a later stage"
                issues.append(
                    (
                        key,
                        f"stage {own_id} can only take input from a stage with a lower id, "
                        f"not from {which}",
                    )
                )
        if issues:
            raise PipelineConfigError(issues)
        return value

    @field_validator("engine_args")
    @classmethod
    def _check_engine_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        issues: list[tuple[str, str]] = []
        for key in ("enable_lora", "enableLora"):
            if key in value:
                issues.append(
                    (
                        key,
                        "declare the stage's adapters under adapters, or set maxLoras on "
                        "the stage: either turns vLLM's LoRA on",
                    )
                )
        for name in ENGINE_ARG_FIELDS:
            alias = to_camel(name)
            for key in (name, alias):
                if key in value:
                    issues.append((key, f"set {alias} on the stage itself, not in engineArgs"))
        if issues:
            raise PipelineConfigError(issues)
        return value

    @property
    def gpu_ids(self) -> tuple[int, ...]:
        """The GPU ids in ``devices``, in order; empty for a CPU stage."""
        if self.devices == CPU:
            return ()
        return tuple(int(part) for part in self.devices.split(","))

    @property
    def gpu_share(self) -> float | None:
        """The fraction of each of its GPUs' memory this stage counts for when stages share
        a GPU: its own gpuMemoryUtilization, else vLLM's default for an llm stage; None
        for a diffusion stage without one (uncapped, it takes what the others leave), and
        for a CPU stage, which has no GPU to share."""
        if not self.gpu_ids:
            return None
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return VLLM_DEFAULT_GPU_MEMORY_UTILIZATION if self.type == "llm" else None

    @property
    def input_stages(self) -> dict[int, str]:
        """Upstream stage id -> connector name, from ``input_connectors``."""
        return {
            int(key.removeprefix("from_stage_")): connector
            for key, connector in self.input_connectors.items()
        }
