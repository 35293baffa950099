"""Execute notebooks in place, top to bottom, and normalise them for committing.

Usage: python tools/run_notebooks.py notebooks/01_processes_ranks_collectives.ipynb [...]

The committed outputs are the book's evidence: nbval re-executes every notebook in CI and
compares against them, and the HTML book is built from them. Run this after editing a
notebook or anything in src/refimpl that a notebook uses.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}


def run(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    start = time.monotonic()
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        record_timing=False,
        store_widget_state=True,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    nb.metadata = {
        "kernelspec": KERNEL,
        "language_info": {"name": "python"},
        **({"widgets": nb.metadata["widgets"]} if "widgets" in nb.metadata else {}),
    }
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            raise SystemExit(f"{path}: a cell raised {errors[0]['ename']}; fix it first")
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return time.monotonic() - start


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        seconds = run(Path(arg))
        print(f"{arg}: executed in {seconds:.1f} s")
