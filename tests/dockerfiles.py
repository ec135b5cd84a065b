"""The project's Dockerfiles read as data (stages, instructions, build arguments) for the
tests that check what the images install and run: no Docker engine needed."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Stage:
    base: str
    name: str | None
    # (instruction, arguments) with continuations joined and comments dropped.
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise AssertionError(f"no stage named {name!r}: {[s.name for s in self.stages]}")


def instructions(text: str) -> Iterator[tuple[str, str]]:
    pending: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        pending.append(line)
        joined = " ".join(pending)
        pending = []
        keyword, _, rest = joined.partition(" ")
        yield keyword.upper(), rest.strip()
    assert not pending, "a line continuation runs off the end of the file"


def parse_dockerfile(path: Path) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, rest in instructions(path.read_text()):
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif not stages:
            assert keyword == "ARG", f"{path.name}: only ARG may come before the first FROM"
            key, _, value = rest.partition("=")
            global_args[key] = value
        else:
            stages[-1].instructions.append((keyword, rest))
    return Dockerfile(global_args, stages)


def expand(text: str, values: Mapping[str, str]) -> str:
    """``text`` with the build arguments in ``values`` substituted; other variables (ENV,
    the shell's) stay as they are."""

    def one(match: re.Match[str]) -> str:
        key = match.group(1) or match.group(2)
        return values.get(key, match.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, text)


def stage_args(dockerfile: Dockerfile, stage: Stage) -> dict[str, str]:
    """The ARG values a stage sees with no --build-arg: globals it re-declares, its own."""
    values: dict[str, str] = {}
    for rest in stage.args("ARG"):
        key, eq, value = rest.partition("=")
        values[key] = value if eq else dockerfile.global_args[key]
    return values


def pins(text: str, package: str) -> list[str]:
    return re.findall(rf"(?<![\w-]){re.escape(package)}==([\w.+]+)", text)


def shell_var(script: str, name: str) -> str:
    match = re.search(rf"^{name}=(\S+)$", script, re.MULTILINE)
    assert match, f"scripts/setup.sh sets no {name}"
    return match.group(1)
