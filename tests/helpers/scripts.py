"""Load a script that is not in a package (``tools/*.py``, ``book/_ext/*.py``) as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative_path: str) -> ModuleType:
    """The module ``ROOT/relative_path`` defines, run once the way ``python PATH`` would run its
    top level (but not its ``__main__`` block), registered in ``sys.modules`` under the file's
    stem (dataclasses look their module up there)."""
    path = ROOT / relative_path
    name = path.stem
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
