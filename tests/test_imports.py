"""refimpl's import graph: no cycle, and no private name borrowed from another concept.

Every ``import refimpl.X`` and ``from refimpl.X import Y`` anywhere in a module counts, the
ones inside function bodies included (a function-level import only postpones a cycle to the
first call, and hides it from a reader), and so does a package's ``__init__`` importing its own
modules to re-export their names. Importing ``refimpl.a.b`` also runs ``refimpl.a``'s
``__init__``, so it is an edge to both; a module's edges to the packages that contain it are
left out (Python is already running those when the module loads).

A concept is a top-level module (``refimpl.atomic``, ``refimpl._publish``) or a package with
everything in it (``refimpl.sharded``). A concept may use its own private names freely; it
must not import another concept's: a helper two concepts share lives where both import it by a
public name (a flat private module such as ``refimpl._pack`` is such a place, so importing
*from* it is fine, but a name that starts with ``_`` is not).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "refimpl"


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of refimpl (a package is its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for each refimpl import in the file."""
    base = name if _is_package(path) else name.rpartition(".")[0]
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found += [(target, a.name, node.lineno) for a in node.names]
    return [(t, n, line) for t, n, line in found if t == PACKAGE or t.startswith(PACKAGE + ".")]


def import_graph() -> dict[str, set[str]]:
    """Module -> the refimpl modules loading it runs (or calling its functions may run)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        if _is_package(path):
            ancestors.add(name)
        for target, taken, _ in _imports(name, path, modules):
            hit = {target}
            if taken is not None and f"{target}.{taken}" in modules:
                hit.add(f"{target}.{taken}")  # from refimpl.pkg import submodule
            for t in list(hit):  # importing a.b.c runs a and a.b first
                parts = t.split(".")
                hit |= {".".join(parts[:i]) for i in range(2, len(parts))}
            graph[name] |= {t for t in hit if t in modules and t not in ancestors and t != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that comes back to its start) per strongly connected component of
    more than one module (Tarjan), so the count is the number of tangles to undo."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:  # a shortest way back to the start, inside the component
        start = min(component)
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in {w for v in frontier for w in graph[v]}:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w not in paths:
                        paths[w] = [*paths[v], w]
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        cycles.append([*paths[last], start])
    return cycles


def _concept(module: str) -> str:
    return ".".join(module.split(".")[:2])


def private_imports() -> list[str]:
    """``file:line: from refimpl.X import _name`` for each private name taken across concepts."""
    modules = _modules()
    found = []
    for name, path in modules.items():
        for target, taken, line in _imports(name, path, modules):
            private = taken is not None and taken.startswith("_") and taken != "__version__"
            private = private and f"{target}.{taken}" not in modules  # a module is no name
            if private and _concept(target) != _concept(name):
                where = path.relative_to(SRC.parent)
                found.append(f"{where}:{line}: from {target} import {taken}")
    return found


def test_the_graph_sees_function_level_and_reexport_edges(tmp_path: Path) -> None:
    """An import inside a function body is an edge, and so is a package's ``__init__``
    re-exporting its own modules (and a relative import resolves to its module)."""
    module = tmp_path / "m.py"
    module.write_text(
        "import os\n"
        "def main():\n"
        "    from refimpl.launch import spawn\n"
        "    if True:\n"
        "        import refimpl.sharded._commit\n"
    )
    found = {(t, n) for t, n, _ in _imports("refimpl.m", module, {})}
    assert found == {("refimpl.launch", "spawn"), ("refimpl.sharded._commit", None)}
    package = tmp_path / "__init__.py"
    package.write_text("from ._files import save\nfrom . import _async\n")
    found = {(t, n) for t, n, _ in _imports("refimpl.checkpoint", package, {})}
    assert found == {("refimpl.checkpoint._files", "save"), ("refimpl.checkpoint", "_async")}
    graph = import_graph()
    assert "refimpl.checkpoint._files" in graph["refimpl.checkpoint"]
    assert "refimpl.launch" in graph["refimpl.collectives"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_name_crosses_concepts() -> None:
    found = private_imports()
    assert not found, "private names imported from another concept:\n" + "\n".join(found)


def private_module_imports() -> list[str]:
    """``file:line: from refimpl.pkg._mod import name`` for each library module that reaches
    into another package's private module. `refimpl.demos` and `refimpl.bench` may: they exist
    to show and to measure those internals (a crafted manifest, a paced writer alone)."""
    modules = _modules()
    found = []
    for name, path in modules.items():
        if _concept(name) in {"refimpl.demos", "refimpl.bench"}:
            continue
        for target, taken, line in _imports(name, path, modules):
            parts = target.split(".")
            inside = len(parts) > 2 and any(p.startswith("_") for p in parts[2:])
            if inside and _concept(target) != _concept(name):
                where = path.relative_to(SRC.parent)
                found.append(f"{where}:{line}: from {target} import {taken}")
    return found


def test_no_library_module_reaches_into_another_packages_private_module() -> None:
    """What two concepts share lives in a flat private module (`refimpl._step_dirs`: the step
    directories both checkpoint formats use), never in one package's private file."""
    found = private_module_imports()
    assert not found, "private modules of another package imported:\n" + "\n".join(found)
