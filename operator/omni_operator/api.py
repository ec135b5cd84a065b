"""The OmniPipeline API: what `kubectl apply` takes and what the operator reports back.

The spec is the runtime's pipeline schema (``omni_runtime.config``) plus where things run:
per stage a ``placement`` (image, resources, nodeSelector, tolerations, affinity, env), and
for the router its replicas, Service type and placement. ``runtime_config`` drops the
Kubernetes-only fields again, giving exactly the pipeline the stage and router processes
load from the rendered ConfigMap.

The CRD's schema (crds/omnipipelines.yaml) is generated from these models by
``python -m omni_operator.crd``; a field's description here is what ``kubectl explain``
shows.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    PlainValidator,
    StrictInt,
    WithJsonSchema,
    model_validator,
)

from omni_runtime.config import PipelineConfig, RouterConfig, StageConfig
from omni_runtime.config.base import CAMEL_CASE_CONFIG
from omni_runtime.config.loader import strip_kubernetes_fields
from omni_runtime.pod_contract import API_GROUP

GROUP = API_GROUP
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "OmniPipeline"
PLURAL = "omnipipelines"
SINGULAR = "omnipipeline"
SHORT_NAMES = ("omnip",)

# What pods run when neither the pipeline nor the stage names an image: the runtime's CPU
# build, and its CUDA build for pods with GPUs. The operator's Deployment may override them
# with $OMNI_RUNTIME_IMAGE and $OMNI_RUNTIME_CUDA_IMAGE (see handlers.py).
DEFAULT_RUNTIME_IMAGE = "omni-operator/omni-runtime:0.1.0"
DEFAULT_RUNTIME_CUDA_IMAGE = "omni-operator/omni-runtime:0.1.0-cuda"

PullPolicy = Literal["Always", "IfNotPresent", "Never"]
ServiceType = Literal["ClusterIP", "NodePort", "LoadBalancer"]
Phase = Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"]
ConditionType = Literal["Ready", "Progressing", "Degraded", "SpecValid"]
ConditionStatus = Literal["True", "False", "Unknown"]

# A Kubernetes quantity ("500m", "4Gi", 2), in the apiserver's own grammar: a decimal
# number and a binary (Ki..Ei), decimal (n..E) or exponent suffix. The CRD carries the
# pattern too, so `kubectl apply` refuses "lots" before a Deployment would.
QUANTITY_NUMBER = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
QUANTITY_SUFFIX = r"(?:[KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?"
QUANTITY_PATTERN = f"^{QUANTITY_NUMBER}{QUANTITY_SUFFIX}$"
_QUANTITY = re.compile(QUANTITY_PATTERN)


def _check_quantity(value: object) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _QUANTITY.match(value):
        return value
    raise ValueError(
        f"{value!r} is not a Kubernetes quantity: a number with an optional suffix, "
        "e.g. 500m, 4, 1.5Gi, 16G"
    )


Quantity = Annotated[
    int | str,
    PlainValidator(_check_quantity),
    WithJsonSchema(
        {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": QUANTITY_PATTERN}]}
    ),
]

_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"


class _ApiModel(BaseModel):
    model_config = CAMEL_CASE_CONFIG


class EnvVar(_ApiModel):
    """An environment variable of the container."""

    name: str = Field(pattern=_ENV_NAME, description="The variable's name, e.g. HF_HOME.")
    value: str | None = Field(default=None, description="A literal value.")
    value_from: dict[str, Any] | None = Field(
        default=None,
        description="A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, "
        "resourceFieldRef), as in a Pod spec.",
    )


class Toleration(_ApiModel):
    """A Kubernetes toleration, as in a Pod spec."""

    key: str | None = Field(default=None, description="The taint key; empty with Exists: all.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (the default)."
    )
    value: str | None = Field(default=None, description="The taint value, with Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="The taint effect to tolerate; empty: all."
    )
    toleration_seconds: StrictInt | None = Field(
        default=None, description="With NoExecute: how long the pod stays after the taint."
    )


class Resources(_ApiModel):
    """CPU, memory and other requests and limits of a container."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="Minimum resources, e.g. {cpu: '4', memory: 32Gi}."
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict,
        description="Maximum resources. nvidia.com/gpu is set by the operator from the "
        "stages' devices and must not be given here.",
    )


