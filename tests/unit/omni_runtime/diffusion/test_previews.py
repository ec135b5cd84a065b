"""Which steps a request's partial images come after."""

from __future__ import annotations

import pytest

from omni_runtime.diffusion.previews import partial_steps


@pytest.mark.parametrize(
    ("steps", "count", "expected"),
    [
        (20, 1, [10]),
        (20, 2, [6, 13]),
        (20, 3, [5, 10, 14]),
        (50, 3, [12, 24, 37]),
        # Too few steps between the first and the last: fewer partials, never twice one.
        (4, 3, [1, 2]),
        (3, 2, [1]),
        (2, 3, []),
        (1, 1, []),
        (20, 0, []),
    ],
)
def test_partials_are_evenly_spaced_between_the_first_and_last_steps(
    steps: int, count: int, expected: list[int]
) -> None:
    chosen = partial_steps(steps, count)
    assert chosen == expected
    assert len(chosen) <= count
    assert all(1 <= step <= steps - 2 for step in chosen)
