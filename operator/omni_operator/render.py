"""The renderer: one OmniPipeline in, every child object it needs out. Pure: no I/O, no
clock, no environment; the same spec always gives the same objects, in the same order.

For a pipeline P in namespace N (all children in N, owned by P, labelled with it):

- ConfigMap ``P-config-<hash>``: ``pipeline.json``, the runtime's own pipeline (the spec
  less its placement), which every pod mounts read-only at /etc/omni. Its hash, as the pod
  templates' ``omni.dev/config-hash`` annotation, rolls every pod when the pipeline
  changes. Each configuration has a ConfigMap of its own (immutable), so that while a
  rollout runs each pod reads the configuration of the revision it advertises: with one
  ConfigMap changed in place, the kubelet rewrites the file under the old pods, and an old
  pod whose container restarts would start on the new config while it advertises the old
  revision. The one the live Deployments mount is pruned a converge later, not at once.
- Per placement group G (placement.py: stages that share a GPU share a pod):
  Deployment ``P-G``, whose pod runs ``omni-runtime stage`` for the group's stages in one
  container, with the group's GPUs and each stage's CUDA_VISIBLE_DEVICES within them; and a
  headless Service ``P-G``, one port per stage, whose EndpointSlices tell the router which
  replicas are ready.
- The router: ServiceAccount, Role (get/list/watch EndpointSlices, nothing else) and
  RoleBinding ``P-router``, so that it can follow the stages' replicas; Deployment
  ``P-router`` running ``omni-runtime router``; and Service ``P``, the pipeline's endpoint
  (``http://P.N.svc:<port>``).
- PodDisruptionBudget ``P-G`` / ``P-router`` (maxUnavailable 1) where a Deployment has more
  than one replica, so that a node drain leaves the others serving.

Decisions a reader would otherwise have to reverse-engineer:

- Environment: the operator's variables (HOME, HF_HOME, CUDA_VISIBLE_DEVICES or
  OMNI_CUDA_VISIBLE_DEVICES_<id>, OMNI_NAMESPACE) come first and a placement's ``env``
  after. A placement naming one of them is refused by ``placement.check_spec`` (SpecValid
  False, with the reason), never overridden silently; should an unchecked spec get here, the
  operator's value is kept and the placement's dropped.
- Resources of a group: per resource, requests are summed over its stages (a stage that
  gives only a limit requests its limit, as Kubernetes would), limits are summed (check_spec
  requires all of a group's stages or none to limit a resource). Quantities are summed
  exactly and written back canonical (``1536Mi``, ``1500m``); when one does not parse, the
  first stage's value is kept as written and the apiserver judges it.
- Rollouts: a GPU group replaces its pods one at a time without a surge (maxSurge 0,
  maxUnavailable 1), as a cluster has no spare GPUs for an extra pod; CPU groups and the
  router keep Kubernetes' default (25%/25%).
- Names longer than a DNS label (63), or not one, are cut and given a hash of the full name,
  so they stay unique; label values likewise.
- Revisions: every stage pod carries ``OMNI_PIPELINE_REVISION=<generation>-<config hash>``,
  which its stage servers advertise to routers so that a request never pairs stages of two
  configurations while a rollout mixes them, and routers prefer the newest complete one.
  Stage pods also carry the readiness gate ``omni.dev/revision-complete``
  (revision_gate.py): a new revision's pods become Ready only together, once every group
  has one whose containers are ready, so the old revision stays whole until then.
  ``generation`` is the caller's ``config_generation``: the pipeline's metadata.generation
  at which the config hash took its current value (not the current generation, which a
  scale change bumps too: with it in the template, scaling one stage would roll them all).
- Stopping pods (a rollout, a scale-down, ``kubectl delete pod``): every container has a
  ``preStop`` sleep of ``PRESTOP_DELAY_S`` (Kubernetes' own ``sleep`` action, 1.30+: no
  binary in the image is needed), during which the pod, already terminating, is taken out
  of its EndpointSlices and routers and kube-proxy stop sending to it while it still
  serves; then SIGTERM starts the runtime's drain, bounded by ``OMNI_DRAIN_TIMEOUT_S``
  (``DEFAULT_DRAIN_TIMEOUT_S``; a placement's ``env`` may set another).
  ``terminationGracePeriodSeconds`` is derived: the preStop delay, plus the drain timeout,
  plus ``GRACE_MARGIN_S`` for the cores to stop, so the drain is never cut by SIGKILL.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from omni_runtime.config import dump_pipeline, stage_port, stage_port_name
from omni_runtime.config.credentials import CLIENT_FILES, KEYS_DIR_ENV, SERVER_FILES
from omni_runtime.config.models import SHARED_MEMORY_CONNECTOR
from omni_runtime.pod_contract import (
    ANNOTATION_CONFIG_HASH,
    DEFAULT_DRAIN_TIMEOUT_S,
    DRAIN_TIMEOUT_ENV,
    HEALTH_PORT,
    NAMESPACE_ENV,
    REVISION_ENV,
    STAGE_CUDA_DEVICES_ENV_PREFIX,
    parse_drain_timeout,
)

from .api import (
    API_VERSION,
    KIND,
    QUANTITY_NUMBER,
    QUANTITY_SUFFIX,
    EnvVar,
    OmniPipelineSpec,
    Placement,
    Quantity,
    SecretKeyRef,
    runtime_config,
)
from .placement import (
    CONFIG_DIR,
    GPU_RESOURCE,
    HF_HOME_DIR,
    HOME_DIR,
    SHM_DIR,
    TMP_DIR,
    PlacementGroup,
    is_reserved_env,
    placement_groups,
)
from .revision_gate import READINESS_GATE

FIELD_MANAGER = "omni-operator"
# The field manager of the replicas of autoscaled Deployments (autoscaler.py), kept apart
# from FIELD_MANAGER so that applying the rest of a Deployment never moves them.
REPLICAS_FIELD_MANAGER = "omni-operator-autoscaler"
# The operator's own pods (manifests/base/deployment.yaml), let through to read /metrics.
OPERATOR_POD_LABEL = "app.kubernetes.io/name"
OPERATOR_POD_LABEL_VALUE = "omni-operator"
MANAGED_BY = "omni-operator"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_PIPELINE = "omni.dev/pipeline"
LABEL_COMPONENT = "omni.dev/component"
LABEL_GROUP = "omni.dev/placement-group"
LABEL_STAGES = "omni.dev/stages"
COMPONENT_CONFIG = "config"
COMPONENT_STAGES = "stages"
COMPONENT_ROUTER = "router"
COMPONENT_STAGE_KEYS = "stage-keys"

CONFIG_KEY = "pipeline.json"
CONFIG_FILE = f"{CONFIG_DIR}/{CONFIG_KEY}"
STAGE_CONTAINER = "stages"
ROUTER_CONTAINER = "router"
# The runtime images run as this user (Dockerfile.runtime: USER 65532:65532).
RUNTIME_UID = 65532
PRESTOP_DELAY_S = 5
GRACE_MARGIN_S = 10
# Where pods find their credentials (names in omni_runtime.config.credentials).
STAGE_KEYS_DIR = "/var/run/omni/stage-keys"
API_KEYS_DIR = "/var/run/omni/api-keys"
API_KEYS_FILE = "api-keys"
# Owner and group may read (the pod's fsGroup is the runtime's group); nobody may write.
_SECRET_FILE_MODE = 0o440
GPU_TOLERATION: dict[str, Any] = {
    "key": GPU_RESOURCE,
    "operator": "Exists",
    "effect": "NoSchedule",
}

_MAX_NAME = 63
_HASH_CHARS = 8
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


@dataclass(frozen=True)
class ChildKind:
    """A kind of object the operator creates for a pipeline, as its API lists them."""

    api_version: str
    kind: str
    plural: str


CHILD_KINDS: tuple[ChildKind, ...] = (
    ChildKind("v1", "ConfigMap", "configmaps"),
    ChildKind("v1", "Service", "services"),
    ChildKind("apps/v1", "Deployment", "deployments"),
    ChildKind("v1", "ServiceAccount", "serviceaccounts"),
    ChildKind("rbac.authorization.k8s.io/v1", "Role", "roles"),
    ChildKind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    ChildKind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    ChildKind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
)


# ---------------------------------------------------------------------------------- names


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_CHARS]


def object_name(*parts: str) -> str:
    """``parts`` joined by '-' as an RFC 1035 label (what a Service name must be): as is
    when it is one, else cleaned, cut, and suffixed with a hash of the full name."""
    full = "-".join(parts)
    if len(full) <= _MAX_NAME and _DNS_LABEL.fullmatch(full):
        return full
    cleaned = re.sub(r"[^a-z0-9-]+", "-", full.lower()).strip("-")
    if not cleaned[:1].isalpha():
        cleaned = f"p-{cleaned}".rstrip("-")
    head = cleaned[: _MAX_NAME - _HASH_CHARS - 1].rstrip("-")
    return f"{head}-{_short_hash(full)}"


def label_value(text: str) -> str:
    """``text`` as a label value (at most 63 characters): cut and hashed when too long."""
    if len(text) <= _MAX_NAME and _LABEL_VALUE.fullmatch(text):
        return text
    cleaned = re.sub(r"[^-A-Za-z0-9_.]+", "-", text)
    head = cleaned[: _MAX_NAME - _HASH_CHARS - 1].strip("-_.")
    return f"{head}-{_short_hash(text)}" if head else _short_hash(text)


def pipeline_selector(pipeline: str) -> str:
    """The label selector of every child of ``pipeline`` (what to list before pruning)."""
    return f"{LABEL_PIPELINE}={label_value(pipeline)}"


def config_map_name(pipeline: str, config_hash: str) -> str:
    """The ConfigMap of one configuration: named by its hash (see the module docstring)."""
    return object_name(pipeline, "config", config_hash)


def group_object_name(pipeline: str, group: PlacementGroup | str) -> str:
    """The Deployment, Service and PodDisruptionBudget of a placement group."""
    return object_name(pipeline, group if isinstance(group, str) else group.name)


def router_object_name(pipeline: str) -> str:
    """The router's Deployment, ServiceAccount, Role, RoleBinding and PodDisruptionBudget."""
    return object_name(pipeline, "router")