class VolumeMount(_ApiModel):
    """Where a volume of the placement's volumes appears in the container."""

    name: str = Field(min_length=1, description="The volume's name, from volumes.")
    mount_path: str = Field(pattern=r"^/", description="An absolute path in the container.")
    read_only: bool = Field(default=False, description="Mount read-only.")
    sub_path: str | None = Field(default=None, description="A path inside the volume.")


class Placement(_ApiModel):
    """Where and how a component's pods run. Stages of one placement group share a pod:
    their images must agree, and their other settings are merged."""

    image: str | None = Field(
        default=None, min_length=1, description="Container image; defaults to spec.image."
    )
    image_pull_policy: PullPolicy | None = Field(
        default=None, description="Always, IfNotPresent or Never; defaults to spec's."
    )
    resources: Resources = Field(
        default_factory=Resources, description="Requests and limits (summed over a group)."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pod must match."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints the pod tolerates."
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="A Kubernetes Affinity (nodeAffinity, podAffinity, podAntiAffinity), as "
        "in a Pod spec.",
    )
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables.")
    volumes: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Extra pod volumes (Kubernetes Volume objects), e.g. a PVC holding models.",
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, description="Where the volumes appear in the container."
    )


ScalingMode = Literal["planner", "external"]
PERCENTILES = (50, 90, 95, 99)
# Longest stabilisation window: an hour (the HPA's own limit).
MAX_WINDOW_SECONDS = 3600


class LatencyObjective(_ApiModel):
    """A percentile of the time requests spend in the stage (its queue and its work), as
    the routers measure it."""

    percentile: Literal[50, 90, 95, 99] = Field(
        default=90, description="50, 90, 95 or 99: which percentile of time in stage."
    )
    seconds: float = Field(
        gt=0, le=3600, description="The most that percentile may be, in seconds, e.g. 2.5."
    )


class StageAutoscaling(_ApiModel):
    """How the operator sizes this stage's replicas. Stages of one placement group (one
    pod) scale together: their autoscaling must be equal."""

    mode: ScalingMode = Field(
        default="planner",
        description="planner: the operator's planner sets the replicas from the load its "
        "routers report, within min/max. external: another autoscaler (KEDA, an HPA) sets "
        "them, and the operator leaves the Deployment's replicas alone; it takes no other "
        "field.",
    )
    min_replicas: Annotated[StrictInt, Field(ge=1, le=1000)] | None = Field(
        default=None, description="Fewest replicas (planner; default 1)."
    )
    max_replicas: Annotated[StrictInt, Field(ge=1, le=1000)] | None = Field(
        default=None, description="Most replicas (planner; required)."
    )
    target_in_flight: float | None = Field(
        default=None,
        gt=0,
        le=100000,
        description="Requests one replica should hold at once, queued and running (planner). "
        "The planner sizes the stage for its arrival rate times its time in stage (Little's "
        "law), and never below the requests in it now. Default 1 unless latencyObjective is "
        "set; with both, the larger need wins.",
    )
    latency_objective: LatencyObjective | None = Field(
        default=None,
        description="Scale so that this percentile of time in stage stays at the objective "
        "(planner): replicas grow or shrink with the ratio of the observed percentile to the "
        "objective, as an HPA does, within a 10% tolerance.",
    )
    scale_up_window_seconds: Annotated[StrictInt, Field(ge=0, le=MAX_WINDOW_SECONDS)] | None = (
        Field(
            default=None,
            description="Scale up only to the smallest need seen over this many seconds "
            "(planner; default 0: at once).",
        )
    )
    scale_down_window_seconds: Annotated[StrictInt, Field(ge=0, le=MAX_WINDOW_SECONDS)] | None = (
        Field(
            default=None,
            description="Scale down only to the largest need seen over this many seconds "
            "(planner; default 300), so that a lull within a burst keeps the replicas.",
        )
    )

    @model_validator(mode="after")
    def _check_mode(self) -> StageAutoscaling:
        if self.mode == "external":
            given = [name for name in _PLANNER_FIELDS if getattr(self, name) is not None]
            if given:
                fields = ", ".join(_camel(name) for name in given)
                raise ValueError(
                    f"mode external leaves replicas to another autoscaler, so {fields} "
                    "would do nothing; remove them, or use mode planner"
                )
            return self
        if self.max_replicas is None:
            raise ValueError("mode planner needs maxReplicas: the most replicas it may run")
        if self.max_replicas < (self.min_replicas or 1):
            raise ValueError(
                f"maxReplicas ({self.max_replicas}) is below minReplicas ({self.min_replicas or 1})"
            )
        return self


