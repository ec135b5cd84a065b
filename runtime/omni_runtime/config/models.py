"""Pydantic models of a pipeline: what the runtime runs and the operator deploys.

Fields are snake_case in Python and camelCase on the wire (the Kubernetes spelling, and what
``dump_pipeline`` writes); input may use either spelling, so the engine's snake_case deploy
YAML loads as it is. Free-form dicts (sampling params, engine args, connector extras) keep
their keys exactly as written.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from omni_runtime.adapters import (
    ADAPTER_NAME_PATTERN,
    ADAPTER_NAME_RULE,
    source_issue,
)
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

from .errors import PipelineConfigError
from .names import is_dns_label
from .topologies import STAGE_TYPES, StageType

LLMOutput = Literal["text", "hidden_states"]
Dtype = Literal["auto", "float32", "float16", "bfloat16", "half", "float"]
RouterPolicy = Literal[
    "round-robin", "least-outstanding-requests", "least-outstanding-work", "sticky"
]

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


# snake_case in Python, camelCase on the wire, either accepted; unknown fields refused. The
# operator's API models (omni_operator.api) share it.
CAMEL_CASE_CONFIG = ConfigDict(
    alias_generator=to_camel,
    validate_by_name=True,
    validate_by_alias=True,
    serialize_by_alias=True,
    extra="forbid",
)


class _Model(BaseModel):
    model_config = CAMEL_CASE_CONFIG

    # Per-field text for "required" errors: what to set, and why it could not be defaulted.
    missing_hints: ClassVar[dict[str, str]] = {}


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


# Connector classes a pipeline's ``connectors.<name>.name`` may give (omni_runtime.connectors
# implements them; the schema lists them so that a typo is refused before anything starts).
KNOWN_CONNECTORS = (
    "SharedMemoryConnector",
    "TCPConnector",
    "TcpConnector",
    "MooncakeTransferEngineConnector",
)
SHARED_MEMORY_CONNECTOR = "SharedMemoryConnector"


class ConnectorConfig(_Model):
    """A connector that carries one stage's output to a later stage."""

    name: str = Field(
        min_length=1,
        description="Connector class: SharedMemoryConnector (stages in one pod), "
        "TCPConnector, or MooncakeTransferEngineConnector (RDMA).",
        json_schema_extra={"enum": list(KNOWN_CONNECTORS)},
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="Connector-specific options.")

    missing_hints = {"name": "the connector class, e.g. SharedMemoryConnector"}

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if value not in KNOWN_CONNECTORS:
            raise ValueError(
                f"unknown connector class {value!r}; known: {', '.join(KNOWN_CONNECTORS)}"
            )
        return value


# Where a router finds the video store's password: never in the pipeline's config, which
# a ConfigMap holds.
VIDEO_STORE_PASSWORD_ENV = "OMNI_VIDEO_STORE_PASSWORD"


class VideoJobsConfig(_Model):
    """The Videos API's jobs, for a pipeline whose DiT makes videos."""

    store_url: str | None = Field(
        default=None,
        description="redis:// or rediss:// URL of the Redis where the pipeline's router "
        "replicas share their jobs (the password comes from the router's environment, "
        f"{VIDEO_STORE_PASSWORD_ENV}, never the URL); unset: an embedded store (SQLite and "
        "files in the router's state directory) that one router replica uses alone.",
    )
    max_active_jobs: Annotated[StrictInt, Field(ge=1, le=1_000_000)] = Field(
        default=64,
        description="Jobs queued or running at once, over all router replicas; past it POST "
        "/v1/videos answers 429.",
    )
    jobs_per_router: Annotated[StrictInt, Field(ge=1, le=256)] = Field(
        default=2,
        description="Jobs one router replica runs at once; the rest wait, queued, for any replica.",
    )
    content_ttl_seconds: Annotated[StrictInt, Field(ge=60, le=30 * 86400)] = Field(
        default=3600,
        description="How long a finished job and its video are kept; then both are deleted.",
    )
    job_timeout_seconds: Annotated[StrictInt, Field(ge=10, le=86400)] = Field(
        default=3600, description="A job still running after this long fails (timeout)."
    )

    @field_validator("store_url")
    @classmethod
    def _check_store_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        url = urllib.parse.urlsplit(value)
        if url.scheme not in ("redis", "rediss") or not url.hostname:
            raise ValueError(
                f"{value!r} is not a Redis URL: use redis://HOST:PORT/DB or rediss://... (TLS)"
            )
        if url.password is not None:
            raise ValueError(
                "the URL holds a password, which would sit in the pipeline's ConfigMap; give "
                f"it to the router as {VIDEO_STORE_PASSWORD_ENV} instead"
            )
        return value


class RouterConfig(_Model):
    """The HTTP router in front of the stages."""

    port: Annotated[StrictInt, Field(ge=1, le=65535)] = Field(
        default=8000, description="The HTTP port the router listens on."
    )
    policy: RouterPolicy = Field(
        default="round-robin",
        description="How a request picks a stage replica: round-robin, "
        "least-outstanding-requests, least-outstanding-work (a diffusion request weighs "
        "its steps x pixels x images, each replica its own costs per request and per unit), or "
        "sticky (requests with the same user field go to the same replica).",
    )
    served_model_name: str | None = Field(
        default=None,
        min_length=1,
        description="The model name clients send (GET /v1/models lists it); defaults to "
        "the last part of the pipeline's model path.",
    )
    videos: VideoJobsConfig | None = Field(
        default=None,
        description="The Videos API's jobs (a pipeline whose DiT makes videos): their store, "
        "limits and how long a video is kept; unset: the defaults.",
    )
    # None, not False, when unset: a pipeline that does not name it keeps its revision.
    metrics_need_api_key: bool | None = Field(
        default=None,
        description="When the router has API keys, whether GET /metrics needs one too; by "
        "default (unset or false) it stays open to Prometheus scrapers, like the probes "
        "(/health, /livez).",
    )

    @field_validator("policy", mode="before")
    @classmethod
    def _accept_underscores(cls, value: object) -> object:
        # The rest of the deploy YAML is snake_case, so round_robin is an easy slip.
        return value.replace("_", "-") if isinstance(value, str) else value


