"""The product's import graph: no circle anywhere, and the gateway's feature folders meet only through its core.

Every module of the product (``fleet/`` and the component folders it installs as ``fleet.producers``,
``fleet.consumers``, ...) is parsed with ``ast``; each ``import`` and ``from ... import`` that runs is an arrow, at
module level, inside a function (a function-level import only postpones a circle, it does not open it) or under
``if TYPE_CHECKING:`` (a circle kept for the type checker's sake is still two modules that each need the other).
``from a.b import c`` is an arrow to ``a.b.c`` when that is a module, else to ``a.b``.

Run as a script (``python tests/test_imports.py``) it prints the gateway's modules per folder and the arrows between
its folders.
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the package name of each folder of the product (fleet.<component> is a link to the component's folder)
FOLDERS = {
    "fleet": "fleet",
    "producers": "fleet.producers",
    "consumers": "fleet.consumers",
    "dispatcher": "fleet.dispatcher",
    "autoscaler": "fleet.autoscaler",
    "dags": "fleet.dags",
    "schemas": "fleet.schemas",
}
GATEWAY = "fleet.producers.gateway"
# the gateway's feature folders; everything else in the gateway is its core
FEATURES = ("jobs", "access", "cache", "operator", "dags", "models")


def product_modules() -> dict[str, Path]:
    """Every module of the product by its dotted name (a package by the name of its folder)."""
    modules: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if any(part in {"__pycache__", "static"} for part in path.parts):
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``tree``: at module level, in functions, under ``if TYPE_CHECKING:``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def import_graph() -> dict[str, set[str]]:
    """module -> the product modules it imports."""
    modules = product_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _base(name, path.name == "__init__.py", node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def gateway_room(module: str) -> str | None:
    """The gateway folder of ``module``: a feature's name, ``core``, or None outside the gateway."""
    if module != GATEWAY and not module.startswith(GATEWAY + "."):
        return None
    rest = module.removeprefix(GATEWAY).lstrip(".").split(".")
    return rest[0] if rest[0] in FEATURES else "core"


def is_public(module: str) -> bool:
    """A feature's public face: its package (``__init__``) or a module named ``public``."""
    rest = module.removeprefix(GATEWAY + ".").split(".")
    return len(rest) == 1 or rest[1:] == ["public"]


def test_no_import_circle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "fleet.producers.gateway.app" in graph["fleet.producers.gateway"]  # a re-export in a package
    assert "fleet.cli.compose" in graph["fleet.cli"]  # inside a command's function
    assert "fleet.producers.gateway.jobs.backlog" in graph["fleet.producers.gateway.state"]  # under TYPE_CHECKING
    assert "fleet.producers.gateway.operator.redrive" in graph["fleet.producers.gateway.operator.deadletters"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_gateway_features_meet_only_through_the_core() -> None:
    wrong = []
    for module, targets in import_graph().items():
        room = gateway_room(module)
        if room is None or room == "core":  # the core assembles the app: it may import any feature's parts
            continue
        for target in targets:
            other = gateway_room(target)
            if other in FEATURES and other != room and not is_public(target):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "a gateway feature imports another's internals:\n" + "\n".join(sorted(wrong))


def test_every_feature_folder_exists() -> None:
    rooms = Counter(gateway_room(m) for m in product_modules())
    assert all(rooms[f] > 1 for f in FEATURES), rooms


def gateway_report() -> str:
    """The gateway's modules per folder and the arrows between its folders."""
    modules = product_modules()
    per_room = Counter(gateway_room(m) for m in modules if gateway_room(m))
    arrows: Counter[tuple[str, str]] = Counter()
    module_arrows = 0
    for module, targets in import_graph().items():
        room = gateway_room(module)
        for target in targets:
            other = gateway_room(target)
            if room and other:
                module_arrows += 1
                if other != room:
                    arrows[(room, other)] += 1
    lines = ["modules per folder:"]
    lines += [f"  {room:10} {count}" for room, count in sorted(per_room.items())]
    lines.append(f"  {'total':10} {sum(per_room.values())}")
    lines.append(f"import arrows between gateway modules: {module_arrows}")
    lines.append(f"import arrows between gateway folders: {sum(arrows.values())}")
    lines += [f"  {a:8} -> {b:8} {n}" for (a, b), n in sorted(arrows.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    print(gateway_report())
