"""Where the project keeps what it builds or fetches outside a checkout, in one place."""

from __future__ import annotations

import os
from pathlib import Path

# Moves every cache below (scripts/setup.sh's base environment reads the same variable).
CACHE_DIR_ENV = "OMNI_CACHE_DIR"


def cache_dir() -> Path:
    """``$OMNI_CACHE_DIR``, else ``~/.cache/omni-operator``: the tiny models, encoder views,
    fetched adapters, Mooncake's libraries. Read at each call, so a process that sets the
    variable (a test) moves them."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "omni-operator")