_PLANNER_FIELDS = (
    "min_replicas",
    "max_replicas",
    "target_in_flight",
    "latency_objective",
    "scale_up_window_seconds",
    "scale_down_window_seconds",
)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


class StageSpec(StageConfig):
    """One stage of the pipeline, and where its pods run."""

    placement: Placement = Field(
        default_factory=Placement, description="Where this stage's pods run."
    )
    autoscaling: StageAutoscaling | None = Field(
        default=None,
        description="Size the stage from its load instead of replicas (which then only "
        "gives the count to start with), or leave its replicas to another autoscaler.",
    )


class SecretKeyRef(_ApiModel):
    """One key of a Secret in the pipeline's namespace."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="The Secret's name.",
    )
    key: str = Field(
        default="api-key",
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="The key in the Secret's data; its value holds one API key per line.",
    )


class PasswordSecretRef(SecretKeyRef):
    """One key of a Secret in the pipeline's namespace, holding a password."""

    key: str = Field(
        default="password",
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="The key in the Secret's data; its value is the password.",
    )


# The Redis image a managed video store runs unless the pipeline names another: Redis 7.2,
# the last release under the BSD licence; any Redis from 6.2 (or Valkey) whose image has
# redis-server on its PATH serves.
DEFAULT_VIDEO_STORE_IMAGE = "redis:7.2-bookworm"


class VideoStoreSpec(_ApiModel):
    """A Redis the operator runs for the pipeline's video jobs: one pod, a Service only the
    router pods may reach, and a password it makes once and keeps in a Secret of its own."""

    image: str = Field(
        default=DEFAULT_VIDEO_STORE_IMAGE,
        min_length=1,
        description="The Redis image; it must have redis-server on its PATH.",
    )
    image_pull_policy: PullPolicy | None = Field(
        default=None, description="Always, IfNotPresent or Never; defaults to spec's."
    )
    memory: Quantity = Field(
        default="1Gi",
        description="The pod's memory (request and limit). Redis holds at most three "
        "quarters of it (maxmemory; the rest is its own overhead) and then refuses new jobs "
        "(503) until finished ones expire: size it for the videos kept for "
        "contentTtlSeconds.",
    )
    cpu: Quantity = Field(default="250m", description="The pod's CPU request.")
    persistent_volume_claim: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="A PersistentVolumeClaim in the pipeline's namespace where Redis keeps "
        "its append-only file, so that jobs and videos outlive its pod. Unset: an emptyDir, "
        "and the jobs go with the pod (the routers keep serving new ones).",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pod must match."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints the pod tolerates."
    )


class RouterSpec(RouterConfig):
    """The OpenAI-compatible HTTP router: the pipeline's endpoint."""

    replicas: Annotated[StrictInt, Field(ge=1, le=100)] = Field(
        default=1, description="Router pods behind the pipeline's Service."
    )
    service_type: ServiceType = Field(
        default="ClusterIP", description="Type of the pipeline's Service."
    )
    placement: Placement = Field(
        default_factory=Placement, description="Where the router's pods run."
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Clients must send one of the API keys in this Secret's key (one per "
        "line) as 'Authorization: Bearer <key>'. Mounted as a file that the router re-reads, "
        "so a key removed from the Secret is refused once the kubelet has updated the file "
        "(about a minute), without a restart. Unset: no key is needed.",
    )
    video_store: VideoStoreSpec | None = Field(
        default=None,
        description="A Redis the operator runs for the pipeline's video jobs, which every "
        "router replica shares (the Service P-video-store); set it, or name your own Redis "
        "in videos.storeUrl, to run several router replicas of a video pipeline.",
    )
    video_store_password_secret_ref: PasswordSecretRef | None = Field(
        default=None,
        description="The password of the Redis that videos.storeUrl names, from this "
        "Secret's key (given to the routers as an environment variable, never written in "
        "the pipeline's ConfigMap). Unset: the Redis asks for none.",
    )
    allowed_from: list[dict[str, Any]] | None = Field(
        default=None,
        min_length=1,
        description="Who may reach the router's port, as a NetworkPolicy's ingress 'from' "
        "peers (podSelector, namespaceSelector, ipBlock). Unset: the pods of the pipeline's "
        "namespace. Set it (an ipBlock, say) when the Service is exposed outside the cluster "
        "(NodePort, LoadBalancer). Enforced only where the cluster's network plugin enforces "
        "NetworkPolicies.",
    )