def router_service_name(pipeline: str) -> str:
    """The pipeline's endpoint Service: the pipeline's own name."""
    return object_name(pipeline)


def endpoint_url(name: str, namespace: str, port: int) -> str:
    """The in-cluster URL of pipeline ``name``'s router."""
    return f"http://{router_service_name(name)}.{namespace}.svc:{port}"


def object_key(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    """(apiVersion, kind, name): what identifies a child within its namespace."""
    return (str(obj["apiVersion"]), str(obj["kind"]), str(obj["metadata"]["name"]))


def prune_set(
    desired: Sequence[Mapping[str, Any]], existing: Iterable[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The objects of ``existing`` to delete: labelled as this pipeline's children by the
    operator, not in ``desired``, and owned by no one else; sorted by key."""
    if not desired:
        # Without a desired object there is no pipeline (label, uid) to compare with.
        return []
    labels = desired[0]["metadata"]["labels"]
    pipeline, uid = labels[LABEL_PIPELINE], desired[0]["metadata"]["ownerReferences"][0]["uid"]
    existing = list(existing)
    wanted = {object_key(obj) for obj in desired}
    # The ConfigMaps the live Deployments' templates mount are kept one converge longer:
    # while a rollout runs, their old ReplicaSet's pods (and any it starts again) still read
    # the configuration of their own revision.
    wanted |= {
        ("v1", "ConfigMap", name)
        for obj in existing
        if obj.get("kind") == "Deployment" and _is_child_of(obj, pipeline, uid)
        for name in _mounted_config_maps(obj)
    }
    stale = [
        obj
        for obj in existing
        if object_key(obj) not in wanted and _is_child_of(obj, pipeline, uid)
    ]
    return sorted(stale, key=object_key)


def _mounted_config_maps(deployment: Mapping[str, Any]) -> list[str]:
    pod = ((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}
    return [
        str(volume["configMap"]["name"])
        for volume in pod.get("volumes") or []
        if (volume.get("configMap") or {}).get("name")
    ]


def _is_child_of(obj: Mapping[str, Any], pipeline: str, uid: str) -> bool:
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(LABEL_PIPELINE) != pipeline or labels.get(LABEL_MANAGED_BY) != MANAGED_BY:
        return False
    # An object with no owner left (orphaned by `kubectl delete --cascade=orphan`) is still
    # ours by its labels; one that names another owner is not.
    return all(ref.get("uid") == uid for ref in meta.get("ownerReferences") or [])


# ----------------------------------------------------------------------------- quantities

_QUANTITY = re.compile(f"(?P<number>{QUANTITY_NUMBER})(?P<suffix>{QUANTITY_SUFFIX})")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


@dataclass(frozen=True)
class ParsedQuantity:
    value: Fraction
    binary: bool  # written with a binary suffix (Ki, Mi, ...): written back that way


def parse_quantity(quantity: Quantity) -> ParsedQuantity | None:
    """A Kubernetes quantity ('500m', '1.5Gi', '1e3', 2) exactly; None if it is not one."""
    if isinstance(quantity, bool):
        return None
    match = _QUANTITY.fullmatch(str(quantity).strip())
    if match is None:
        return None
    number, suffix = Fraction(match["number"]), match["suffix"] or ""
    if suffix in _BINARY:
        return ParsedQuantity(number * 1024 ** _BINARY[suffix], binary=True)
    if suffix in _DECIMAL:
        return ParsedQuantity(number * Fraction(10) ** _DECIMAL[suffix], binary=False)
    return ParsedQuantity(number * Fraction(10) ** int(suffix[1:]), binary=False)


def format_quantity(value: Fraction, *, binary: bool) -> str:
    """``value`` in Kubernetes' canonical form: the largest suffix that keeps it whole."""
    if binary and value.denominator == 1 and abs(value) >= 1024:
        for suffix, power in sorted(_BINARY.items(), key=lambda item: -item[1]):
            scaled = value / 1024**power
            if scaled.denominator == 1:
                return f"{scaled.numerator}{suffix}"
        return str(value.numerator)
    # Kubernetes keeps nothing finer than 1n, rounding up.
    nanos = math.ceil(value * 10**9)
    if nanos == 0:
        return "0"
    for suffix, exponent in sorted(_DECIMAL.items(), key=lambda item: -item[1]):
        scaled = Fraction(nanos, 10**9) / Fraction(10) ** exponent
        if scaled.denominator == 1:
            return f"{scaled.numerator}{suffix}"
    raise AssertionError("unreachable: every value in nanos is whole in n")


def sum_quantities(quantities: Sequence[Quantity]) -> str:
    """The sum of ``quantities``, canonical; a single one as written; when one does not
    parse, the first as written (the apiserver then says what is wrong with it)."""
    if len(quantities) == 1:
        return str(quantities[0])
    parsed = [parse_quantity(q) for q in quantities]
    if any(p is None for p in parsed):
        return str(quantities[0])
    values = [p for p in parsed if p is not None]
    return format_quantity(sum((p.value for p in values), Fraction(0)), binary=values[0].binary)


def pod_resources(placements: Sequence[Placement], gpu_count: int) -> dict[str, dict[str, str]]:
    """The container resources of a pod running components with ``placements``: each
    resource's requests summed, a component that gives only a limit requesting its limit
    (as Kubernetes would), and limits summed; ``gpu_count`` GPUs requested and limited."""
    requests: dict[str, list[Quantity]] = {}
    limits: dict[str, list[Quantity]] = {}
    for placement in placements:
        given = placement.resources
        for name in sorted(set(given.requests) | set(given.limits)):
            requests.setdefault(name, []).append(
                given.requests.get(name, given.limits.get(name, 0))
            )
        for name, quantity in sorted(given.limits.items()):
            limits.setdefault(name, []).append(quantity)
    result = {
        kind: {
            name: sum_quantities(values)
            for name, values in sorted(found.items())
            if name != GPU_RESOURCE
        }
        for kind, found in (("requests", requests), ("limits", limits))
    }
    if gpu_count:
        for values in result.values():
            values[GPU_RESOURCE] = str(gpu_count)
    return {kind: values for kind, values in result.items() if values}


# ---------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class _PodPlacement:
    """The placements of a pod's components, merged into what one pod spec can say."""

    image: str
    image_pull_policy: str
    resources: dict[str, dict[str, str]]
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    affinity: dict[str, Any] | None
    env: list[dict[str, Any]]
    volumes: list[dict[str, Any]]
    volume_mounts: list[dict[str, Any]]


def _merge_placements(
    placements: Sequence[Placement],
    spec: OmniPipelineSpec,
    default_image: str,
    *,
    gpu_count: int,
) -> _PodPlacement:
    """The pod-level placement of ``placements`` (one pod's); ``default_image`` is the
    image for this pod's kind (GPU or CPU) when neither a placement nor the spec names one."""
    # check_spec refuses conflicting placements in one pod; the first one wins here.
    tolerations = [
        t.model_dump(mode="json", exclude_none=True) for p in placements for t in p.tolerations
    ]
    if gpu_count:
        tolerations.append(dict(GPU_TOLERATION))
    return _PodPlacement(
        image=next((p.image for p in placements if p.image), spec.image or default_image),
        image_pull_policy=next(
            (p.image_pull_policy for p in placements if p.image_pull_policy),
            spec.image_pull_policy,
        ),
        resources=pod_resources(placements, gpu_count),
        node_selector=dict(
            sorted({k: v for p in reversed(placements) for k, v in p.node_selector.items()}.items())
        ),
        tolerations=_first_of_each(tolerations, lambda t: json.dumps(t, sort_keys=True)),
        affinity=copy.deepcopy(next((p.affinity for p in placements if p.affinity), None)),
        env=_first_of_each(
            # The operator's variables are not the placement's to set (see the docstring).
            [_env(var) for p in placements for var in p.env if not is_reserved_env(var.name)],
            lambda var: str(var["name"]),
        ),
        volumes=_first_of_each(
            [copy.deepcopy(volume) for p in placements for volume in p.volumes],
            lambda volume: str(volume.get("name")),
        ),
        volume_mounts=_first_of_each(
            [
                m.model_dump(mode="json", exclude_none=True)
                for p in placements
                for m in p.volume_mounts
            ],
            lambda mount: str(mount["mountPath"]),
        ),
    )


def _first_of_each(
    items: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], str]
) -> list[dict[str, Any]]:
    """``items`` in order, each key's first only."""
    seen: set[str] = set()
    result = []
    for item in items:
        if key(item) not in seen:
            seen.add(key(item))
            result.append(item)
    return result


def _env(var: EnvVar) -> dict[str, Any]:
    result: dict[str, Any] = {"name": var.name}
    if var.value_from is not None:
        result["valueFrom"] = copy.deepcopy(var.value_from)
    else:
        result["value"] = var.value or ""
    return result


def _needs_shm(group: PlacementGroup, spec: OmniPipelineSpec) -> bool:
    """Whether the group's pod needs a real /dev/shm (a container's default is 64 MiB)."""
    ids = set(group.stage_ids)
    for stage in group.stages:
        # vLLM's workers of one engine talk through shared memory.
        if stage.tensor_parallel_size * stage.data_parallel_size > 1:
            return True
        for upstream, connector in stage.input_stages.items():
            config = spec.connectors.get(connector)
            if upstream in ids and config is not None and config.name == SHARED_MEMORY_CONNECTOR:
                return True
    return False


# -------------------------------------------------------------------------------- objects


def config_data(spec: OmniPipelineSpec) -> dict[str, str]:
    """The ConfigMap's data: the runtime pipeline, as the stage and router processes load it.

    Replica counts are left out: in a cluster they live in the Deployments (a pod runs one
    replica; the router discovers them all), and with them in the config, scaling a stage
    would change the config hash and roll every pod of the pipeline.
    """
    pipeline = dump_pipeline(runtime_config(spec))
    for stage in pipeline["stages"]:
        stage.pop("replicas", None)
    text = json.dumps(pipeline, indent=2, sort_keys=True)
    return {CONFIG_KEY: text + "\n"}


def config_hash(data: Mapping[str, str]) -> str:
    """The pod templates' config-hash annotation for ConfigMap ``data``."""
    canonical = json.dumps(dict(data), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def pipeline_revision(config_generation: int, hash_: str) -> str:
    """What a stage pod advertises as its revision (see the module docstring)."""
    return f"{max(0, config_generation)}-{hash_}"


def drain_timeout_s(env: Sequence[Mapping[str, Any]]) -> float:
    """The drain timeout a container's ``env`` gives its runtime, else the default;
    DrainTimeoutError for a value the runtime would refuse (``placement.check_spec``
    refuses the spec first)."""
    for var in env:
        if var.get("name") == DRAIN_TIMEOUT_ENV:
            return parse_drain_timeout(var.get("value"))
    return float(DEFAULT_DRAIN_TIMEOUT_S)


def grace_period_s(drain_timeout: float) -> int:
    """terminationGracePeriodSeconds for a pod whose runtime drains for ``drain_timeout``."""
    return PRESTOP_DELAY_S + math.ceil(drain_timeout) + GRACE_MARGIN_S


@dataclass(frozen=True)
class _Context:
    """What every object of one pipeline shares."""

    name: str
    namespace: str
    uid: str
    spec: OmniPipelineSpec
    default_image: str
    default_gpu_image: str
    config_hash: str
    config_generation: int = 0
    operator_namespace: str | None = None

    def labels(self, component: str, group: PlacementGroup | None = None) -> dict[str, str]:
        return _child_labels(self.name, component, group)

    def metadata(self, name: str, labels: Mapping[str, str]) -> dict[str, Any]:
        return _child_metadata(self.name, self.namespace, self.uid, name, labels)


def _child_labels(
    pipeline: str, component: str, group: PlacementGroup | None = None
) -> dict[str, str]:
    labels = {
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_PART_OF: label_value(pipeline),
        LABEL_PIPELINE: label_value(pipeline),
        LABEL_COMPONENT: component,
    }
    if group is not None:
        labels[LABEL_GROUP] = label_value(group.name)
        labels[LABEL_STAGES] = label_value(".".join(stage.name for stage in group.stages))
    return dict(sorted(labels.items()))


def _child_metadata(
    pipeline: str, namespace: str, uid: str, name: str, labels: Mapping[str, str]
) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": dict(labels),
        "ownerReferences": [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": pipeline,
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def render(
    name: str,
    namespace: str,
    uid: str,
    spec: OmniPipelineSpec,
    *,
    default_image: str,
    default_gpu_image: str | None = None,
    config_generation: int = 0,
    operator_namespace: str | None = None,
) -> list[dict[str, Any]]:
    """Every child object of pipeline ``name`` (uid ``uid``) in ``namespace``, in the order
    to apply them: config and RBAC first, then each placement group, then the router.

    ``config_generation`` orders revisions: the pipeline's generation at which its config
    hash took its current value (see the module docstring); 0 when unknown.

    Where neither the spec nor a placement names an image, GPU pods run
    ``default_gpu_image`` (the runtime's CUDA build; ``default_image`` if not given) and the
    others ``default_image``. Assumes a spec that ``placement.check_spec`` passes.

    A placement group with ``autoscaling`` gets a Deployment without ``replicas``: those
    are the autoscaler's (the planner's, or another's in mode external), written under a
    field manager of their own, so that applying the rest never moves them.
    ``operator_namespace``, where the operator runs in the cluster, lets its pods through
    the router's NetworkPolicy to read /metrics when a stage uses the planner.
    """
    data = config_data(spec)
    ctx = _Context(
        name,
        namespace,
        uid,
        spec,
        default_image,
        default_gpu_image or default_image,
        config_hash(data),
        config_generation,
        operator_namespace,
    )
    groups = placement_groups(spec)
    objects: list[dict[str, Any]] = [
        _config_map(ctx, data),
        *_router_rbac(ctx),
        *_network_policies(ctx, groups),
    ]
    for group in groups:
        objects.append(_group_service(ctx, group))
        objects.append(_group_deployment(ctx, group))
        if group.max_replicas > 1:
            objects.append(_pdb(ctx, group_object_name(name, group), _group_labels(ctx, group)))
    objects.append(_router_service(ctx))
    objects.append(_router_deployment(ctx, groups))
    if spec.router.replicas > 1:
        objects.append(_pdb(ctx, router_object_name(name), _router_labels(ctx)))
    return objects


def _config_map(ctx: _Context, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": ctx.metadata(
            config_map_name(ctx.name, ctx.config_hash), ctx.labels(COMPONENT_CONFIG)
        ),
        # One configuration per ConfigMap, never changed: the kubelet need not watch it.
        "immutable": True,
        "data": data,
    }


def _group_labels(ctx: _Context, group: PlacementGroup) -> dict[str, str]:
    return ctx.labels(COMPONENT_STAGES, group)


def _router_labels(ctx: _Context) -> dict[str, str]:
    return ctx.labels(COMPONENT_ROUTER)


def _selector(labels: Mapping[str, str]) -> dict[str, str]:
    # Only what never changes for a Deployment's life: its selector is immutable.
    return {
        key: labels[key] for key in (LABEL_COMPONENT, LABEL_GROUP, LABEL_PIPELINE) if key in labels
    }


def _group_service(ctx: _Context, group: PlacementGroup) -> dict[str, Any]:
    labels = _group_labels(ctx, group)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ctx.metadata(group_object_name(ctx.name, group), labels),
        "spec": {
            # Headless: the router picks replicas itself, from the EndpointSlices.
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": _selector(labels),
            "ports": [
                {
                    "name": stage_port_name(stage_id),
                    "port": stage_port(stage_id),
                    "targetPort": stage_port(stage_id),
                    "protocol": "TCP",
                }
                for stage_id in group.stage_ids
            ],
        },
    }


def _group_deployment(ctx: _Context, group: PlacementGroup) -> dict[str, Any]:
    labels = _group_labels(ctx, group)
    placement = _merge_placements(
        [stage.placement for stage in group.stages],
        ctx.spec,
        ctx.default_gpu_image if group.gpu_count else ctx.default_image,
        gpu_count=group.gpu_count,
    )
    shm = _needs_shm(group, ctx.spec)
    secrets = [_stage_keys_volume(ctx, SERVER_FILES)]
    ports = [
        {"name": stage_port_name(i), "containerPort": stage_port(i), "protocol": "TCP"}
        for i in group.stage_ids
    ]
    container = _container(
        STAGE_CONTAINER,
        placement,
        args=_stage_args(group),
        env=[
            *_stage_env(group),
            {
                "name": REVISION_ENV,
                "value": pipeline_revision(ctx.config_generation, ctx.config_hash),
            },
            {"name": KEYS_DIR_ENV, "value": STAGE_KEYS_DIR},
        ],
        ports=[*ports, {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"}],
        probes=_stage_probes(len(group.stages)),
        shm=shm,
        secrets=secrets,
    )
    pod = _pod_spec(ctx, placement, container, shm=shm, service_account=None, secrets=secrets)
    # Ready (traffic, and the rollout's progress) waits until this pod's revision has a
    # ready pod in every placement group: see revision_gate.py.
    pod["readinessGates"] = [{"conditionType": READINESS_GATE}]
    name = group_object_name(ctx.name, group)
    replicas = None if group.autoscaling is not None else group.replicas
    return _deployment(ctx, name, labels, replicas, _strategy(group.gpu_count > 0), pod)


def _strategy(gpu: bool) -> dict[str, Any]:
    if gpu:
        # No spare GPUs for a surge pod: replace one pod at a time.
        return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}


# How long one stage of a pod may take to load its model (a 7B checkpoint fetched from the
# hub can take many minutes); the pod's startup probe allows that for each of its stages.
STAGE_STARTUP_TIMEOUT_S = 840
# Short periods, so that a pod takes traffic (and a rollout moves on) within a moment of
# being able to: every pod a rollout replaces waits out what is left of a period, twice
# (startup, then readiness). A probe is one local HTTP GET.
_STARTUP_PROBE_PERIOD_S = 2
_READINESS_PROBE_PERIOD_S = 2


def _stage_args(group: PlacementGroup) -> list[str]:
    args = ["stage", "-f", CONFIG_FILE, "--stages", ",".join(map(str, group.stage_ids))]
    for stage_id in group.stage_ids:
        args += ["--port", f"{stage_id}={stage_port(stage_id)}"]
    return [
        *args,
        "--health-port",
        str(HEALTH_PORT),
        "--startup-timeout",
        str(STAGE_STARTUP_TIMEOUT_S),
    ]


def _stage_env(group: PlacementGroup) -> list[dict[str, Any]]:
    env = _home_env()
    if not group.gpu_count:
        # No GPU in the pod: CUDA libraries in the image see none rather than probe for one.
        return [*env, {"name": "CUDA_VISIBLE_DEVICES", "value": ""}]
    return env + [
        {
            "name": f"{STAGE_CUDA_DEVICES_ENV_PREFIX}{stage.stage_id}",
            "value": group.visible_devices(stage),
        }
        for stage in group.stages
    ]


def _home_env() -> list[dict[str, Any]]:
    return [{"name": "HOME", "value": HOME_DIR}, {"name": "HF_HOME", "value": HF_HOME_DIR}]


def _http_probe(path: str, port: int | str, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _stage_probes(stages: int) -> dict[str, Any]:
    # The probe port opens once every stage has loaded its model, one stage after the
    # other. The window is a minute beyond the stage process's own startup timeouts, so
    # that a stage that cannot start exits saying why rather than being killed unheard.
    window = STAGE_STARTUP_TIMEOUT_S * stages + 60
    return {
        "startupProbe": _http_probe(
            "/livez",
            "health",
            period=_STARTUP_PROBE_PERIOD_S,
            failures=-(-window // _STARTUP_PROBE_PERIOD_S),
        ),
        "livenessProbe": _http_probe("/livez", "health", period=10, failures=3),
        "readinessProbe": _http_probe(
            "/readyz", "health", period=_READINESS_PROBE_PERIOD_S, failures=3
        ),
    }


def _container(
    name: str,
    placement: _PodPlacement,
    *,
    args: list[str],
    env: list[dict[str, Any]],
    ports: list[dict[str, Any]],
    probes: dict[str, Any],
    shm: bool,
    secrets: Sequence[_SecretVolume] = (),
) -> dict[str, Any]:
    # The operator's variables win: a placement's copy of one is dropped (a duplicate
    # name in a container's env is refused by server-side apply).
    ours = {var["name"] for var in env}
    extra_env = [var for var in placement.env if var["name"] not in ours | {REVISION_ENV}]
    if not any(var["name"] == DRAIN_TIMEOUT_ENV for var in extra_env):
        env = [*env, {"name": DRAIN_TIMEOUT_ENV, "value": str(DEFAULT_DRAIN_TIMEOUT_S)}]
    mounts: list[dict[str, Any]] = [
        {"name": "omni-config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "omni-home", "mountPath": HOME_DIR},
        {"name": "omni-tmp", "mountPath": TMP_DIR},
    ]
    if shm:
        mounts.append({"name": "omni-shm", "mountPath": SHM_DIR})
    mounts += [
        {"name": secret.volume["name"], "mountPath": secret.mount_path, "readOnly": True}
        for secret in secrets
    ]
    container: dict[str, Any] = {
        "name": name,
        "image": placement.image,
        "imagePullPolicy": placement.image_pull_policy,
        "command": ["omni-runtime"],
        "args": args,
        "env": env + extra_env,
        "ports": ports,
        "volumeMounts": mounts + placement.volume_mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
        },
        # While it sleeps, the terminating pod leaves its EndpointSlices and those who
        # follow them stop sending it work; SIGTERM (the drain) comes after.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_DELAY_S}}},
        **probes,
    }
    if placement.resources:
        container["resources"] = placement.resources
    return container


def _pod_spec(
    ctx: _Context,
    placement: _PodPlacement,
    container: dict[str, Any],
    *,
    shm: bool,
    service_account: str | None,
    secrets: Sequence[_SecretVolume] = (),
) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [
        {
            "name": "omni-config",
            "configMap": {"name": config_map_name(ctx.name, ctx.config_hash)},
        },
        {"name": "omni-home", "emptyDir": {}},
        {"name": "omni-tmp", "emptyDir": {}},
    ]
    if shm:
        volumes.append({"name": "omni-shm", "emptyDir": {"medium": "Memory"}})
    volumes += [secret.volume for secret in secrets]
    pod: dict[str, Any] = {
        "containers": [container],
        # Service links would put <SERVICE>_PORT variables of every Service in the
        # namespace into the environment, where they could shadow the runtime's OMNI_*.
        "enableServiceLinks": False,
        "automountServiceAccountToken": service_account is not None,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUNTIME_UID,
            "runAsGroup": RUNTIME_UID,
            "fsGroup": RUNTIME_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # Never SIGKILL a drain that is within its timeout.
        "terminationGracePeriodSeconds": grace_period_s(drain_timeout_s(container["env"])),
        "volumes": volumes + placement.volumes,
    }
    if service_account is not None:
        pod["serviceAccountName"] = service_account
    if placement.node_selector:
        pod["nodeSelector"] = placement.node_selector
    if placement.tolerations:
        pod["tolerations"] = placement.tolerations
    if placement.affinity is not None:
        pod["affinity"] = placement.affinity
    return pod


def _deployment(
    ctx: _Context,
    name: str,
    labels: dict[str, str],
    replicas: int | None,
    strategy: dict[str, Any],
    pod: dict[str, Any],
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": ctx.metadata(name, labels),
        "spec": {
            **({"replicas": replicas} if replicas is not None else {}),
            "revisionHistoryLimit": 3,
            "strategy": strategy,
            "selector": {"matchLabels": _selector(labels)},
            "template": {
                "metadata": {
                    "labels": dict(labels),
                    "annotations": {ANNOTATION_CONFIG_HASH: ctx.config_hash},
                },
                "spec": pod,
            },
        },
    }


def _pdb(ctx: _Context, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": ctx.metadata(name, labels),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(labels)}},
    }


def _router_rbac(ctx: _Context) -> list[dict[str, Any]]:
    name, labels = router_object_name(ctx.name), _router_labels(ctx)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": ctx.metadata(name, labels)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": ctx.metadata(name, labels),
            "rules": [
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": ctx.metadata(name, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ctx.namespace}],
        },
    ]


def _router_service(ctx: _Context) -> dict[str, Any]:
    labels = _router_labels(ctx)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ctx.metadata(router_service_name(ctx.name), labels),
        "spec": {
            "type": ctx.spec.router.service_type,
            "selector": _selector(labels),
            "ports": [
                {
                    "name": "http",
                    "port": ctx.spec.router.port,
                    "targetPort": "http",
                    "protocol": "TCP",
                }
            ],
        },
    }


def _router_deployment(ctx: _Context, groups: Sequence[PlacementGroup]) -> dict[str, Any]:
    router = ctx.spec.router
    placement = _merge_placements([router.placement], ctx.spec, ctx.default_image, gpu_count=0)
    args = ["router", "-f", CONFIG_FILE, "--port", str(router.port)]
    args += ["--discover-namespace", f"$({NAMESPACE_ENV})"]
    services = {i: group_object_name(ctx.name, group) for group in groups for i in group.stage_ids}
    for stage_id, service in sorted(services.items()):
        args += ["--stage-service", f"{stage_id}={service}"]
    secrets = [_stage_keys_volume(ctx, CLIENT_FILES)]
    if router.api_key_secret_ref is not None:
        secrets.append(_api_keys_volume(router.api_key_secret_ref))
        args += ["--api-key-file", f"{API_KEYS_DIR}/{API_KEYS_FILE}"]
    namespace_env = {
        "name": NAMESPACE_ENV,
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
    }
    container = _container(
        ROUTER_CONTAINER,
        placement,
        args=args,
        env=[namespace_env, *_home_env(), {"name": KEYS_DIR_ENV, "value": STAGE_KEYS_DIR}],
        ports=[{"name": "http", "containerPort": router.port, "protocol": "TCP"}],
        probes={
            # /health answers 503 until every stage has a live replica: not ready, alive.
            "readinessProbe": _http_probe(
                "/health", "http", period=_READINESS_PROBE_PERIOD_S, failures=3
            ),
            "livenessProbe": _http_probe("/livez", "http", period=10, failures=3),
        },
        shm=False,
        secrets=secrets,
    )
    name = router_object_name(ctx.name)
    pod = _pod_spec(ctx, placement, container, shm=False, service_account=name, secrets=secrets)
    return _deployment(ctx, name, _router_labels(ctx), router.replicas, _strategy(False), pod)


# ---------------------------------------------------------------------------- credentials


@dataclass(frozen=True)
class _SecretVolume:
    """A Secret mounted read-only: the pod's volume and where the container sees it."""

    volume: dict[str, Any]
    mount_path: str


def stage_keys_secret_name(pipeline: str) -> str:
    return object_name(pipeline, "stage-keys")


def stage_keys_secret(
    name: str, namespace: str, uid: str, keys: Mapping[str, str]
) -> dict[str, Any]:
    """The Secret of pipeline ``name``'s stage keys (``stage_keys.generate_stage_keys``).

    Not among ``render``'s objects: its keys are random, so the reconciler creates it once
    and never applies it again (a new pair would lock out every pod running on the old
    one). Owned by the pipeline, so it goes with it; immutable, as nothing ever rewrites it.
    """
    labels = _child_labels(name, COMPONENT_STAGE_KEYS)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _child_metadata(name, namespace, uid, stage_keys_secret_name(name), labels),
        "type": "Opaque",
        "immutable": True,
        "stringData": dict(sorted(keys.items())),
    }


def _stage_keys_volume(ctx: _Context, files: Sequence[str]) -> _SecretVolume:
    # Only the files of the pod's role: a stage pod cannot pose as a router, nor a router
    # pod as a stage.
    volume = {
        "name": "omni-stage-keys",
        "secret": {
            "secretName": stage_keys_secret_name(ctx.name),
            "items": [{"key": name, "path": name} for name in files],
            "defaultMode": _SECRET_FILE_MODE,
        },
    }
    return _SecretVolume(volume, STAGE_KEYS_DIR)


def _api_keys_volume(ref: SecretKeyRef) -> _SecretVolume:
    # A whole volume, never a subPath: only then does the kubelet update the file when
    # the Secret changes, which is how a rotated key reaches the router.
    volume = {
        "name": "omni-api-keys",
        "secret": {
            "secretName": ref.name,
            "items": [{"key": ref.key, "path": API_KEYS_FILE}],
            "defaultMode": _SECRET_FILE_MODE,
        },
    }
    return _SecretVolume(volume, API_KEYS_DIR)


# ------------------------------------------------------------------------ network policies


def _network_policies(ctx: _Context, groups: Sequence[PlacementGroup]) -> list[dict[str, Any]]:
    """Who may reach the pipeline's pods (defence in depth: the stage sockets authenticate
    their peers either way, and only a network plugin that enforces NetworkPolicies
    applies these).

    - Stage pods: any port, but only from the pipeline's own pods: its routers (stage
      requests) and its stage pods (connector pulls, whose ports a pipeline may leave to
      the system to pick).
    - Router pods: the router's port, from ``router.allowedFrom`` (default: the pods of
      the pipeline's namespace), and from the operator's pods where a stage uses the
      planner (it reads /metrics) and the operator's namespace is known.

    Egress is not restricted: stages may need to reach model stores.
    """
    own_pods = {
        "podSelector": {
            "matchLabels": {
                LABEL_MANAGED_BY: MANAGED_BY,
                LABEL_PIPELINE: label_value(ctx.name),
            }
        }
    }
    stage_selector = {LABEL_COMPONENT: COMPONENT_STAGES, LABEL_PIPELINE: label_value(ctx.name)}
    router = ctx.spec.router
    allowed = router.allowed_from if router.allowed_from is not None else [{"podSelector": {}}]
    planned = any(g.autoscaling and g.autoscaling.mode == "planner" for g in groups)
    if planned and ctx.operator_namespace is not None:
        allowed = [*allowed, _operator_pods(ctx.operator_namespace)]
    policies = [
        _network_policy(
            ctx,
            object_name(ctx.name, "stages"),
            ctx.labels(COMPONENT_STAGES),
            stage_selector,
            [{"from": [own_pods]}],
        ),
        _network_policy(
            ctx,
            router_object_name(ctx.name),
            _router_labels(ctx),
            _selector(_router_labels(ctx)),
            [{"from": allowed, "ports": [{"protocol": "TCP", "port": router.port}]}],
        ),
    ]
    return policies if groups else policies[1:]


def _operator_pods(namespace: str) -> dict[str, Any]:
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "podSelector": {"matchLabels": {OPERATOR_POD_LABEL: OPERATOR_POD_LABEL_VALUE}},
    }


def _network_policy(
    ctx: _Context,
    name: str,
    labels: Mapping[str, str],
    selector: Mapping[str, str],
    ingress: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": ctx.metadata(name, labels),
        "spec": {
            "podSelector": {"matchLabels": dict(selector)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
