"""A DiT replica's size multiple in its reports (StageLoad.size_multiple), and the wire kept
compatible both ways: a report of a replica from before the field reads as "says
nothing" (0, so the router asks describe() as it did), and a router from before it reads
a new replica's report as it always did."""

from __future__ import annotations

import msgspec
import pytest

from fake_replica import FakeReplica
from omni_runtime.engine.stage.stage_core_types import StageLoad, StageServerOutputs
from omni_runtime.router.stage_replica_pool import StageReplicaPool
from omni_runtime.wire import WireDecoder, WireEncoder


class StageLoadBefore(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """StageLoad as replicas sent it before size_multiple: its fields then, in order."""

    stage_id: int
    name: str
    alive: bool
    in_flight: int = 0
    reason: str | None = None
    draining: bool = False
    revision: str = ""
    adapters: list[str] = []
    max_adapters: int = 0


# Every field away from its default, so that the old report is as long as it gets and a
# field put anywhere but last would shift what it decodes to.
BEFORE = {
    "stage_id": 1,
    "name": "dit",
    "alive": False,
    "in_flight": 3,
    "reason": "why",
    "draining": True,
    "revision": "7-abc",
    "adapters": ["ink"],
    "max_adapters": 2,
}


def test_an_older_replicas_report_reads_as_saying_no_multiple() -> None:
    frames = WireEncoder().encode(StageLoadBefore(**BEFORE))
    load = WireDecoder(StageLoad).decode(frames)
    assert msgspec.structs.asdict(load) == {**BEFORE, "size_multiple": 0}


def test_an_older_router_reads_a_report_with_the_multiple_as_before() -> None:
    frames = WireEncoder().encode(StageLoad(**BEFORE, size_multiple=32))
    assert msgspec.structs.asdict(WireDecoder(StageLoadBefore).decode(frames)) == BEFORE
    # And this router reads it whole, inside the message that carries it.
    message = WireEncoder().encode(
        StageServerOutputs(load=StageLoad(1, "dit", True, size_multiple=32))
    )
    decoded = WireDecoder(StageServerOutputs).decode(message)
    assert decoded.load is not None
    assert decoded.load.size_multiple == 32


class Reporting(FakeReplica):
    """A replica with its last report, as RemoteStageClient keeps it (``load``)."""

    def __init__(self, name: str, load: StageLoad | None) -> None:
        super().__init__(name)
        self.load = load

    @property
    def draining(self) -> bool:
        return self.load is not None and self.load.draining


@pytest.mark.parametrize(
    ("reports", "expected"),
    [
        # A replica that says 32; one that predates the field; one that reports nothing
        # (in-process); one that drains (taking no new jobs, its word no longer counts).
        (
            [
                StageLoad(1, "dit", True, size_multiple=32),
                StageLoad(1, "dit", True),
                None,
                StageLoad(1, "dit", True, draining=True, size_multiple=48),
            ],
            {32},
        ),
        # Two revisions of different checkpoints side by side, in a rollout.
        (
            [
                StageLoad(1, "dit", True, size_multiple=16),
                StageLoad(1, "dit", True, size_multiple=32),
            ],
            {16, 32},
        ),
        ([StageLoad(1, "dit", True), None], set()),
        ([], set()),
    ],
)
async def test_the_pool_gathers_what_its_accepting_replicas_say(
    reports: list[StageLoad | None], expected: set[int]
) -> None:
    pool = StageReplicaPool("dit", "round-robin")
    for index, load in enumerate(reports):
        pool.add_replica(Reporting(f"r{index}", load), f"10.0.0.{index}:1")
    try:
        assert pool.size_multiples() == expected
    finally:
        await pool.close()