# The tier every step-cached stage has: the DiT computes every step (exact).
STEP_CACHE_OFF = "off"
# A tier's name: what a request's step_cache field gives (the CRD checks it too).
STEP_CACHE_TIER_PATTERN = "^[a-z][a-z0-9-]{0,30}$"
_TIER_NAME = re.compile(STEP_CACHE_TIER_PATTERN)


class StepCacheTier(_Model):
    """One way of caching a DiT's steps (diffusers' TaylorSeer): after warmupSteps computed
    steps, the transformer computes one step in every interval and predicts the others from
    the last computed ones (a Taylor expansion of order maxOrder); the last cooldownSteps
    are computed again. Defaults: diffusers' own (its TaylorSeerCacheConfig)."""

    interval: Annotated[int, Field(ge=2, le=100)] = Field(
        default=5, description="Steps from one computed step to the next (2: every other)."
    )
    warmup_steps: Annotated[int, Field(ge=1, le=1000)] = Field(
        default=3, description="Steps computed before any is predicted."
    )
    cooldown_steps: Annotated[int, Field(ge=0, le=1000)] = Field(
        default=0, description="Last steps computed again (the image's fine detail)."
    )
    max_order: Annotated[int, Field(ge=0, le=2)] = Field(
        default=1,
        description="Order of the Taylor expansion that predicts a step (0: reuse the last "
        "computed one).",
    )


class StepCacheConfig(_Model):
    """A diffusion stage's step cache: named tiers a request picks with its step_cache field
    (off, every step computed, is always one), and the tier of requests that pick none."""

    tiers: dict[str, StepCacheTier] = Field(
        min_length=1,
        max_length=8,
        description="Tier name (lower-case letters, digits and '-'; not 'off') -> its settings.",
    )
    default: str = Field(
        default=STEP_CACHE_OFF,
        max_length=31,
        description="The tier of a request that names none: 'off' (exact) or one of tiers.",
    )

    @field_validator("tiers")
    @classmethod
    def _check_tiers(cls, value: dict[str, StepCacheTier]) -> dict[str, StepCacheTier]:
        for name in value:
            if name == STEP_CACHE_OFF or not _TIER_NAME.fullmatch(name):
                raise ValueError(
                    f"tier name {name!r}: use 1-31 lower-case letters, digits and '-', "
                    f"starting with a letter, and not {STEP_CACHE_OFF!r} (always a tier)"
                )
        return value

    @model_validator(mode="after")
    def _check_default(self) -> Self:
        if self.default != STEP_CACHE_OFF and self.default not in self.tiers:
            known = ", ".join([STEP_CACHE_OFF, *self.tiers])
            raise ValueError(f"default: {self.default!r} is not a tier; tiers: {known}")
        return self

    @property
    def tier_names(self) -> tuple[str, ...]:
        """What a request's step_cache may say: off, then the tiers."""
        return (STEP_CACHE_OFF, *self.tiers)


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
ADAPTER_NAME_PATTERN_RE = re.compile(ADAPTER_NAME_PATTERN)


class StageConfig(_Model):
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


class AdapterConfig(_Model):
    """A LoRA adapter of one stage, which a request picks by name (its model field)."""

    name: str = Field(
        description="What requests name it by: model '<servedModelName>:<name>' or '<name>' "
        f"(GET /v1/models lists it); {ADAPTER_NAME_RULE}, unique in the pipeline.",
        json_schema_extra={"pattern": ADAPTER_NAME_PATTERN, "maxLength": 64},
    )
    stage: str = Field(
        description="The name of the stage it applies to: an llm stage that generates text, "
        "or a diffusion stage run by diffusers (not BAGEL's DiT or Qwen3-Omni's stages)."
    )
    source: str = Field(
        min_length=1,
        description="Where its files are: an absolute path in the stage's pod (a directory "
        "with PEFT's adapter_config.json and adapter_model.safetensors; for a diffusion stage "
        "also one .safetensors file in diffusers' LoRA format), mounted from a "
        "PersistentVolumeClaim or an image volume; a hub id (org/name); or, for a diffusion "
        "stage, an https:// URL of one .safetensors file.",
    )
    scale: float = Field(
        default=1.0,
        ge=-8.0,
        le=8.0,
        description="Diffusion stages: how strongly it applies (diffusers' adapter weight), "
        "unless the request's lora_scale says; llm stages apply an adapter at its trained "
        "scale, so 1.",
    )

    missing_hints = {
        "name": "the adapter's name, which requests pick it by",
        "stage": "the name of the stage it applies to",
        "source": "a path in the stage's pod, a hub id, or an https:// URL",
    }

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not ADAPTER_NAME_PATTERN_RE.fullmatch(value):
            raise ValueError(f"{value!r} is not a valid adapter name: use {ADAPTER_NAME_RULE}")
        return value

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        issue = source_issue(value)
        if issue is not None:
            raise ValueError(issue)
        return value


class PipelineConfig(_Model):
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
        VLLM_DEFAULT_GPU_MEMORY_UTILIZATION for what an unset share counts as)."""
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
