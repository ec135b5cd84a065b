"""How a stage's replica pool picks the replica for a request: pure functions, no I/O.

The pool passes the replicas that may take the request now (alive, not draining, below
their in-flight limit) and the policy's state; it gets back a replica id and the next
state. Keeping the choice pure keeps it testable over thousands of requests without a
loop, and keeps the pool a thin shell around it.

Replica ids are the pool's stable counter values: never reused, so a removed replica
leaves a hole rather than shifting everyone after it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omni_runtime.config import RouterPolicy

__all__ = [
    "NoCandidatesError",
    "PolicyState",
    "ReplicaCandidate",
    "choose_replica",
    "rendezvous_score",
]


class NoCandidatesError(ValueError):
    """choose_replica was given no replica to choose from."""


@dataclass(frozen=True, slots=True)
class ReplicaCandidate:
    """A replica that may take the request, as a policy sees it."""

    replica_id: int
    # Requests the pool has on this replica and not yet seen finish.
    in_flight: int = 0
    # What sticky hashing weighs instead of the id, where given: the replica's address, so
    # that routers (whose ids differ) agree, and a replica re-added under a new id keeps
    # its keys.
    name: str = ""

    @property
    def sticky_name(self) -> str:
        return self.name or f"#{self.replica_id}"


@dataclass(frozen=True, slots=True)
class PolicyState:
    """What a policy remembers between choices."""

    # The replica id round-robin (and least-outstanding's tie-break) chose last; the next
    # choice is the first id after it. An id, not an index, so that removals and
    # additions neither skip nor repeat a replica.
    cursor: int = -1


def choose_replica(
    policy: RouterPolicy,
    candidates: Sequence[ReplicaCandidate],
    state: PolicyState,
    sticky_key: str | None = None,
) -> tuple[int, PolicyState]:
    """The replica id for the next request under ``policy``, and the policy's next state.

    ``sticky_key`` is what the sticky policy keeps together (a user or session id, else
    the request id); the other policies ignore it.
    """
    if not candidates:
        raise NoCandidatesError(f"policy {policy!r}: no replica to choose from")
    ids = [c.replica_id for c in candidates]
    if len(set(ids)) != len(ids):
        raise ValueError(f"policy {policy!r}: replica ids are not unique: {sorted(ids)}")
    if policy == "round-robin":
        chosen = _next_after(state.cursor, ids)
    elif policy == "least-outstanding-requests":
        fewest = min(c.in_flight for c in candidates)
        chosen = _next_after(
            state.cursor, [c.replica_id for c in candidates if c.in_flight == fewest]
        )
    elif policy == "sticky":
        if sticky_key is None:
            raise ValueError("policy 'sticky' needs a sticky_key (e.g. the user or request id)")
        chosen = max(
            candidates, key=lambda c: (rendezvous_score(sticky_key, c.sticky_name), c.replica_id)
        ).replica_id
        # The cursor is round-robin's; sticky choices leave it where it was.
        return chosen, state
    else:
        raise ValueError(
            f"unknown router policy {policy!r}; expected round-robin, "
            "least-outstanding-requests or sticky"
        )
    return chosen, PolicyState(cursor=chosen)


def rendezvous_score(key: str, replica: str) -> int:
    """The weight of ``replica`` for ``key`` in highest-random-weight hashing.

    The key goes to the replica with the highest score, so adding a replica moves only
    the keys it now wins and removing one moves only the keys it had. blake2b rather than
    ``hash()``: the choice must agree across processes and restarts (PYTHONHASHSEED).
    """
    digest = hashlib.blake2b(f"{replica}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _next_after(cursor: int, ids: Sequence[int]) -> int:
    """The smallest id after ``cursor``, wrapping round to the smallest id."""
    later = [replica_id for replica_id in ids if replica_id > cursor]
    return min(later) if later else min(ids)
