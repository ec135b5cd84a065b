"""The contract of omni_runtime.router.job_store.JobStore, once for every backend.

A backend's test module subclasses ``JobStoreContract`` with an ``open_store`` fixture: a
function that opens another store on the same backing (the same directory, the same Redis
and prefix), as a second router replica would, each closed at the fixture's end. The
class's name does not start with "Test", so pytest collects its tests only in the
subclasses.

The clock is passed in (``now``, ``created_at``, ``expires_at``), never slept on. It runs
an hour ahead of the real one: a Redis store also hands ``expires_at`` to Redis' own key
expiry, which must not fire while a test runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Literal

import pytest

from omni_runtime.router.job_store import JobStore, QueueFullError, VideoJob

T0 = int(time.time()) + 3600
LEASE_S = 30.0

OpenStore = Callable[[], JobStore]


def job_id(n: int) -> str:
    return f"video_{n:032x}"


def make_job(n: int, *, created_at: int | None = None, **fields: Any) -> VideoJob:
    values: dict[str, Any] = {
        "id": job_id(n),
        "created_at": T0 + n if created_at is None else created_at,
        "status": "queued",
        "model": "tiny-video",
        "prompt": f"prompt {n}",
        "size": "64x64",
        "seconds": "4",
    }
    return VideoJob(**(values | fields))


async def add(store: JobStore, *jobs: VideoJob, max_active: int = 1000) -> None:
    for job in jobs:
        await store.create(job, max_active=max_active)


Order = Literal["asc", "desc"]
ORDERS: tuple[Order, ...] = ("asc", "desc")


async def list_all(store: JobStore, order: Order = "asc", limit: int = 1000) -> list[str]:
    jobs, _ = await store.list(after=None, limit=limit, order=order)
    return [job.id for job in jobs]


class JobStoreContract:
    @pytest.fixture
    def store(self, open_store: OpenStore) -> JobStore:
        return open_store()

    # --- create and get -----------------------------------------------------------------

    async def test_create_get_round_trip(self, store: JobStore) -> None:
        job = make_job(
            1,
            prompt="a cat on a skateboard, ünïcode ✓",
            params={
                "seed": 2**62 + 1,
                "guidance": 0.1 + 0.2,
                "steps": [1, 2, 3],
                "empty": {},
                "none": [],
                "nested": {"a": [None, True, "x"]},
            },
            progress=7,
        )
        await store.create(job, max_active=10, input_bytes=b"\x89PNG\x00\xff" * 1000)
        assert await store.get(job.id) == job
        assert await store.get_input(job.id) == b"\x89PNG\x00\xff" * 1000
        assert await store.get(job_id(2)) is None
        await store.create(make_job(2), max_active=10)
        assert await store.get_input(job_id(2)) is None
        assert await store.get_content(job.id) is None

    async def test_create_rejects_a_used_id_and_bad_records(self, store: JobStore) -> None:
        await add(store, make_job(1))
        with pytest.raises(ValueError, match="in use"):
            await store.create(make_job(1, prompt="another"), max_active=10)
        with pytest.raises(ValueError, match="status"):
            await store.create(make_job(2, status="paused"), max_active=10)
        with pytest.raises(TypeError):
            await store.create(make_job(3, params={"x": object()}), max_active=10)
        with pytest.raises(ValueError, match="job id"):
            await store.create(make_job(4, id="../../etc/passwd"), max_active=10)
        assert await list_all(store) == [job_id(1)]
        assert (await store.get(job_id(1))) == make_job(1)

    async def test_max_active_counts_queued_and_in_progress_only(self, store: JobStore) -> None:
        await add(store, make_job(1), make_job(2), make_job(3), max_active=3)
        with pytest.raises(QueueFullError):
            await store.create(make_job(4), max_active=3, input_bytes=b"img")
        assert await store.get(job_id(4)) is None
        assert await store.get_input(job_id(4)) is None
        claimed = await store.claim("r1", now=T0, lease_s=LEASE_S, max_attempts=3)
        assert claimed is not None
        with pytest.raises(QueueFullError):
            await store.create(make_job(4), max_active=3)
        assert await store.update(claimed.id, owner="r1", status="completed") is not None
        await store.create(make_job(4), max_active=3)
        assert await store.update(job_id(2), owner=None, status="failed") is not None
        await store.create(make_job(5), max_active=3)
        with pytest.raises(QueueFullError):
            await store.create(make_job(6), max_active=3)
        # A job put back in the queue counts again.
        assert await store.update(job_id(2), owner=None, status="queued") is not None
        await store.delete(job_id(5))
        with pytest.raises(QueueFullError):
            await store.create(make_job(6), max_active=3)

    async def test_racing_creates_never_pass_the_limit(self, open_store: OpenStore) -> None:
        stores = [open_store(), open_store()]

        async def create(n: int) -> bool:
            try:
                await stores[n % 2].create(make_job(n), max_active=7)
            except QueueFullError:
                return False
            return True

        created = await asyncio.gather(*(create(n) for n in range(40)))
        assert sum(created) == 7
        assert sorted(await list_all(stores[0])) == sorted(
            job_id(n) for n, ok in enumerate(created) if ok
        )

    # --- list ---------------------------------------------------------------------------

    async def test_list_orders_by_created_at_then_id(self, store: JobStore) -> None:
        # Created out of order, with ties of created_at broken by id.
        await add(
            store,
            make_job(5, created_at=T0 + 2),
            make_job(3, created_at=T0 + 1),
            make_job(9, created_at=T0),
            make_job(4, created_at=T0 + 1),
            make_job(1, created_at=T0 + 2),
        )
        ascending = [job_id(n) for n in (9, 3, 4, 1, 5)]
        assert await list_all(store) == ascending
        assert await list_all(store, "desc") == ascending[::-1]

    async def test_list_pages_with_cursors(self, store: JobStore) -> None:
        await add(store, *(make_job(n, created_at=T0 + n // 2) for n in range(7)))
        for order in ORDERS:
            expected = await list_all(store, order)
            assert len(expected) == 7
            seen: list[str] = []
            after: str | None = None
            pages: list[bool] = []
            while True:
                jobs, has_more = await store.list(after=after, limit=3, order=order)
                seen += [job.id for job in jobs]
                pages.append(has_more)
                if not has_more:
                    break
                after = jobs[-1].id
            assert seen == expected
            assert pages == [True, True, False]
            # A page that ends exactly at the last job says nothing follows.
            jobs, has_more = await store.list(after=expected[3], limit=3, order=order)
            assert [job.id for job in jobs] == expected[4:]
            assert not has_more
            jobs, has_more = await store.list(after=expected[-1], limit=3, order=order)
            assert (jobs, has_more) == ([], False)

    async def test_list_of_nothing_and_unknown_cursors(self, store: JobStore) -> None:
        assert await store.list(after=None, limit=5, order="asc") == ([], False)
        await add(store, make_job(1))
        with pytest.raises(ValueError, match=job_id(2)):
            await store.list(after=job_id(2), limit=5, order="asc")
        await store.delete(job_id(1))
        with pytest.raises(ValueError, match=job_id(1)):
            await store.list(after=job_id(1), limit=5, order="desc")

    # --- update -------------------------------------------------------------------------

    async def test_update_checks_the_owner(self, store: JobStore) -> None:
        await add(store, make_job(1))
        updated = await store.update(job_id(1), owner=None, progress=10)
        assert updated == make_job(1, progress=10)
        # Nobody owns it yet: an owner's update is a stale one.
        assert await store.update(job_id(1), owner="r1", progress=20) is None
        claimed = await store.claim("r1", now=T0, lease_s=LEASE_S, max_attempts=3)
        assert claimed is not None
        assert claimed.owner == "r1"
        assert await store.update(job_id(1), owner="r2", progress=99, status="failed") is None
        assert await store.get(job_id(1)) == claimed
        done = await store.update(
            job_id(1),
            owner="r1",
            status="completed",
            progress=100,
            completed_at=T0 + 5,
            expires_at=T0 + 500,
        )
        assert done is not None
        assert (done.status, done.progress, done.completed_at, done.expires_at) == (
            "completed",
            100,
            T0 + 5,
            T0 + 500,
        )
        assert (done.owner, done.attempts, done.prompt) == ("r1", 1, claimed.prompt)
        assert await store.get(job_id(1)) == done
        assert await store.update(job_id(1), owner="r1") == done
        assert await store.update(job_id(2), owner=None, progress=1) is None
        assert await store.get(job_id(2)) is None

    async def test_update_validates_changes(self, store: JobStore) -> None:
        await add(store, make_job(1))
        with pytest.raises(ValueError, match="never changes"):
            await store.update(job_id(1), owner=None, id=job_id(2))
        with pytest.raises(ValueError, match="never changes"):
            await store.update(job_id(1), owner=None, created_at=T0)
        with pytest.raises(TypeError, match="colour"):
            await store.update(job_id(1), owner=None, colour="red")
        with pytest.raises(ValueError, match="progress"):
            await store.update(job_id(1), owner=None, progress="half")
        with pytest.raises(ValueError, match="status"):
            await store.update(job_id(1), owner=None, status="paused")
        with pytest.raises(TypeError):
            await store.update(job_id(1), owner=None, params={"x": object()})
        assert await store.get(job_id(1)) == make_job(1)
        error = {"code": "internal_error", "message": "the DiT stage failed"}
        failed = await store.update(job_id(1), owner=None, status="failed", error=error)
        assert failed is not None
        assert failed.error == error
        assert await store.update(job_id(1), owner=None, error=None) == make_job(1, status="failed")

    # --- claim, leases, attempts --------------------------------------------------------

    async def test_claim_takes_the_oldest_first(self, store: JobStore) -> None:
        await add(
            store,
            make_job(3, created_at=T0 + 1),
            make_job(2, created_at=T0 + 1),
            make_job(1, created_at=T0 + 5),
            make_job(4, created_at=T0 + 1, status="completed"),
        )
        order = []
        for owner in ("r1", "r2", "r1"):
            job = await store.claim(owner, now=T0 + 10, lease_s=LEASE_S, max_attempts=3)
            assert job is not None
            assert (job.status, job.owner, job.lease_until, job.attempts) == (
                "in_progress",
                owner,
                T0 + 10 + LEASE_S,
                1,
            )
            assert await store.get(job.id) == job
            order.append(job.id)
        assert order == [job_id(2), job_id(3), job_id(1)]
        assert await store.claim("r3", now=T0 + 10, lease_s=LEASE_S, max_attempts=3) is None

    async def test_claim_takes_the_job_of_a_dead_router(self, store: JobStore) -> None:
        await add(store, make_job(1))
        first = await store.claim("r1", now=T0, lease_s=LEASE_S, max_attempts=3)
        assert first is not None
        assert first.lease_until == T0 + LEASE_S
        # The lease is held up to and including lease_until.
        assert await store.claim("r2", now=T0 + LEASE_S, lease_s=LEASE_S, max_attempts=3) is None
        second = await store.claim("r2", now=T0 + LEASE_S + 1, lease_s=LEASE_S, max_attempts=3)
        assert second is not None
        assert (second.id, second.owner, second.attempts) == (job_id(1), "r2", 2)
        assert second.lease_until == T0 + 2 * LEASE_S + 1
        # The first router, back from a pause, has lost it: it must stop and write nothing.
        assert not await store.renew(job_id(1), "r1", T0 + 100)
        assert await store.update(job_id(1), owner="r1", progress=50) is None
        assert await store.get(job_id(1)) == second

    async def test_renewed_lease_keeps_the_job(self, store: JobStore) -> None:
        await add(store, make_job(1))
        assert await store.renew(job_id(1), "r1", T0 + 100) is False  # nobody owns it
        assert await store.claim("r1", now=T0, lease_s=LEASE_S, max_attempts=3) is not None
        assert await store.renew(job_id(1), "r1", T0 + 100.5)
        renewed = await store.get(job_id(1))
        assert renewed is not None
        assert (renewed.lease_until, renewed.owner, renewed.attempts) == (T0 + 100.5, "r1", 1)
        assert await store.claim("r2", now=T0 + 100, lease_s=LEASE_S, max_attempts=3) is None
        assert not await store.renew(job_id(1), "r2", T0 + 200)
        assert not await store.renew(job_id(2), "r1", T0 + 200)
        taken = await store.claim("r2", now=T0 + 101, lease_s=LEASE_S, max_attempts=3)
        assert taken is not None
        assert taken.owner == "r2"

    async def test_lost_job_fails_at_max_attempts(self, store: JobStore) -> None:
        await add(store, make_job(1), make_job(2, created_at=T0 + 50))
        now = float(T0)
        for attempt, owner in enumerate(("r1", "r2"), start=1):
            job = await store.claim(owner, now=now, lease_s=LEASE_S, max_attempts=2)
            assert job is not None
            assert (job.id, job.attempts) == (job_id(1), attempt)
            now += LEASE_S + 1
        # Job 1 has been started twice, both routers died: it fails, and job 2 is taken.
        taken = await store.claim("r3", now=now, lease_s=LEASE_S, max_attempts=2, lost_ttl_s=600)
        assert taken is not None
        assert (taken.id, taken.owner, taken.attempts) == (job_id(2), "r3", 1)
        lost = await store.get(job_id(1))
        assert lost is not None
        assert (lost.status, lost.owner, lost.lease_until, lost.attempts) == (
            "failed",
            None,
            None,
            2,
        )
        assert lost.error is not None
        assert lost.error["code"] == "job_lost"
        assert "stopped" in lost.error["message"]
        assert (lost.completed_at, lost.expires_at) == (int(now), int(now) + 600)
        # A failed job is nobody's to take, and no longer counts as active.
        assert await store.claim("r4", now=now + 1000, lease_s=1, max_attempts=2) is not None
        assert await store.claim("r4", now=now + 2000, lease_s=1, max_attempts=2) is None
        await store.create(make_job(3), max_active=1)

    async def test_lost_job_without_ttl_keeps_its_expiry(self, store: JobStore) -> None:
        await add(store, make_job(1))
        assert await store.claim("r1", now=T0, lease_s=LEASE_S, max_attempts=1) is not None
        assert await store.claim("r2", now=T0 + 100, lease_s=LEASE_S, max_attempts=1) is None
        lost = await store.get(job_id(1))
        assert lost is not None
        assert (lost.status, lost.expires_at, lost.completed_at) == ("failed", None, T0 + 100)

    async def test_a_job_handed_back_is_claimed_again(self, store: JobStore) -> None:
        await add(store, make_job(1))
        assert await store.claim("r1", now=T0, lease_s=LEASE_S, max_attempts=3) is not None
        handed = await store.update(job_id(1), owner="r1", status="queued", lease_until=0.0)
        assert handed is not None
        again = await store.claim("r2", now=T0 + 1, lease_s=LEASE_S, max_attempts=3)
        assert again is not None
        assert (again.owner, again.attempts, again.status) == ("r2", 2, "in_progress")

    async def test_release_gives_a_job_back_without_costing_an_attempt(
        self, store: JobStore
    ) -> None:
        await add(store, make_job(1), make_job(2, created_at=T0 + 100))
        claimed = await store.claim("r1", now=T0, lease_s=LEASE_S, max_attempts=1)
        assert claimed is not None
        assert await store.update(job_id(1), owner="r1", progress=40) is not None
        assert not await store.release(job_id(1), "r2")
        assert not await store.release(job_id(2), "r1")
        assert not await store.release(job_id(3), "r1")
        assert await store.release(job_id(1), "r1")
        assert await store.get(job_id(1)) == make_job(1)
        assert not await store.release(job_id(1), "r1")  # given back already
        assert not await store.renew(job_id(1), "r1", T0 + 100)
        # Taken at once (no lease to lapse), and max_attempts=1 still lets it run.
        again = await store.claim("r2", now=T0 + 1, lease_s=LEASE_S, max_attempts=1)
        assert again is not None
        assert (again.id, again.owner, again.attempts) == (job_id(1), "r2", 1)
        assert await store.update(job_id(1), owner="r2", status="completed") is not None
        assert not await store.release(job_id(1), "r2")  # finished: nothing to give back

    async def test_racing_claimers_never_share_a_job(self, open_store: OpenStore) -> None:
        stores = [open_store(), open_store()]
        await add(stores[0], *(make_job(n, created_at=T0 + n % 5) for n in range(24)))
        claimed: list[tuple[str, str]] = []

        async def claimer(worker: int) -> None:
            owner = f"r{worker}"
            while True:
                job = await stores[worker % 2].claim(owner, now=T0, lease_s=LEASE_S, max_attempts=3)
                if job is None:
                    return
                assert job.owner == owner
                claimed.append((job.id, owner))

        await asyncio.gather(*(claimer(w) for w in range(12)))
        ids = [job for job, _ in claimed]
        assert sorted(ids) == sorted(job_id(n) for n in range(24))
        for job, owner in claimed:
            stored = await stores[1].get(job)
            assert stored is not None
            assert (stored.owner, stored.attempts) == (owner, 1)

    # --- content, input, delete, expiry -------------------------------------------------

    async def test_content_round_trip(self, store: JobStore) -> None:
        await add(store, make_job(1))
        video = bytes(range(256)) * 20_000  # 5 MB, every byte value
        await store.put_content(job_id(1), video)
        assert await store.get_content(job_id(1)) == video
        await store.put_content(job_id(1), b"second")
        assert await store.get_content(job_id(1)) == b"second"
        assert await store.get_content(job_id(2)) is None
        assert await store.get_content("../../../etc/passwd") is None
        # A job deleted while it ran keeps no video.
        await store.put_content(job_id(2), b"orphan")
        assert await store.get_content(job_id(2)) is None

    async def test_delete_removes_job_input_and_content(self, store: JobStore) -> None:
        await store.create(make_job(1), max_active=1, input_bytes=b"image")
        await store.put_content(job_id(1), b"video")
        await add(store, make_job(2, status="completed"))
        assert await store.delete(job_id(1))
        assert await store.get(job_id(1)) is None
        assert await store.get_input(job_id(1)) is None
        assert await store.get_content(job_id(1)) is None
        assert not await store.delete(job_id(1))
        assert await list_all(store) == [job_id(2)]
        assert await store.claim("r1", now=T0, lease_s=LEASE_S, max_attempts=3) is None
        await store.create(make_job(3), max_active=1)  # the deleted job freed its slot
        assert not await store.delete("no such job")

    async def test_purge_expired(self, store: JobStore) -> None:
        await store.create(make_job(1, expires_at=T0 + 100), max_active=9, input_bytes=b"i1")
        await store.put_content(job_id(1), b"v1")
        await store.create(make_job(2), max_active=9, input_bytes=b"i2")
        await store.put_content(job_id(2), b"v2")
        await add(store, make_job(3))
        assert await store.update(job_id(2), owner=None, expires_at=T0 + 200) is not None
        assert await store.purge_expired(T0 + 99) == 0
        assert await store.purge_expired(T0 + 100) == 1
        assert await store.get(job_id(1)) is None
        assert await store.get_input(job_id(1)) is None
        assert await store.get_content(job_id(1)) is None
        assert await store.get_content(job_id(2)) == b"v2"
        assert await store.purge_expired(T0 + 150) == 0
        # An expiry taken back is no expiry.
        assert await store.update(job_id(2), owner=None, expires_at=None) is not None
        assert await store.purge_expired(T0 + 10_000) == 0
        assert await store.update(job_id(2), owner=None, expires_at=T0 + 300) is not None
        assert await store.purge_expired(T0 + 10_000) == 1
        assert await store.get_input(job_id(2)) is None
        assert await store.get_content(job_id(2)) is None
        assert await list_all(store) == [job_id(3)]

    async def test_ids_that_name_no_job(self, store: JobStore) -> None:
        for bad in ("", "../x", "video_1/../../y", "a b"):
            assert await store.get(bad) is None
            assert await store.get_input(bad) is None
            assert await store.get_content(bad) is None
            assert await store.update(bad, owner=None, progress=1) is None
            assert not await store.renew(bad, "r1", T0)
            assert not await store.delete(bad)
            await store.put_content(bad, b"x")

    async def test_ping(self, store: JobStore) -> None:
        await store.ping()
