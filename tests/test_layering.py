"""Imports run one way: no import cycle in the library packages, and no import against their order.

Every ``import`` and ``from ... import`` of a module in a package counts, wherever it is written:
at the top, inside a function, or under ``if TYPE_CHECKING``. A cycle, even a type-only one, means
two modules that cannot be understood (or changed) one without the other; the student side keeps
its message types and options at the bottom (``distill.types``, ``distill.options``) so that
everything else imports them downward.

Between packages the order is ``LAYERS``: a module may import its own package and those listed
before it, never one listed after (the wire formats at the bottom, then discovery, the teacher
side, the student side, and above the library the examples and the benchmarks that run them).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("distill", "discovery", "teacher_server", "protos")
LAYERS = ("protos", "discovery", "teacher_server", "distill", "examples", "benchmarks")


def _modules(packages: tuple[str, ...], root: Path) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            out[".".join(parts)] = (path, is_package)
    return out


def import_graph(packages: tuple[str, ...], root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports (``from a import b`` is module ``a.b`` when
    that is a module, else ``a``); a package's ``__init__`` is imported only when named."""
    modules = _modules(packages, root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    if target in modules:
                        graph[name].add(target)
                    elif source in modules:
                        graph[name].add(source)
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One closed path through a cycle, for the failure message: a -> b -> ... -> a."""
    members = set(component)
    start = component[0]
    path = [start]
    seen = {start}
    node = start
    for _ in range(len(component)):
        nxt = sorted(graph[node] & members)
        back = start in nxt and len(path) > 1
        if back:
            break
        node = next((n for n in nxt if n not in seen), nxt[0])
        path.append(node)
        if node in seen:
            break
        seen.add(node)
    return " -> ".join([*path, start] if path[-1] != start else path)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package: str) -> None:
    graph = import_graph(PACKAGES)
    found = [c for c in cycles(graph) if any(m == package or m.startswith(package + ".") for m in c)]
    assert not found, "import cycles (TYPE_CHECKING and function-level imports count):\n" + "\n".join(
        _path(graph, c) for c in found)


def upward_imports(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    """Every import of a package listed after the importer's own in `layers`, as 'a -> b'."""
    rank = {package: i for i, package in enumerate(layers)}
    return sorted(f"{source} -> {target}" for source, targets in graph.items() for target in targets
                  if rank[target.partition(".")[0]] > rank[source.partition(".")[0]])


def test_imports_follow_the_layers() -> None:
    found = upward_imports(import_graph(LAYERS), LAYERS)
    assert not found, f"imports against the order {' < '.join(LAYERS)}:\n" + "\n".join(found)


def test_the_checker_finds_upward_imports(tmp_path: Path) -> None:
    for package, text in {"low": "import high.x\n", "high": "from low import y\n"}.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "x.py").write_text(text)
        (tmp_path / package / "y.py").write_text("")
    graph = import_graph(("low", "high"), tmp_path)
    assert upward_imports(graph, ("low", "high")) == ["low.x -> high.x"]


def test_the_checker_finds_type_only_and_function_level_cycles(tmp_path: Path) -> None:
    """The checker itself, on a package written here: `a` imports `b` only for type checking, `b`
    imports `a` inside a function; `c` imports `a` (downward, no cycle); `d` and `e` form a cycle
    through relative imports."""
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from p import a\n    return a\n")
    (pkg / "c.py").write_text("import p.a\n")
    (pkg / "d.py").write_text("from .e import E\n")
    (pkg / "e.py").write_text("from . import d\n")
    graph = import_graph(("p",), tmp_path)
    assert graph["p.a"] == {"p.b"} and graph["p.b"] == {"p.a"} and graph["p.c"] == {"p.a"}
    assert sorted(cycles(graph)) == [["p.a", "p.b"], ["p.d", "p.e"]]
    assert _path(graph, ["p.a", "p.b"]) == "p.a -> p.b -> p.a"
