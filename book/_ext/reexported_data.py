"""Constants a package re-exports, documented on its API page with their own docstrings.

autodoc reads a module-level constant's docstring (the string literal after the assignment)
from the source of the module it documents. A package such as ``refimpl.checkpoint`` assigns
``MANIFEST`` in a submodule and re-exports it from its ``__init__``, whose source holds no
such docstring: ``.. automodule:: refimpl.checkpoint`` leaves the constant out although it
is in ``__all__``, and ``.. autodata:: refimpl.checkpoint.MANIFEST`` shows the docstring of
``str``. The API page names such a constant in an ``autodata`` directive, and this extension
gives it the docstring of the module that assigns it, found among the modules the page's
module imports from and, for a package, the modules in it. ``tests/test_book_structure.py``
checks that every public constant is documented one way or the other.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from functools import cache
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer


@cache
def _sources(module_name: str) -> tuple[str, ...]:
    """Where ``module_name``'s names may be assigned: the modules it imports names from (in
    order) and, for a package, every module in it."""
    module = importlib.import_module(module_name)
    path = getattr(module, "__file__", None)
    if path is None:
        return ()
    package = module_name if Path(path).name == "__init__.py" else module_name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(Path(path).read_text(), path)):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            found.append(f"{base}.{node.module}" if base else node.module)
    if hasattr(module, "__path__"):
        found += [m.name for m in pkgutil.walk_packages(module.__path__, f"{module_name}.")]
    return tuple(dict.fromkeys(found))


def docstring_of(package: str, name: str) -> list[str] | None:
    """The lines of the docstring that documents ``name`` where it is assigned, if one of the
    modules ``package`` imports from assigns it with one."""
    for source in _sources(package):
        try:
            docs = ModuleAnalyzer.for_module(source).find_attr_docs()
        except Exception:  # not analysable (no source): look on
            continue
        if ("", name) in docs:
            return list(docs["", name])
    return None


def _own_docs(module: str) -> dict[tuple[str, str], list[str]]:
    try:
        return dict(ModuleAnalyzer.for_module(module).find_attr_docs())
    except Exception:
        return {}


def _fill(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """Give such a constant the docstring found where it is assigned (in place of nothing, or
    of the docstring of its type, which is what autodoc finds on a ``str``)."""
    package, _, attr = name.rpartition(".")
    if what != "data" or not package or ("", attr) in _own_docs(package):
        return
    found = docstring_of(package, attr)
    if found:
        lines[:] = found


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("autodoc-process-docstring", _fill)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
