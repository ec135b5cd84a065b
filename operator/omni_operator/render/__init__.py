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
- With ``router.videoStore``: Deployment, Service and NetworkPolicy ``P-video-store``, a
  Redis that the routers share their video jobs through (video_store.py), and the
  password Secret of that name, which the reconciler makes once.

The renderer's rooms: names.py (object names, labels, field managers, the kinds
created), config.py (the ConfigMap, its hash, the revision), quantities.py (a pod's
resources), pods.py (what every pod shares: placements merged, the container, the grace
period, the Deployment and PodDisruptionBudget), stages.py (a placement group's Service
and Deployment), router.py (the router's RBAC, Deployment and Service), network.py (the
NetworkPolicies), secrets.py (the stage-keys Secret and the Secret volumes),
video_store.py (a managed video store). What the
pods and the runtime agree on (variable names, the drain timeout, the health port, the
config hash annotation) is omni_runtime.pod_contract's. The prune policy, what to delete
of what exists, is the reconciler's.

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

from typing import Any

from ..api import OmniPipelineSpec
from ..placement import placement_groups
from .config import config_data, config_hash, config_map
from .context import RenderContext
from .names import group_object_name, router_object_name
from .network import network_policies
from .pods import disruption_budget
from .router import router_deployment, router_rbac, router_service
from .stages import group_deployment, group_service
from .video_store import video_store_objects

__all__ = ["render"]


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
    data = config_data(spec, name)
    ctx = RenderContext(
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
        config_map(ctx, data),
        *router_rbac(ctx),
        *network_policies(ctx, groups),
    ]
    for group in groups:
        objects.append(group_service(ctx, group))
        objects.append(group_deployment(ctx, group))
        if group.max_replicas > 1:
            objects.append(
                disruption_budget(ctx, group_object_name(name, group), ctx.group_labels(group))
            )
    # The store before the routers that use it.
    objects.extend(video_store_objects(ctx))
    objects.append(router_service(ctx))
    objects.append(router_deployment(ctx, groups))
    if spec.router.replicas > 1:
        objects.append(disruption_budget(ctx, router_object_name(name), ctx.router_labels()))
    return objects
