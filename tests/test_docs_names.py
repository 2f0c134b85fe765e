"""The names that README.md and docs/*.md cite exist in the tree, and both stay short.

Citation style the docs keep (checked here, all inside backticks):
- a file: `src/...`, `tests/...`, `benchmarks/...`, `bench/...` from the repository root; any other
  path, such as `engine/engine.py` or `model/kernels/kvserve.h`, is under src/kvserve/;
- a name in a file: `engine/engine.py:Engine.step` (a function, class, method or class attribute);
- a test: `tests/engine/test_async_engine_door.py::test_name`, or a bare `test_name` defined in a test
  file;
- a class member: `Engine.step`, `EngineConfig.secret` (the class defined under src/kvserve/);
- a module: `kvserve.cluster.router`, and `python -m MODULE` commands;
- a make target: `make NAME`, in backticks or at the start of a line (in a code block).
Pure lookups over the sources' syntax trees: no model, no import of kvserve.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "kvserve"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ROOTED = ("src/", "tests/", "benchmarks/", "bench/", "docs/", ".ci/")
MAX_README_LINES = 420
MAX_DESIGN_LINES = 650

BACKTICKED = re.compile(r"`([^`\n]+)`")
FILE_REF = re.compile(r"^(\w[\w./-]*\.(?:py|h|c))(?:(::|:)([\w.:]+))?$")
MEMBER_REF = re.compile(r"^([A-Z]\w*)\.(_{0,2}[a-z]\w*)(?:\(\))?$")
TEST_NAME = re.compile(r"^(test_\w+)$")
MODULE_REF = re.compile(r"^(kvserve(?:\.\w+)+)$")
PYTHON_M = re.compile(r"python -m ([\w.]+)")
MAKE_TARGET = re.compile(r"(?:`|^)make ([a-z][\w-]*)", re.MULTILINE)


@dataclass
class Scope:
    """What a class or module defines, by name, and the classes it derives from."""

    names: set[str] = field(default_factory=set)
    classes: dict[str, Scope] = field(default_factory=dict)
    bases: list[str] = field(default_factory=list)


def _targets(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Tuple):
        for element in node.elts:
            yield from _targets(element)


def _self_attributes(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[str]:
    for node in ast.walk(function):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                yield target.attr


def _scope(body: list[ast.stmt]) -> Scope:
    scope = Scope()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            scope.names.add(node.name)
            scope.names.update(_self_attributes(node))
        elif isinstance(node, ast.ClassDef):
            scope.names.add(node.name)
            inner = _scope(node.body)
            inner.bases = [ast.unparse(base).split(".")[-1] for base in node.bases]
            scope.classes[node.name] = inner
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                scope.names.update(_targets(target))
        elif isinstance(node, ast.AnnAssign):
            scope.names.update(_targets(node.target))
        elif isinstance(node, ast.If | ast.Try):
            nested = _scope(node.body + getattr(node, "orelse", []))
            scope.names |= nested.names
            scope.classes.update(nested.classes)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            scope.names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return scope


@cache
def module_scope(path: Path) -> Scope:
    return _scope(ast.parse(path.read_text(encoding="utf-8")).body)


@cache
def src_classes() -> dict[str, list[Scope]]:
    """Every class defined under src/kvserve/ (nested ones too), by name."""
    found: dict[str, list[Scope]] = {}

    def add(classes: dict[str, Scope]) -> None:
        for name, scope in classes.items():
            found.setdefault(name, []).append(scope)
            add(scope.classes)

    for path in SRC.rglob("*.py"):
        add(module_scope(path).classes)
    return found


@cache
def defined_test_names() -> frozenset[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
    return frozenset(names)


def class_has(scope: Scope, attr: str, seen: frozenset[int] = frozenset()) -> bool:
    if attr in scope.names:
        return True
    for base in scope.bases:
        for parent in src_classes().get(base, []):
            if id(parent) not in seen and class_has(parent, attr, seen | {id(scope)}):
                return True
    return False


def resolve_path(cited: str) -> Path:
    return ROOT / cited if cited.startswith(ROOTED) else SRC / cited


def name_in_file(path: Path, dotted: str) -> bool:
    """`Name`, `Class.member` or `Class.Inner.member` (`::` of pytest ids reads as `.`) in one file."""
    parts = dotted.replace("::", ".").split(".")
    scope = module_scope(path)
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if last:
            return part in scope.names if i == 0 else class_has(scope, part)
        if part not in scope.classes:
            return False
        scope = scope.classes[part]
    return False


def module_exists(dotted: str) -> bool:
    """`kvserve.x.y` or `benchmarks.x`: a module, or a module and then names in it."""
    parts = dotted.split(".")
    base = ROOT / "src" if parts[0] == "kvserve" else ROOT
    for i in range(len(parts), 0, -1):
        stem = base.joinpath(*parts[:i])
        for path in (stem.with_suffix(".py"), stem / "__init__.py"):
            if path.is_file():
                rest = parts[i:]
                return not rest or name_in_file(path, ".".join(rest))
    return False


def problems(text: str) -> Iterator[str]:
    for token in BACKTICKED.findall(text):
        token = token.strip()
        if m := FILE_REF.match(token):
            cited, _, name = m.groups()
            path = resolve_path(cited)
            if not path.is_file():
                yield f"`{token}`: no file {path.relative_to(ROOT)}"
            elif name and path.suffix == ".py" and not name_in_file(path, name):
                yield f"`{token}`: no {name} in {path.relative_to(ROOT)}"
        elif m := MEMBER_REF.match(token):
            cls, attr = m.groups()
            scopes = src_classes().get(cls)
            if scopes is not None and not any(class_has(scope, attr) for scope in scopes):
                yield f"`{token}`: class {cls} has no {attr}"
        elif m := TEST_NAME.match(token):
            if m.group(1) not in defined_test_names():
                yield f"`{token}`: no such test"
        elif (m := MODULE_REF.match(token)) and not module_exists(m.group(1)):
            yield f"`{token}`: no such module or name"
    for module in PYTHON_M.findall(text):
        if module.split(".")[0] in ("kvserve", "benchmarks") and not module_exists(module):
            yield f"python -m {module}: no such module"
    targets = make_targets()
    for target in MAKE_TARGET.findall(text):
        if target not in targets:
            yield f"make {target}: no such target in the Makefile"


@cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return frozenset(re.findall(r"^([\w-]+):", text, flags=re.MULTILINE))


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_every_name_the_docs_cite_exists(doc: Path) -> None:
    found = list(problems(doc.read_text(encoding="utf-8")))
    assert not found, "\n".join(found)


def test_the_readme_and_the_design_stay_short() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8").count("\n")
    assert readme <= MAX_README_LINES, f"README.md has {readme} lines"
    assert design <= MAX_DESIGN_LINES, f"docs/design.md has {design} lines"


def test_the_checker_sees_a_stale_name() -> None:
    """The lookups fail where they should: the names the issue found stale, and a missing file."""
    stale = (
        "`Engine._append` `EngineConfig.kv_remote_secret` `engine/engine.py:Engine._append` "
        "`tests/engine/test_nothing_here.py` `test_no_such_test_exists` `kvserve.no_module` `make no-target`"
    )
    assert len(list(problems(stale))) == 7
    fresh = "`Engine._take` `EngineConfig.secret` `engine/engine.py:Engine._deliver` `make test`"
    assert list(problems(fresh)) == []
