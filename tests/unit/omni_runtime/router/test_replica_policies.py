"""Replica policies: round-robin, least-outstanding-requests and sticky, as pure choices."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from omni_runtime.config import RouterPolicy
from omni_runtime.router.replica_policies import (
    NoCandidatesError,
    PolicyState,
    ReplicaCandidate,
    WorkCalibration,
    calibrated,
    choose_replica,
    diffusion_work,
    rendezvous_score,
)

KEYS = [f"user-{i}" for i in range(1000)]


def candidates(*ids: int) -> list[ReplicaCandidate]:
    return [ReplicaCandidate(replica_id) for replica_id in ids]


def run(
    policy: RouterPolicy, pool: Sequence[ReplicaCandidate], n: int, state: PolicyState
) -> tuple[list[int], PolicyState]:
    chosen = []
    for _ in range(n):
        replica_id, state = choose_replica(policy, pool, state)
        chosen.append(replica_id)
    return chosen, state


def sticky_owner(key: str, pool: Sequence[ReplicaCandidate]) -> int:
    replica_id, _ = choose_replica("sticky", pool, PolicyState(), key)
    return replica_id


@pytest.mark.parametrize(
    "policy", ["round-robin", "least-outstanding-requests", "least-outstanding-work", "sticky"]
)
def test_no_candidates_is_a_clear_error(policy: RouterPolicy) -> None:
    with pytest.raises(NoCandidatesError, match="no replica to choose from"):
        choose_replica(policy, [], PolicyState(), "key")
    assert issubclass(NoCandidatesError, ValueError)


def test_unknown_policy_and_duplicate_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown router policy 'random'"):
        choose_replica("random", candidates(0), PolicyState())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not unique"):
        choose_replica("round-robin", candidates(0, 0), PolicyState())


def test_sticky_needs_a_key() -> None:
    with pytest.raises(ValueError, match="sticky_key"):
        choose_replica("sticky", candidates(0, 1), PolicyState())


def test_round_robin_cycles_in_id_order_and_evenly() -> None:
    chosen, state = run("round-robin", candidates(0, 1, 2), 300, PolicyState())
    assert chosen[:6] == [0, 1, 2, 0, 1, 2]
    assert Counter(chosen) == {0: 100, 1: 100, 2: 100}
    assert state == PolicyState(cursor=2)


def test_round_robin_skips_a_hole_and_stays_even() -> None:
    # Replica 1 was removed: the rotation goes round the others without favouring one.
    chosen, _ = run("round-robin", candidates(0, 2, 3), 300, PolicyState(cursor=0))
    assert chosen[:4] == [2, 3, 0, 2]
    assert Counter(chosen) == {0: 100, 2: 100, 3: 100}


def test_round_robin_goes_on_after_its_last_choice_is_removed() -> None:
    replica_id, _ = choose_replica("round-robin", candidates(0, 2), PolicyState(cursor=1))
    assert replica_id == 2


def test_round_robin_takes_in_a_new_replica_on_its_next_turn() -> None:
    first, state = run("round-robin", candidates(0, 1), 3, PolicyState())
    assert first == [0, 1, 0]
    after, _ = run("round-robin", candidates(0, 1, 2), 300, state)
    assert after[:3] == [1, 2, 0]
    assert Counter(after) == {0: 100, 1: 100, 2: 100}


def test_least_outstanding_prefers_the_idle_replica() -> None:
    pool = [ReplicaCandidate(0, 3), ReplicaCandidate(1, 0), ReplicaCandidate(2, 5)]
    for cursor in (-1, 0, 1, 2):
        assert choose_replica("least-outstanding-requests", pool, PolicyState(cursor))[0] == 1


def test_least_outstanding_rotates_among_ties() -> None:
    pool = [ReplicaCandidate(0, 1), ReplicaCandidate(1, 4), ReplicaCandidate(2, 1)]
    chosen, _ = run("least-outstanding-requests", pool, 4, PolicyState())
    assert chosen == [0, 2, 0, 2]


def test_least_outstanding_balances_a_growing_load() -> None:
    # Requests that never finish: each choice adds one to the replica it picked.
    load = {0: 0, 1: 0, 2: 0}
    state = PolicyState()
    for _ in range(300):
        pool = [ReplicaCandidate(i, n) for i, n in load.items()]
        replica_id, state = choose_replica("least-outstanding-requests", pool, state)
        load[replica_id] += 1
    assert load == {0: 100, 1: 100, 2: 100}


def test_least_work_weighs_work_not_requests() -> None:
    # One 1024x1024 50-step image against three 256x256 4-step ones.
    big = diffusion_work({"height": 1024, "width": 1024, "num_inference_steps": 50})
    small = diffusion_work({"height": 256, "width": 256, "num_inference_steps": 4})
    pool = [
        ReplicaCandidate(0, 1, outstanding_work=big),
        ReplicaCandidate(1, 3, outstanding_work=3 * small),
    ]
    assert choose_replica("least-outstanding-work", pool, PolicyState())[0] == 1
    assert choose_replica("least-outstanding-requests", pool, PolicyState())[0] == 0


def test_least_work_weighs_each_replicas_own_speed() -> None:
    # Replica 0 has twice the work but runs it five times as fast.
    pool = [
        ReplicaCandidate(0, 2, outstanding_work=20, seconds_per_work=0.1),
        ReplicaCandidate(1, 1, outstanding_work=10, seconds_per_work=0.5),
    ]
    assert choose_replica("least-outstanding-work", pool, PolicyState())[0] == 0


def test_least_work_rotates_among_idle_replicas() -> None:
    chosen, state = run("least-outstanding-work", candidates(0, 1, 2), 4, PolicyState())
    assert chosen == [0, 1, 2, 0]
    assert state == PolicyState(cursor=0)


def test_diffusion_work_is_steps_times_pixels_times_images() -> None:
    assert diffusion_work({"height": 1024, "width": 1024, "num_inference_steps": 1}) == 1.0
    assert diffusion_work(
        {"height": 512, "width": 512, "num_inference_steps": 8, "num_images": 2}
    ) == pytest.approx(4.0)
    # What it does not say is taken as diffusers' usual defaults (50 steps, 1024x1024);
    # a value of the wrong type counts as absent.
    assert diffusion_work({}) == 50.0
    assert diffusion_work({"num_inference_steps": True, "height": "big"}) == 50.0


def test_calibration_fits_a_cost_per_request_and_per_unit() -> None:
    # Requests of one size: their time is all per unit.
    first = calibrated(None, 2.0, 4.0)
    assert first is not None
    assert first.fit == (0.0, 0.5)
    # Sizes that differ: 0.1 s a request and 0.5 s a unit, found from three of them.
    fitted: WorkCalibration | None = None
    for work in (0.02, 1.0, 0.5):
        fitted = calibrated(fitted, 0.1 + 0.5 * work, work)
    assert fitted is not None
    per_request, per_work = fitted.fit
    assert per_request == pytest.approx(0.1)
    assert per_work == pytest.approx(0.5)
    # A request that ran no time (refused, or no estimate) teaches nothing.
    assert calibrated(first, 0.0, 4.0) is first
    assert calibrated(None, float("nan"), 1.0) is None


def test_least_work_counts_each_requests_fixed_cost() -> None:
    # Replica 0 holds five small requests, replica 1 one large: at 0.1 s a request and
    # 0.5 s a unit, 0 is busy for 0.51 s and 1 for 0.6 s.
    pool = [
        ReplicaCandidate(
            0, 5, outstanding_work=0.02, seconds_per_work=0.5, seconds_per_request=0.1
        ),
        ReplicaCandidate(1, 1, outstanding_work=1.0, seconds_per_work=0.5, seconds_per_request=0.1),
    ]
    assert choose_replica("least-outstanding-work", pool, PolicyState())[0] == 0
    pool[0] = ReplicaCandidate(
        0, 6, outstanding_work=0.024, seconds_per_work=0.5, seconds_per_request=0.1
    )
    assert choose_replica("least-outstanding-work", pool, PolicyState())[0] == 1


def test_sticky_is_stable_and_leaves_the_cursor() -> None:
    pool = candidates(0, 1, 2, 3)
    for key in KEYS[:50]:
        owners = {choose_replica("sticky", pool, PolicyState(7), key) for _ in range(3)}
        assert len(owners) == 1
        ((_, state),) = owners
        assert state == PolicyState(7)


def test_sticky_spreads_keys_over_replicas() -> None:
    counts = Counter(sticky_owner(key, candidates(0, 1, 2, 3)) for key in KEYS)
    assert set(counts) == {0, 1, 2, 3}
    assert all(150 <= n <= 350 for n in counts.values()), counts


def test_sticky_adding_a_replica_moves_only_the_keys_it_wins() -> None:
    before = {key: sticky_owner(key, candidates(0, 1, 2, 3)) for key in KEYS}
    after = {key: sticky_owner(key, candidates(0, 1, 2, 3, 4)) for key in KEYS}
    moved = [key for key in KEYS if before[key] != after[key]]
    assert all(after[key] == 4 for key in moved)
    # About a fifth of the keys, not a reshuffle.
    assert 120 <= len(moved) <= 280, len(moved)


def test_sticky_removing_a_replica_moves_only_its_keys() -> None:
    before = {key: sticky_owner(key, candidates(0, 1, 2, 3)) for key in KEYS}
    after = {key: sticky_owner(key, candidates(0, 1, 3)) for key in KEYS}
    moved = {key for key in KEYS if before[key] != after[key]}
    assert moved == {key for key in KEYS if before[key] == 2}


def test_sticky_follows_replica_names_not_ids() -> None:
    # Two routers number the same replicas differently; with addresses they agree.
    addresses = ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"]
    router_a = [ReplicaCandidate(i, name=a) for i, a in enumerate(addresses)]
    router_b = [ReplicaCandidate(10 + i, name=a) for i, a in enumerate(reversed(addresses))]
    names_a = {c.replica_id: c.name for c in router_a}
    names_b = {c.replica_id: c.name for c in router_b}
    for key in KEYS[:200]:
        assert names_a[sticky_owner(key, router_a)] == names_b[sticky_owner(key, router_b)]


def test_rendezvous_score_is_pinned() -> None:
    # Every router (and every router version) must place a key alike: changing the hash
    # would move every session at the next upgrade.
    assert rendezvous_score("user-1", "#0") == 3139604873038778107
