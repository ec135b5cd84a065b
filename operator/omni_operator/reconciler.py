"""Converging one OmniPipeline: check, render, apply, prune, report.

The I/O edge of the operator: everything here is a Kubernetes call through ``KubeClient``
or an Event; what to create comes from ``render`` and what to report from ``status``, both
pure. kopf's handlers (handlers.py) decide when to call it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from omni_runtime.config import PipelineConfigError
from omni_runtime.config.errors import join_path
from omni_runtime.kube import KubeApiError, KubeClient, object_path, resource_path_for
from omni_runtime.pod_contract import ANNOTATION_CONFIG_HASH, REVISION_ENV

from .api import API_VERSION, PLURAL, OmniPipelineSpec, OmniPipelineStatus, StageScalingStatus
from .autoscaler import initial_replicas, set_replicas
from .placement import PlacementGroup, check_spec, placement_groups
from .render import render
from .render.config import config_data, config_hash
from .render.names import (
    CHILD_KINDS,
    COMPONENT_STAGES,
    FIELD_MANAGER,
    LABEL_COMPONENT,
    LABEL_GROUP,
    LABEL_MANAGED_BY,
    LABEL_PIPELINE,
    MANAGED_BY,
    endpoint_url,
    group_object_name,
    label_value,
    object_key,
    video_store_name,
)
from .render.secrets import stage_keys_secret
from .render.video_store import generate_video_store_password, video_store_secret
from .revision_gate import StagePod, pods_to_release, released_condition
from .stage_keys import generate_stage_keys
from .status import StagePlacement, invalid_status, pipeline_status, status_body

logger = logging.getLogger("omni_operator")

ObjectKey = tuple[str, str, str]
# Posts a Kubernetes Event about the pipeline: (type Normal|Warning, reason, message).
EventSink = Callable[[str, str, str], None]


@dataclass(frozen=True)
class PipelineRef:
    """Which OmniPipeline, as the handlers know it."""

    name: str
    namespace: str
    uid: str
    generation: int


class SpecRefused(Exception):
    """The spec passed the CRD but cannot be deployed; the message says why."""


@dataclass(frozen=True)
class _Applied:
    """A pipeline's spec as last applied, with what the readiness gate compares pods to."""

    generation: int
    spec: OmniPipelineSpec
    config_hash: str
    group_labels: tuple[str, ...]


@dataclass
class _Memory:
    """What the reconciler remembers of one pipeline between calls."""

    # Serialises status writes.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Held while replicas of autoscaled Deployments may be written: by a converge (which
    # hands them over) and by the planner, so that neither writes a count the other read
    # before it changed.
    replicas_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The pipeline as converge last saw it, with its spec as given, for child watches.
    seen: tuple[PipelineRef, dict[str, Any]] | None = None
    # The status last written, so that an unchanged status is not written again.
    written: dict[str, Any] | None = None
    # None until a spec is applied, and again while the spec is refused: child changes
    # must then not overwrite the status that says why.
    applied: _Applied | None = None
    # The autoscaler's last word: per stage, the Deployments it scaled up (with their
    # replicas before) whose new pods are not all ready yet, and the generations its
    # scales gave them.
    scaling: dict[str, StageScalingStatus] | None = None
    scaled_up_from: dict[str, int] | None = None
    scaled_generations: dict[str, int] | None = None


