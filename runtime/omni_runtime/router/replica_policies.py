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
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omni_runtime.config import RouterPolicy

__all__ = [
    "ADAPTER_AFFINITY_SLACK",
    "NoCandidatesError",
    "PolicyState",
    "ReplicaCandidate",
    "WorkCalibration",
    "adapter_affinity",
    "calibrated",
    "choose_replica",
    "costs",
    "diffusion_work",
    "rendezvous_score",
]

# The unit of a diffusion request's work: one step of one 1024x1024 image.
WORK_PIXELS = 1024 * 1024
# What a request that says neither is taken to make: diffusers' pipelines' usual defaults
# (50 steps, 1024x1024), which the stage's defaultSamplingParams refine.
DEFAULT_STEPS = 50
DEFAULT_SIDE = 1024
# How much a replica's calibration weighs its latest request against those before it.
CALIBRATION_WEIGHT = 0.3


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
    # Least-outstanding-work's: the work of its requests in flight (diffusion_work's
    # units; 1 for a request that has no estimate), and what it takes for each request
    # and each unit (its own execution times, calibrated).
    outstanding_work: float = 0.0
    seconds_per_work: float = 1.0
    seconds_per_request: float = 0.0
    # LoRA affinity: whether the replica holds the request's adapter loaded.
    holds_adapter: bool = False

    @property
    def outstanding_seconds(self) -> float:
        return (
            self.in_flight * self.seconds_per_request
            + self.outstanding_work * self.seconds_per_work
        )

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
    elif policy == "least-outstanding-work":
        least = min(c.outstanding_seconds for c in candidates)
        # Equal work within float rounding ties, and ties go round.
        tied = [c.replica_id for c in candidates if c.outstanding_seconds <= least * (1 + 1e-9)]
        chosen = _next_after(state.cursor, tied)
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
            "least-outstanding-requests, least-outstanding-work or sticky"
        )
    return chosen, PolicyState(cursor=chosen)


# How many more requests in flight than the least loaded candidate a replica that holds the
# request's adapter may have and still be preferred: past it, loading the adapter elsewhere
# costs less than the wait (an adapter loads in milliseconds to a second; a request queued
# behind a few others waits seconds).
ADAPTER_AFFINITY_SLACK = 2


def adapter_affinity(
    candidates: Sequence[ReplicaCandidate], adapter: str, slack: int = ADAPTER_AFFINITY_SLACK
) -> list[ReplicaCandidate]:
    """The candidates a request with ``adapter`` should choose among, before the policy
    picks one of them: among the ones within ``slack`` requests of the least loaded, those
    that hold it; where none does, the adapter's home among them (highest random weight of
    the adapter's name and the replica's, as sticky keys are placed), so that each adapter
    keeps to a few replicas and every router sends it to the same ones."""
    if not candidates:
        return []
    bound = min(c.in_flight for c in candidates) + slack
    near = [c for c in candidates if c.in_flight <= bound]
    holders = [c for c in near if c.holds_adapter]
    if holders:
        return holders
    home = max(near, key=lambda c: (rendezvous_score(adapter, c.sticky_name), c.replica_id))
    return [home]


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


def diffusion_work(params: Mapping[str, Any]) -> float:
    """The work of a diffusion request whose params (defaults merged) are ``params``:
    steps x pixels (in 1024x1024 images) x images, as the DiT's compute grows. Guidance,
    which doubles every family's step, is the same for a stage's requests and calibration
    takes it in; so does a step cache's share of the steps. A value of the wrong type counts
    as absent (the DiT refuses it)."""

    def number(name: str, default: int) -> float:
        value = params.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return float(value)
        return float(default)

    steps = number("num_inference_steps", DEFAULT_STEPS)
    pixels = number("height", DEFAULT_SIDE) * number("width", DEFAULT_SIDE)
    return steps * pixels / WORK_PIXELS * number("num_images", 1) * number("num_frames", 1)


@dataclass(frozen=True, slots=True)
class WorkCalibration:
    """What a replica's requests took: seconds = per_request + per_work x work, fitted to
    its execution times by least squares, the latest weighing most (moving sums). A fixed
    cost per request and a cost per unit, because a small image's time is mostly the
    former (the router, the encoder, the VAE) and a large one's the latter; with one
    parameter, a replica holding small requests would look idle."""

    weight: float = 0.0
    work: float = 0.0
    seconds: float = 0.0
    work_squared: float = 0.0
    work_seconds: float = 0.0

    @property
    def fit(self) -> tuple[float, float]:
        """(seconds per request, seconds per unit of work), neither negative."""
        spread = self.weight * self.work_squared - self.work * self.work
        if spread <= 1e-12 * max(1.0, self.weight * self.work_squared):
            # Requests of one size so far: their time is all per unit.
            return 0.0, self.seconds / self.work if self.work > 0 else 0.0
        per_work = (self.weight * self.work_seconds - self.work * self.seconds) / spread
        per_work = max(per_work, 0.0)
        per_request = max((self.seconds - per_work * self.work) / self.weight, 0.0)
        return per_request, per_work


def calibrated(
    calibration: WorkCalibration | None, execute_s: float, work: float
) -> WorkCalibration | None:
    """A replica's calibration after a request of ``work`` units ran ``execute_s`` seconds
    on it (the first request starts it; one that ran no time teaches nothing)."""
    if not (execute_s > 0 and work > 0 and math.isfinite(execute_s)):
        return calibration
    keep = 1.0 - CALIBRATION_WEIGHT if calibration is not None else 0.0
    old = calibration or WorkCalibration()
    return WorkCalibration(
        weight=old.weight * keep + 1.0,
        work=old.work * keep + work,
        seconds=old.seconds * keep + execute_s,
        work_squared=old.work_squared * keep + work * work,
        work_seconds=old.work_seconds * keep + work * execute_s,
    )


def costs(
    calibrations: Sequence[WorkCalibration | None],
) -> list[tuple[float, float]]:
    """Each replica's (seconds per request, seconds per unit of work): its own fit, or, for
    a replica that has run nothing yet, the others' mean (as fast as they are)."""
    fits = [c.fit for c in calibrations if c is not None]
    usual = (
        (sum(f[0] for f in fits) / len(fits), sum(f[1] for f in fits) / len(fits))
        if fits
        else (0.0, 1.0)
    )
    return [c.fit if c is not None else usual for c in calibrations]
