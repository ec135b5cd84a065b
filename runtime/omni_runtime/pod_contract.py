"""What a pod the operator renders and the runtime process in it agree on, and how both
read that pod's readiness back from Kubernetes.

The operator writes these names and values into its pod templates; the stage and router
processes read them at start. Kept here, below every runtime layer, so that both sides
import one definition (the runtime never imports the operator): a renamed variable or a
changed default cannot leave one side behind.

- ``OMNI_DRAIN_TIMEOUT_S``: how long a stopping process lets its work finish. Parsed by
  ``parse_drain_timeout`` alone: seconds, a finite number >= 0; unset or blank is
  ``DEFAULT_DRAIN_TIMEOUT_S``; anything else is a ``DrainTimeoutError``, which a process
  reports at start and the operator as a refused spec (its pods' grace period is derived
  from the value, so a value it cannot read is one it cannot honour).
- ``OMNI_PIPELINE_REVISION``: the revision a stage advertises to routers,
  ``<order>-<config hash>`` (router.revisions says what routers do with it).
- ``omni.dev/config-hash``: the pod template annotation holding that config hash.
- ``OMNI_NAMESPACE``: the pod's namespace (the router discovers stages there);
  ``OMNI_CUDA_VISIBLE_DEVICES_<stage id>``: each stage's GPUs in a pod that runs several.
- ``HEALTH_PORT``: where a stage pod answers /livez and /readyz.
- EndpointSlice endpoints and Deployments, read the way the EndpointSlice API and the
  Deployment controller define readiness.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

DRAIN_TIMEOUT_ENV = "OMNI_DRAIN_TIMEOUT_S"
# How long a stopping process lets the work it holds finish. The operator's pods allow it
# (terminationGracePeriodSeconds) plus their preStop delay and a margin. Whole seconds:
# the operator writes it into pods as it is ("30").
DEFAULT_DRAIN_TIMEOUT_S = 30
REVISION_ENV = "OMNI_PIPELINE_REVISION"
# The API group of OmniPipeline, and the prefix of every label and annotation the operator
# sets (defined here, once: the runtime reads some of them).
API_GROUP = "omni.dev"
ANNOTATION_CONFIG_HASH = f"{API_GROUP}/config-hash"
NAMESPACE_ENV = "OMNI_NAMESPACE"
# Per stage, the CUDA_VISIBLE_DEVICES its engine sees, where one process runs several
# stages on a pod's GPUs (the operator maps each stage's devices into the pod's numbering).
STAGE_CUDA_DEVICES_ENV_PREFIX = "OMNI_CUDA_VISIBLE_DEVICES_"
HEALTH_PORT = 8081


class DrainTimeoutError(ValueError):
    """An OMNI_DRAIN_TIMEOUT_S that is not seconds; the message quotes it."""


def parse_drain_timeout(text: str | None) -> float:
    """An OMNI_DRAIN_TIMEOUT_S value in seconds: a finite number >= 0; None or blank is
    the default. DrainTimeoutError otherwise: a silent default would let a process drain
    for a time its pod's grace period was not sized for."""
    text = (text or "").strip()
    if not text:
        return float(DEFAULT_DRAIN_TIMEOUT_S)
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise DrainTimeoutError(f"{DRAIN_TIMEOUT_ENV}={text!r}: expected seconds, a number >= 0")
    return value


def drain_timeout_from_env(environ: Mapping[str, str]) -> float:
    """This process's drain timeout (``parse_drain_timeout`` of its environment's)."""
    return parse_drain_timeout(environ.get(DRAIN_TIMEOUT_ENV))


def endpoint_is_ready(endpoint: Mapping[str, Any]) -> bool:
    """Whether an EndpointSlice endpoint takes new work: ``ready`` unset means unknown,
    which the API says to treat as ready; a terminating endpoint never does, whatever
    ``ready`` says (a Service with publishNotReadyAddresses may still mark it ready)."""
    conditions = endpoint.get("conditions") or {}
    return conditions.get("ready") is not False and conditions.get("terminating") is not True


def endpoint_serves_while_terminating(endpoint: Mapping[str, Any]) -> bool:
    """Whether a terminating endpoint still serves (``serving`` unset: as ``ready`` says),
    as kube-proxy uses one when a Service has no ready endpoint left."""
    conditions = endpoint.get("conditions") or {}
    if conditions.get("terminating") is not True:
        return False
    serving = conditions.get("serving")
    return conditions.get("ready") is not False if serving is None else serving is True


def deployment_replicas(deployment: Mapping[str, Any]) -> int:
    """The replicas a Deployment asks for (1 where unset, as the apiserver defaults it)."""
    return int((deployment.get("spec") or {}).get("replicas", 1))


def deployment_ready_replicas(deployment: Mapping[str, Any]) -> int:
    return int((deployment.get("status") or {}).get("readyReplicas") or 0)


def all_replicas_ready(replicas: int, ready_replicas: int) -> bool:
    """Whether a Deployment asking for ``replicas`` has them all ready; one asking for
    none is not (it serves nothing)."""
    return replicas > 0 and ready_replicas >= replicas


def deployment_is_ready(deployment: Mapping[str, Any] | None) -> bool:
    """``all_replicas_ready`` of a Deployment as the apiserver returns it; None (not made
    yet) is not ready."""
    if deployment is None:
        return False
    return all_replicas_ready(
        deployment_replicas(deployment), deployment_ready_replicas(deployment)
    )
