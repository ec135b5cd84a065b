"""The generic layers name no model family and no stage role.

import-linter keeps them from importing a family's module; this keeps them from spelling
one out: a stage role (Qwen3-Omni's thinker, talker, code2wav) or a family's name in their
code means a pipeline shape is hard-coded where the family's graph (families.graph) should
say it. Comments and docstrings may give examples; identifiers and strings may not.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import omni_runtime
from omni_runtime.families import FAMILIES

PACKAGE = Path(omni_runtime.__file__).parent
# What runs any pipeline: the router (its orchestrator, endpoints and replica pool), the
# stage servers, the connectors and the diffusers engine's base.
GENERIC = [
    *sorted((PACKAGE / "router").rglob("*.py")),
    *sorted((PACKAGE / "stage_server").rglob("*.py")),
    *sorted((PACKAGE / "connectors").rglob("*.py")),
    PACKAGE / "diffusion" / "engine_base.py",
]
# The family interface's own parts (EncoderRecipe, DiTRecipe) are every encoder -> DiT
# family's, so the generic layers may name them; the other stage names are one family's.
INTERFACE_ROLES = {"encoder", "dit"}
ROLES = {s.name for f in FAMILIES.values() for s in f.topology} - INTERFACE_ROLES
NAMES = {name for family in FAMILIES.values() for name in (family.name, *family.aliases)}


def _docstring_lines(source: str) -> set[int]:
    """The lines of every docstring in ``source``."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                doc = body[0]
                assert doc.end_lineno is not None
                lines.update(range(doc.lineno, doc.end_lineno + 1))
    return lines


def _code_words(path: Path) -> list[tuple[int, str]]:
    """(line, word) of every identifier part and string word of ``path``'s code."""
    source = path.read_text()
    docstrings = _docstring_lines(source)
    words: list[tuple[int, str]] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        line = token.start[0]
        if token.type == tokenize.NAME:
            words += [(line, part) for part in token.string.lower().split("_") if part]
        elif token.type == tokenize.STRING and line not in docstrings:
            words += [(line, word) for word in re.findall(r"[\w.\-]+", token.string.lower())]
    return words


def test_the_roles_and_names_checked_are_the_registrys() -> None:
    # A test that checked nothing would pass every module.
    assert {"thinker", "talker", "code2wav"} <= ROLES
    assert {"bagel", "qwen3-omni", "wan2.2"} <= NAMES


@pytest.mark.parametrize("path", GENERIC, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_generic_module_names_no_role_or_family(path: Path) -> None:
    found = [
        f"{path.name}:{line}: {word}"
        for line, word in _code_words(path)
        if word in ROLES or word in NAMES
    ]
    assert not found, "a generic layer names a stage role or a family: " + ", ".join(found)
