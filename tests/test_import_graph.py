"""The package's layers, read from its own imports: exitbench's packages (and its top-level modules) import each
other without a circle, so each stands above everything it imports, and there are at most 11 layers from
errors.py up to __main__.py (docs/contributing.md's map). A new import that runs back up, from a lower package
into a higher one, makes a circle here and fails."""
from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "exitbench"
MAX_LAYERS = 11


def room(path: Path) -> str:
    """A module's room: its top-level package under exitbench/, or the module itself at the top."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def imported_rooms(path: Path) -> set[str]:
    """The rooms `path` imports, module-level and function-local imports alike."""
    here = path.relative_to(ROOT).with_suffix("").parts  # ("exitbench", "sweep", "config")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[:len(here) - node.level])
                target = base + (node.module.split(".") if node.module else [])
                names = [".".join(target + ([a.name] if not node.module and len(target) == 1 else []))
                         for a in node.names]
            elif node.module:
                names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "exitbench" and len(parts) > 1:
                out.add(parts[1])
    return out


@lru_cache(maxsize=1)
def graph() -> dict[str, set[str]]:
    paths = list(PACKAGE.rglob("*.py"))
    rooms = {room(p) for p in paths}
    edges: dict[str, set[str]] = {}
    for path in paths:
        me = room(path)
        # a name no room holds (`from .. import __version__`) is the package's own __init__.py
        found = {r if r in rooms else "__init__" for r in imported_rooms(path)}
        edges.setdefault(me, set()).update(found - {me})
    return edges


def test_no_package_imports_one_above_it():
    edges, state, stack = graph(), {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            assert state.get(nxt) != "open", f"a circle: {' -> '.join(stack[stack.index(nxt):] + [nxt])}"
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_at_most_eleven_layers():
    edges = graph()

    @lru_cache(maxsize=None)
    def layer(node: str) -> int:
        return 1 + max((layer(n) for n in edges.get(node, ())), default=0)

    tallest = max(edges, key=layer)
    assert layer(tallest) <= MAX_LAYERS, (tallest, layer(tallest))
    assert layer("errors") == 1 and layer("__main__") == layer(tallest)  # the ground floor and the roof