@dataclass
class Reconciler:
    """Converges pipelines; one per operator process."""

    kube: KubeClient
    default_image: str
    default_gpu_image: str
    # Where the operator's own pods run, when in the cluster (render/network.py's NetworkPolicy).
    operator_namespace: str | None = None
    _pipelines: dict[tuple[str, str], _Memory] = field(default_factory=dict)

    def _memory(self, ref: PipelineRef) -> _Memory:
        return self._pipelines.setdefault((ref.namespace, ref.name), _Memory())

    def _applied(self, namespace: str, name: str) -> _Applied | None:
        # A read: remembers nothing of a pipeline it does not know.
        memory = self._pipelines.get((namespace, name))
        return memory.applied if memory is not None else None

    def lock(self, ref: PipelineRef) -> asyncio.Lock:
        return self._memory(ref).lock

    def replicas_lock(self, ref: PipelineRef) -> asyncio.Lock:
        """Held while replicas of autoscaled Deployments may be written (see _Memory)."""
        return self._memory(ref).replicas_lock

    def forget(self, namespace: str, name: str) -> None:
        """Drop what is remembered of a deleted pipeline."""
        self._pipelines.pop((namespace, name), None)

    def applied_spec(self, namespace: str, name: str) -> OmniPipelineSpec | None:
        """The spec last applied for ``namespace/name``; None before one was."""
        applied = self._applied(namespace, name)
        return applied.spec if applied is not None else None

    def set_scaling(
        self,
        ref: PipelineRef,
        stages: Mapping[str, StageScalingStatus],
        scaled_up_from: Mapping[str, int],
        scaled_generations: Mapping[str, int],
    ) -> None:
        """What the next status report says of the autoscaling (autoscaler.py)."""
        memory = self._memory(ref)
        memory.scaling = dict(stages)
        memory.scaled_up_from = dict(scaled_up_from)
        memory.scaled_generations = dict(scaled_generations)

    def known(self, namespace: str, name: str) -> PipelineRef | None:
        """The pipeline ``namespace/name`` as last converged, or None."""
        memory = self._pipelines.get((namespace, name))
        return memory.seen[0] if memory is not None and memory.seen is not None else None

    def count(self) -> int:
        return len(self.known_refs())

    def known_refs(self) -> list[PipelineRef]:
        return [memory.seen[0] for memory in self._pipelines.values() if memory.seen is not None]

    def autoscaled(self, ref: PipelineRef) -> bool:
        """Whether ``ref``'s applied spec gives a stage autoscaling."""
        spec = self.applied_spec(ref.namespace, ref.name)
        return spec is not None and any(stage.autoscaling for stage in spec.stages)

    async def deployments(self, ref: PipelineRef) -> dict[str, dict[str, Any]]:
        """``ref``'s Deployments now, by name."""
        listed = await self.kube.list(
            object_path("apps/v1", "deployments", ref.namespace),
            label_selector=f"{LABEL_PIPELINE}={ref.name}",
        )
        return {item["metadata"]["name"]: item for item in listed.get("items", [])}

    async def reconverge(self, ref: PipelineRef, event: EventSink) -> None:
        """Converge ``ref`` again with the spec it was last converged with."""
        memory = self._pipelines.get((ref.namespace, ref.name))
        seen = memory.seen if memory is not None else None
        if seen is not None and seen[0] == ref:
            await self.converge(ref, seen[1], None, event)

    async def converge(
        self,
        ref: PipelineRef,
        raw_spec: Mapping[str, Any],
        previous: Mapping[str, Any] | None,
        event: EventSink,
    ) -> None:
        """Make the children match ``raw_spec`` and write the status.

        A spec the operator refuses changes no child: the status says why. API errors
        propagate (kopf retries with backoff) after an Event names them.
        """
        memory = self._memory(ref)
        memory.seen = (ref, dict(raw_spec))
        try:
            spec = parse_spec(raw_spec)
        except SpecRefused as e:
            event("Warning", "InvalidSpec", str(e))
            # Until a valid spec comes, child changes must not overwrite this status.
            memory.applied = None
            last = memory.written
            before = _status(last if last is not None else previous)
            await self._write_status(ref, invalid_status(str(e), ref.generation, before, _now()))
            return
        await self._ensure_stage_keys(ref, event)
        if spec.router.video_store is not None:
            await self._ensure_video_store_secret(ref, event)
        async with self.replicas_lock(ref):
            existing, desired, applied, current_hash = await self._apply_children(
                ref, spec, previous, event
            )
        for obj in prune_set(desired, list(existing.values())):
            key = object_key(obj)
            try:
                if await self.kube.delete(resource_path_for(obj)):
                    event("Normal", "Pruned", f"deleted {key[1]} {key[2]}: no longer in the spec")
            except KubeApiError as e:
                event("Warning", "PruneFailed", f"{key[1]} {key[2]}: {e}")
                raise
        # The record now, not the one taken before the awaits above: a forget may have
        # dropped that one meanwhile.
        self._memory(ref).applied = _Applied(
            ref.generation,
            spec,
            current_hash,
            tuple(label_value(group.name) for group in placement_groups(spec)),
        )
        deployments = {key[2]: body for key, body in applied.items() if key[1] == "Deployment"}
        await self.report(ref, deployments, previous, event)

    async def _apply_children(
        self,
        ref: PipelineRef,
        spec: OmniPipelineSpec,
        previous: Mapping[str, Any] | None,
        event: EventSink,
    ) -> tuple[
        dict[ObjectKey, dict[str, Any]],
        list[dict[str, Any]],
        dict[ObjectKey, dict[str, Any]],
        str,
    ]:
        """Apply every child ``spec`` renders; returns the children found before, those
        rendered, those applied (as the apiserver returned them) and the config hash."""
        existing = await self._list_children(ref)
        current_hash = config_hash(config_data(spec, ref.name))
        desired = render(
            ref.name,
            ref.namespace,
            ref.uid,
            spec,
            default_image=self.default_image,
            default_gpu_image=self.default_gpu_image,
            config_generation=config_generation(current_hash, existing.values(), ref.generation),
            operator_namespace=self.operator_namespace,
        )
        autoscaled = {
            group_object_name(ref.name, group): group
            for group in placement_groups(spec)
            if group.autoscaling is not None
        }
        applied: dict[ObjectKey, dict[str, Any]] = {}
        for obj in desired:
            key = object_key(obj)
            found = existing.get(key)
            group = autoscaled.get(key[2]) if key[1] == "Deployment" else None
            try:
                if group is not None and found is not None:
                    await self._hand_over_replicas(ref, group, found, event)
                result = await self.kube.apply(obj, field_manager=FIELD_MANAGER)
                if group is not None and found is None:
                    result = await self._hand_over_replicas(ref, group, None, event) or result
            except KubeApiError as e:
                event("Warning", "ApplyFailed", f"{key[1]} {key[2]}: {e}")
                if refused_for_good(e):
                    # The same spec renders the same object: the spec must change first,
                    # and until then child changes must not overwrite this status.
                    memory = self._memory(ref)
                    memory.applied = None
                    message = f"the apiserver refused {key[1]} {key[2]}: {e.message}"
                    last = memory.written
                    before = _status(last if last is not None else previous)
                    await self._write_status(
                        ref, invalid_status(message, ref.generation, before, _now())
                    )
                raise
            applied[key] = result
            if found is None:
                event("Normal", "Created", f"created {key[1]} {key[2]}")
            elif _version(found) != _version(result):
                event("Normal", "Updated", f"updated {key[1]} {key[2]}")
        return existing, desired, applied, current_hash

    async def _hand_over_replicas(
        self,
        ref: PipelineRef,
        group: PlacementGroup,
        live: Mapping[str, Any] | None,
        event: EventSink,
    ) -> dict[str, Any] | None:
        """Give an autoscaled group's Deployment (``live``; None: just made) its replicas
        under the autoscaler's field manager, before the operator's own apply leaves them
        out (a field no manager applies any more would be removed, and the replicas fall
        back to 1). The planner keeps what runs now, within min/max; in mode external the
        value is never forced: where another autoscaler holds a different one (a 409
        conflict), it stays the other's."""
        scaling = group.autoscaling
        assert scaling is not None
        name = group_object_name(ref.name, group)
        current = (live or {}).get("spec", {}).get("replicas") if live is not None else None
        replicas = initial_replicas(group, int(current) if current is not None else None)
        try:
            return await set_replicas(
                self.kube, ref.namespace, name, replicas, force=scaling.mode == "planner"
            )
        except KubeApiError as e:
            if e.status == 409 and scaling.mode == "external":
                return None
            event("Warning", "ApplyFailed", f"Deployment {name} replicas: {e}")
            raise

    async def _ensure_stage_keys(self, ref: PipelineRef, event: EventSink) -> None:
        """Create the pipeline's stage-keys Secret unless it exists (_create_secret_once)."""
        secret = stage_keys_secret(ref.name, ref.namespace, ref.uid, generate_stage_keys())
        await self._create_secret_once(secret, "the pipeline's stage keys", event)

    async def _ensure_video_store_secret(self, ref: PipelineRef, event: EventSink) -> None:
        """Create the managed video store's password Secret unless it exists."""
        password = generate_video_store_password()
        secret = video_store_secret(ref.name, ref.namespace, ref.uid, password)
        await self._create_secret_once(secret, "the video store's password", event)

    async def _create_secret_once(
        self, secret: dict[str, Any], what: str, event: EventSink
    ) -> None:
        """Create-only: the operator never reads a Secret (its RBAC has no get on them),
        and credentials once made are kept, since every pod of the pipeline runs on them
        (new stage keys, or a new store password, would lock the running pods out). A
        Secret deleted by hand is made anew at the next converge (its pods then need a
        restart to read it)."""
        name = secret["metadata"]["name"]
        try:
            created = await self.kube.create(secret)
        except KubeApiError as e:
            # e names the object and the apiserver's reason; it never holds the data.
            event("Warning", "ApplyFailed", f"Secret {name}: {e}")
            raise
        if created:
            event("Normal", "Created", f"created Secret {name} ({what})")

    async def report(
        self,
        ref: PipelineRef,
        deployments: Mapping[str, Mapping[str, Any]],
        previous: Mapping[str, Any] | None,
        event: EventSink,
    ) -> None:
        """Write the status computed from ``deployments`` (by name), if the spec of
        ``ref.generation`` has been applied; otherwise converge will."""
        applied = self._applied(ref.namespace, ref.name)
        if applied is None:
            return
        generation, spec = applied.generation, applied.spec
        groups = placement_groups(spec)
        stages = [
            StagePlacement(
                name=stage.name,
                stage_id=stage.stage_id,
                group=group.name,
                deployment=group_object_name(ref.name, group),
            )
            for group in groups
            for stage in group.stages
        ]
        router = next(
            (
                name
                for name, body in deployments.items()
                if _labels(body).get(LABEL_COMPONENT) == "router"
            ),
            f"{ref.name}-router",
        )
        async with self.lock(ref):
            memory = self._memory(ref)
            last = memory.written
            before = _status(last if last is not None else previous)
            status = pipeline_status(
                stages=stages,
                router_deployment=router,
                deployments=deployments,
                generation=generation,
                endpoint=endpoint_url(ref.name, ref.namespace, spec.router.port),
                previous=before,
                now=_now(),
                scaling=memory.scaling,
                scaled_up_from=memory.scaled_up_from,
                scaled_generations=memory.scaled_generations,
                video_store_deployment=(
                    video_store_name(ref.name) if spec.router.video_store is not None else None
                ),
            )
            if before is None or before.phase != status.phase:
                kind = "Warning" if status.phase in ("Degraded", "Failed") else "Normal"
                was = before.phase if before is not None else "none"
                ready = next(c for c in status.conditions if c.type == "Ready")
                event(kind, status.phase, f"phase {was} -> {status.phase}: {ready.message}")
            await self._write_status_locked(ref, status)

    async def release_revision(
        self, ref: PipelineRef, pods: Iterable[Mapping[str, Any]], event: EventSink
    ) -> None:
        """Open the readiness gate (revision_gate.py) of the stage pods of ``ref``'s
        current config, if that revision now has a ready pod in every placement group.
        ``pods`` are the pipeline's stage pods as last seen; nothing is done before the
        pipeline's spec has been applied (converge calls this again once it has)."""
        applied = self._applied(ref.namespace, ref.name)
        if applied is None:
            return
        # Per pod event: only what the apply already computed, no rendering.
        groups = applied.group_labels
        current = applied.config_hash
        summaries = [
            StagePod.of(pod, group_label=LABEL_GROUP, hash_annotation=ANNOTATION_CONFIG_HASH)
            for pod in pods
        ]
        names = pods_to_release(summaries, current, groups)
        if not names:
            return
        patch = {"status": {"conditions": [released_condition(_now(), len(groups))]}}
        for name in names:
            try:
                await self.kube.patch_strategic(
                    object_path("v1", "pods", ref.namespace, name, "status"), patch
                )
            except KubeApiError as e:
                if e.status == 404:  # deleted meanwhile
                    continue
                event("Warning", "ReleaseFailed", f"Pod {name}: {e}")
                raise
        logger.info(
            "%s/%s: revision %s is whole; released pod(s) %s",
            ref.namespace,
            ref.name,
            current,
            ", ".join(names),
        )

    async def _write_status(self, ref: PipelineRef, status: OmniPipelineStatus) -> None:
        async with self.lock(ref):
            await self._write_status_locked(ref, status)

    async def _write_status_locked(self, ref: PipelineRef, status: OmniPipelineStatus) -> None:
        body = status_body(status)
        memory = self._memory(ref)
        if memory.written == body:
            return
        path = object_path(API_VERSION, PLURAL, ref.namespace, ref.name, "status")
        try:
            await self.kube.patch_merge(path, {"status": body})
        except KubeApiError as e:
            if e.status == 404:  # deleted meanwhile: nothing to report to
                return
            raise
        memory.written = body

    async def _list_children(self, ref: PipelineRef) -> dict[ObjectKey, dict[str, Any]]:
        found: dict[ObjectKey, dict[str, Any]] = {}
        for kind in CHILD_KINDS:
            listed = await self.kube.list(
                object_path(kind.api_version, kind.plural, ref.namespace),
                label_selector=f"{LABEL_PIPELINE}={ref.name}",
            )
            for item in listed.get("items", []):
                # Lists leave apiVersion and kind out of their items.
                obj = {"apiVersion": kind.api_version, "kind": kind.kind, **item}
                found[object_key(obj)] = obj
        return found

    async def still_wants(self, namespace: str, name: str, uid: str) -> bool:
        """Whether the pipeline ``namespace/name`` with ``uid`` exists and is not being
        deleted (a child deleted by garbage collection must not be put back)."""
        body = await self.kube.get(object_path(API_VERSION, PLURAL, namespace, name))
        if body is None:
            return False
        meta = body.get("metadata", {})
        return bool(meta.get("uid") == uid and not meta.get("deletionTimestamp"))


