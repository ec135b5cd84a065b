"""The README's test command in a user's clone: it needs nothing outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_test_script_requires_no_oracle_outside_the_checkout() -> None:
    # BAGEL's reference code lies beside CI's checkout (../shared), not in a clone: the
    # README's command lets its tests skip (saying why), and CI alone makes them required.
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert not re.search(r"^\s*export OMNI_REQUIRE_BAGEL_REFERENCE=", script, re.MULTILINE)
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^export OMNI_REQUIRE_BAGEL_REFERENCE=1$", ci, re.MULTILINE)
    assert ci.rstrip().endswith("exec scripts/test.sh")