class OmniPipelineSpec(PipelineConfig):
    """A multi-stage pipeline and where it runs."""

    stages: list[StageSpec] = Field(  # type: ignore[assignment]
        min_length=1, description="The stages, each an LLM (vLLM) or a diffusion stage."
    )
    router: RouterSpec = Field(default_factory=RouterSpec, description="The HTTP router.")
    image: str | None = Field(
        default=None,
        min_length=1,
        description="The runtime image every pod runs unless its placement names another; "
        "defaults to the operator's $OMNI_RUNTIME_IMAGE.",
    )
    image_pull_policy: PullPolicy = Field(
        default="IfNotPresent", description="Always, IfNotPresent or Never."
    )


def runtime_config(spec: OmniPipelineSpec, video_store_url: str | None = None) -> PipelineConfig:
    """The runtime's pipeline for ``spec``: the same stages, without the placement; with
    ``video_store_url`` (where a managed video store's Service is) as the routers'
    ``videos.storeUrl`` when the spec asks for one."""
    dumped = strip_kubernetes_fields(spec.model_dump(mode="json", by_alias=True, exclude_none=True))
    if spec.router.video_store is not None and video_store_url is not None:
        dumped["router"].setdefault("videos", {})["storeUrl"] = video_store_url
    return PipelineConfig.model_validate(dumped)


class Condition(_ApiModel):
    """One aspect of the pipeline's state, as Kubernetes conditions are."""

    type: ConditionType = Field(description="Ready, Progressing, Degraded or SpecValid.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(description="A CamelCase reason, for machines.")
    message: str = Field(default="", description="What happened, for people.")
    last_transition_time: str | None = Field(
        default=None, description="When status last changed (RFC 3339)."
    )
    observed_generation: StrictInt | None = Field(
        default=None, description="The spec generation this condition was computed from."
    )


class StageScalingStatus(_ApiModel):
    """What the autoscaling of a stage decided last, and why."""

    mode: ScalingMode = Field(description="planner or external.")
    desired_replicas: StrictInt | None = Field(
        default=None, description="Replicas the planner wants (planner mode)."
    )
    reason: str = Field(default="", description="Why, with the figures it was computed from.")
    last_scale_time: str | None = Field(
        default=None, description="When the planner last changed the replicas (RFC 3339)."
    )


class StageStatus(_ApiModel):
    """The pods of one stage."""

    name: str = Field(description="The stage's name.")
    stage_id: StrictInt = Field(description="The stage's id.")
    placement_group: str = Field(description="The placement group (Deployment) it runs in.")
    replicas: StrictInt = Field(default=0, description="Pods wanted.")
    ready_replicas: StrictInt = Field(default=0, description="Pods ready to serve.")
    updated_replicas: StrictInt = Field(default=0, description="Pods of the current spec.")
    autoscaling: StageScalingStatus | None = Field(
        default=None, description="The autoscaling's last decision, if the stage has one."
    )


class RouterStatus(_ApiModel):
    """The router's pods."""

    replicas: StrictInt = Field(default=0, description="Pods wanted.")
    ready_replicas: StrictInt = Field(default=0, description="Pods ready to serve.")
    ready: bool = Field(default=False, description="At least one router pod is ready.")


class OmniPipelineStatus(_ApiModel):
    """What the operator observed of the pipeline."""

    phase: Phase = Field(
        default="Pending", description="Pending, Progressing, Ready, Degraded or Failed."
    )
    observed_generation: StrictInt | None = Field(
        default=None, description="The spec generation this status describes."
    )
    ready: str = Field(default="0/0", description="Ready stages / stages, e.g. 2/2.")
    endpoint: str | None = Field(
        default=None, description="The in-cluster URL: http://<name>.<namespace>.svc:<port>."
    )
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Progressing, Degraded and SpecValid."
    )
    stages: list[StageStatus] = Field(default_factory=list, description="Per stage counts.")
    router: RouterStatus | None = Field(default=None, description="The router's pods.")