def config_generation(new_hash: str, children: Iterable[Mapping[str, Any]], generation: int) -> int:
    """The order of the revision that config ``new_hash`` gets: the one the live stage pods
    carry where they run that very config already (a scale change, a resync, an operator
    restart: the number must not move, or every pod would roll for nothing), else the
    pipeline's ``generation`` now, which grows with every spec change, so that a new config
    always orders after the old (routers prefer the newest complete revision)."""
    for child in children:
        if child.get("kind") != "Deployment":
            continue
        if _labels(child).get(LABEL_COMPONENT) != COMPONENT_STAGES:
            continue
        template = (child.get("spec") or {}).get("template") or {}
        annotations = (template.get("metadata") or {}).get("annotations") or {}
        if annotations.get(ANNOTATION_CONFIG_HASH) != new_hash:
            continue
        for container in (template.get("spec") or {}).get("containers") or []:
            for var in container.get("env") or []:
                if var.get("name") != REVISION_ENV:
                    continue
                order, sep, hash_ = str(var.get("value") or "").partition("-")
                # The number is trusted only beside the very hash it was given with.
                if sep and order.isdigit() and hash_ == new_hash:
                    return int(order)
    return generation


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


def refused_for_good(error: KubeApiError) -> bool:
    """Whether retrying the same request cannot help: the object itself was refused
    (400 Bad Request, 422 Invalid), not the moment (conflicts, throttling, outages)."""
    return error.status in (400, 422)


