"""The stage pods' readiness gate: a revision's pods take traffic only once it is whole.

Each placement group is its own Deployment, and Kubernetes rolls each on its own: in a
config rollout the old DiT pods can be gone before the new encoder pod has loaded, and
then no revision has a replica of every stage (the router refuses to pair two: it
answers 503 until one is whole again). So every stage pod carries the readiness gate
``READINESS_GATE``: its Ready condition (and with it its EndpointSlice entry and the
Deployment's progress) waits for a pod condition of that type, which the operator sets
True on a revision's pods once every placement group of that revision has a pod whose
containers are ready. Until then each Deployment keeps its old pods (maxUnavailable
counts unready pods), so the old revision stays whole and keeps serving.

Rules, as ``pods_to_release`` applies them:
- Only the pipeline's current config (its hash) is released: a pod of an older one that
  is not Ready yet belongs to a revision being replaced.
- A pod counts toward its group once its ContainersReady condition is True and it is not
  being deleted. Once every group has one, every pod of that config is released, those
  still loading too: the gate only holds a revision back until it is whole, and each pod's
  own readiness probe still decides when it takes traffic. A pod added later to a whole
  revision (a scale-up, a replacement) is released at once, for the same reason.
- The gate is never set False again: once a pod took traffic, losing a replica elsewhere
  is the router's concern (it re-chooses the revision per request), not a reason to take
  this one out too.

Pure functions; the reconciler patches the pods (their status subresource).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .api import GROUP

READINESS_GATE = f"{GROUP}/revision-complete"
RELEASED_REASON = "RevisionComplete"


@dataclass(frozen=True)
class StagePod:
    """What the gate needs of one stage pod."""

    name: str
    group: str
    config_hash: str
    containers_ready: bool
    released: bool
    deleting: bool

    @classmethod
    def of(cls, body: Mapping[str, Any], *, group_label: str, hash_annotation: str) -> StagePod:
        metadata = body.get("metadata") or {}
        conditions = {
            str(c.get("type")): c.get("status") == "True"
            for c in (body.get("status") or {}).get("conditions") or []
        }
        return cls(
            name=str(metadata.get("name", "")),
            group=str((metadata.get("labels") or {}).get(group_label, "")),
            config_hash=str((metadata.get("annotations") or {}).get(hash_annotation, "")),
            containers_ready=conditions.get("ContainersReady", False),
            released=conditions.get(READINESS_GATE, False),
            deleting=bool(metadata.get("deletionTimestamp")),
        )


def pods_to_release(
    pods: Iterable[StagePod], config_hash: str, groups: Collection[str]
) -> list[str]:
    """The names of the pods of config ``config_hash`` whose gate is to be set now: every
    live one not yet released, once each of ``groups`` (placement group label values) has
    a live pod of that config with its containers ready; none before."""
    current = [pod for pod in pods if pod.config_hash == config_hash and not pod.deleting]
    ready_groups = {pod.group for pod in current if pod.containers_ready}
    if not groups or not set(groups) <= ready_groups:
        return []
    return sorted(pod.name for pod in current if not pod.released)


def released_condition(now: str, groups: int) -> dict[str, str]:
    """The pod condition that opens the gate."""
    return {
        "type": READINESS_GATE,
        "status": "True",
        "reason": RELEASED_REASON,
        "message": f"every placement group of this revision ({groups}) has a ready pod",
        "lastTransitionTime": now,
    }
