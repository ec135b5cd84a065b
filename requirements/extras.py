"""Print the requirements of pyproject.toml's named extras, with the unconditional ones.

The runtime image installs the project's dependencies in a layer of their own, before it
copies the sources, so that a change to the code rebuilds a small layer instead of
reinstalling torch and vLLM; pip cannot install a project's dependencies without the
project, hence this list. Standard library only: it runs before anything is installed.

    python requirements/extras.py runtime mooncake > /tmp/requirements.txt
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: dict[str, object], extras: list[str]) -> list[str]:
    project = pyproject["project"]
    assert isinstance(project, dict)
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    unknown = [name for name in extras if name not in optional]
    if unknown:
        raise SystemExit(f"no extra {unknown} in pyproject.toml; it has {sorted(optional)}")
    listed: list[str] = list(project.get("dependencies", []))
    for name in extras:
        listed.extend(optional[name])
    return listed


def main() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    print("\n".join(requirements(pyproject, sys.argv[1:])))


if __name__ == "__main__":
    main()
