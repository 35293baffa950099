"""Move the test harness out of the reader's sight, in place, without changing any output.

1. A first-line ``# NBVAL_IGNORE_OUTPUT`` comment becomes the cell tag ``nbval-ignore-output``
   (nbval reads both; the tag is not shown in the book). The comment that gives the reason,
   if one follows, stays: it tells the reader why the numbers differ from theirs.
2. Long set-up cells (imports, helpers, widget plumbing; listed in SETUP) get the tag
   ``hide-input``: MyST-NB renders them collapsed behind a toggle, their output stays visible.

Only sources and cell metadata change, never outputs or execution counts, so the notebooks
need no re-execution. Running it twice changes nothing.

Usage: python tools/harness_out_of_sight.py [--check] [notebooks/NN_x.ipynb ...]  (default: all)
With --check nothing is written; the exit status is 1 if a notebook still needs a change.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

MARKER = "# NBVAL_IGNORE_OUTPUT"
IGNORE_TAG = "nbval-ignore-output"
HIDE_TAG = "hide-input"
LONG = 25  # lines: shorter cells stay open
# The set-up cells to collapse, by chapter number and how their first line starts: imports
# and helpers whose output matters and whose code is plumbing. A deliberate list: a long cell
# that opens with imports can still be the chapter's point (chapter 10's run of the chaos tool).
SETUP = {
    "03": ("def partition_png(",),
    "04": ("import os",),
    "05": ("import dataclasses",),
    "09": ("%matplotlib inline",),
    "10": (
        "import inspect",
        "from torch.distributed.elastic.agent.server.api import SimpleElasticAgent",
    ),
    "11": ("import inspect", "def curve_png("),
}
NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _add_tag(cell: nbformat.NotebookNode, tag: str) -> bool:
    tags = cell.metadata.setdefault("tags", [])
    if tag in tags:
        return False
    tags.append(tag)
    return True


def is_setup(path: Path, source: str) -> bool:
    """Whether a code cell is one of the chapter's listed set-up cells (and long)."""
    lines = source.splitlines()
    return len(lines) > LONG and lines[0].startswith(SETUP.get(path.name[:2], ("\0",)))


def tidy(path: Path, write: bool = True) -> list[str]:
    """Apply both changes to one notebook (saved only if write); return what changed."""
    nb = nbformat.read(path, as_version=4)
    changes = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        lines = cell.source.splitlines()
        if MARKER in (line.strip() for line in lines):
            cell.source = "\n".join(line for line in lines if line.strip() != MARKER).lstrip("\n")
            _add_tag(cell, IGNORE_TAG)
            changes.append(f"cell {i}: {MARKER} -> tag {IGNORE_TAG}")
        elif any(line.strip().startswith("# NBVAL_") for line in lines):
            raise SystemExit(f"{path.name} cell {i}: an nbval comment this script does not move")
        if is_setup(path, cell.source) and _add_tag(cell, HIDE_TAG):
            changes.append(f"cell {i}: tag {HIDE_TAG}")
    hidden = [c.source for c in nb.cells if HIDE_TAG in c.metadata.get("tags", [])]
    for start in SETUP.get(path.name[:2], ()):
        if not any(source.startswith(start) for source in hidden):
            raise SystemExit(f"{path.name}: no set-up cell of over {LONG} lines starts {start!r}")
    if changes and write:
        nbformat.validate(nb)
        nbformat.write(nb, path)
    return changes


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [Path(a) for a in argv if a != "--check"]
    pending = False
    for path in paths or sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        for change in tidy(path, write=not check):
            print(f"{path.name} {change}")
            pending = True
    return int(check and pending)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
