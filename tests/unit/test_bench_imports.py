"""No script in bench/ imports a module of tests/: what both use lives in omni_testkit
(testkit/). A test module is no library (importing one runs its module-level fixtures and
pytest marks, and a rename there breaks a benchmark no test runs), and tests/ is not on a
benchmark's sys.path unless the script puts it there.

Read from the source with ``ast``, not by importing the scripts (importing one would start
its benchmark): every ``import``, anywhere in the file; every ``importlib.import_module``
or ``__import__`` (a name that is not a literal cannot be checked, so it is refused too);
and every change of ``sys.path`` that names tests/.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
TESTS = ROOT / "tests"


def modules_of_tests() -> set[str]:
    """The top-level names a module or package of tests/ could be imported by: pytest puts
    the test directories on sys.path, so any file or package at any depth is one."""
    names = {"tests"}
    for path in TESTS.rglob("*.py"):
        if path.name == "__init__.py":
            names.add(path.parent.name)
        else:
            names.add(path.stem)
    # tests/unit mirrors the product's packages (tests/unit/omni_runtime/...): those names
    # import the product (pyproject.toml's pythonpath puts it first), not the tests.
    return {name for name in names if not _resolves_outside_tests(name)}


def _resolves_outside_tests(name: str) -> bool:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    places = [spec.origin] if spec.origin else list(spec.submodule_search_locations or [])
    return bool(places) and all(
        place in ("built-in", "frozen") or not Path(place).resolve().is_relative_to(TESTS)
        for place in places
    )


def _literal(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _names_tests(node: ast.AST) -> bool:
    """Whether an expression spells a path through tests/ (a literal "tests" part)."""
    return any(
        isinstance(part, ast.Constant)
        and isinstance(part.value, str)
        and "tests" in Path(part.value).parts
        for part in ast.walk(node)
    )


def offences(source: str, forbidden: set[str], own: set[str]) -> list[str]:
    """What in ``source`` imports from tests/: ``forbidden`` are tests/' module names,
    ``own`` the modules beside the script (found first on its sys.path)."""
    found: list[tuple[int, str]] = []

    def check(module: str, line: int) -> None:
        top = module.split(".")[0]
        if top in forbidden and top not in own:
            found.append((line, f"imports {module!r} from tests/"))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            check(node.module, node.lineno)
        elif isinstance(node, ast.Call):
            called = _dotted(node.func)
            if called in ("importlib.import_module", "import_module", "__import__"):
                name = _literal(node.args[0]) if node.args else None
                if name is None:
                    found.append((node.lineno, f"{called} of a name that is no literal"))
                else:
                    check(name, node.lineno)
            elif called in ("sys.path.append", "sys.path.insert", "sys.path.extend") and (
                _names_tests(node)
            ):
                found.append((node.lineno, "puts tests/ on sys.path"))
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any("sys.path" in ast.unparse(target) for target in targets) and _names_tests(
                node.value
            ):
                found.append((node.lineno, "puts tests/ on sys.path"))
    return [f"line {line}: {message}" for line, message in sorted(found)]


def test_tests_modules_names_the_helpers_and_not_the_product() -> None:
    names = modules_of_tests()
    assert {"conftest", "serving", "test_family_pipelines", "tests"} <= names
    assert not {"omni_runtime", "omni_operator", "omni_testkit"} & names


@pytest.mark.parametrize("script", sorted(BENCH.glob("*.py")), ids=lambda path: path.name)
def test_bench_script_imports_nothing_from_tests(script: Path) -> None:
    own = {path.stem for path in BENCH.glob("*.py")}
    assert offences(script.read_text(), modules_of_tests(), own) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        # What bench/ did before omni_testkit: a test module, a package of tests/, and a
        # helper fetched by name from a directory of tests/ put on sys.path.
        (
            'sys.path.append(str(ROOT / "tests" / "integration"))\n'
            "import test_family_pipelines as t\n",
            ["line 1: puts tests/ on sys.path", "line 2: imports 'test_family_pipelines'"],
        ),
        (
            "def serve():\n    from serving import served_base_url\n",
            ["line 2: imports 'serving'"],
        ),
        (
            'sys.path.insert(0, str(ROOT / "tests"))\n'
            "def helper(module):\n    return importlib.import_module(module)\n",
            ["line 1: puts tests/ on sys.path", "line 3: importlib.import_module of a name"],
        ),
        ('port_leases = __import__("port_leases")\n', []),  # tests/ no longer holds it
        ('sys.path[:0] = ["tests/cluster"]\nimport conftest\n', ["line 1", "line 2"]),
        ("from _load import markdown_table\nimport omni_runtime.router\n", []),
    ],
)
def test_the_check_finds_imports_from_tests(source: str, expected: list[str]) -> None:
    found = offences(source, modules_of_tests(), own={"_load"})
    assert len(found) == len(expected), found
    for message, start in zip(found, expected, strict=True):
        assert message.startswith(start), (message, start)