def parse_spec(raw_spec: Mapping[str, Any]) -> OmniPipelineSpec:
    """The validated spec; SpecRefused listing every problem, each with its field."""
    try:
        spec = OmniPipelineSpec.model_validate(dict(raw_spec))
    except ValidationError as e:
        issues = PipelineConfigError.from_validation_error(e, OmniPipelineSpec).issues
        raise SpecRefused(_describe(issues)) from None
    except PipelineConfigError as e:
        raise SpecRefused(_describe(e.issues)) from None
    issues = check_spec(spec)
    if issues:
        raise SpecRefused(_describe(issues))
    return spec


def _describe(issues: Iterable[tuple[str, str]]) -> str:
    return "; ".join(f"{join_path('spec', path)}: {message}" for path, message in issues)


def _status(body: Mapping[str, Any] | None) -> OmniPipelineStatus | None:
    if not body:
        return None
    try:
        return OmniPipelineStatus.model_validate(dict(body))
    except ValidationError:
        # A status written by someone else or an older operator: start afresh.
        return None


def _labels(body: Mapping[str, Any]) -> Mapping[str, str]:
    labels: Mapping[str, str] = (body.get("metadata") or {}).get("labels") or {}
    return labels


def _version(body: Mapping[str, Any]) -> str | None:
    version: str | None = (body.get("metadata") or {}).get("resourceVersion")
    return version


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
