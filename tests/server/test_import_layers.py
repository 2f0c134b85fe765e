"""The server's rooms and which way their imports point, read from the source (every import, at the top
or inside a function):

- server/ is app.py (the composition root) over a handful of packages: http/, core/, and one package per
  API (openai/, anthropic/, responses/, cache_api/); nothing else holds code;
- http/ (who may call what, body bounds, tenants, metrics, the one error mapping) imports neither core/
  nor any API;
- core/ (the neutral request, its plan, prompts, tools, reasoning, generation) imports no API;
- no API imports another, and nothing but app.py imports app.py;
- the layers below the server (engine/, cache/, model/) never import it;
- a 400 is raised as InvalidRequestError, never as APIError(400, ...).
"""

import ast
import re
from pathlib import Path

import kvserve

SRC = Path(kvserve.__file__).parent
SERVER = SRC / "server"
APIS = {"openai", "anthropic", "responses", "cache_api"}
ROOMS = {"http", "core"} | APIS
LOWER = ("engine", "cache", "model")


def _imports(path: Path) -> set[str]:
    """Every module a file imports, absolute, by its dotted name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            found.add(node.module)
            # `from kvserve.server.core import plan` imports the module kvserve.server.core.plan.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _room(module: str) -> str | None:
    """The server room a module is in ("app" for app.py), or None outside the server."""
    parts = module.split(".")
    if parts[:2] != ["kvserve", "server"] or len(parts) < 3:
        return None
    return parts[2]


def _server_imports(path: Path) -> set[str]:
    return {room for m in _imports(path) if (room := _room(m)) is not None}


def _files(room: str) -> list[Path]:
    files = sorted((SERVER / room).rglob("*.py"))
    assert files, f"server/{room}/ has no modules"
    return files


def test_the_server_is_app_over_a_handful_of_rooms() -> None:
    loose = {p.name for p in SERVER.glob("*.py")} - {"__init__.py", "app.py"}
    assert not loose, f"modules outside the rooms: {sorted(loose)}"
    packages = {p.parent.name for p in SERVER.glob("*/__init__.py")} - {"static"}
    assert packages == ROOMS


def test_http_imports_neither_core_nor_any_api() -> None:
    for path in _files("http"):
        wrong = _server_imports(path) - {"http"}
        assert not wrong, f"{path.relative_to(SERVER)} imports server/{sorted(wrong)}"


def test_core_imports_no_api() -> None:
    for path in _files("core"):
        wrong = _server_imports(path) - {"core", "http"}
        assert not wrong, f"{path.relative_to(SERVER)} imports server/{sorted(wrong)}"


def test_no_api_imports_another() -> None:
    for api in APIS:
        for path in _files(api):
            wrong = _server_imports(path) - {api, "core", "http"}
            assert not wrong, f"{path.relative_to(SERVER)} imports server/{sorted(wrong)}"


def test_nothing_below_the_server_imports_it() -> None:
    for layer in LOWER:
        for path in sorted((SRC / layer).rglob("*.py")):
            wrong = {m for m in _imports(path) if m == "kvserve.server" or _room(m) is not None}
            assert not wrong, f"{path.relative_to(SRC)} imports {sorted(wrong)}"


def test_a_400_is_an_invalid_request_error() -> None:
    for path in sorted(SERVER.rglob("*.py")):
        raised = re.findall(r"raise APIError\(\s*400\b", path.read_text())
        assert not raised, f"{path.relative_to(SERVER)} raises APIError(400, ...): raise InvalidRequestError"


def test_the_walk_sees_every_kind_of_import() -> None:
    """The checks above would pass on a walk that found nothing: it finds what app.py imports."""
    assert {"http", "core", *APIS} <= _server_imports(SERVER / "app.py")
