"""Every notebook is committed executed: top to bottom in one run, with outputs, no errors.

nbval compares against the committed outputs, so a notebook saved without them would pass
nbval vacuously; this test is what stops that."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from helpers.scripts import load_script

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
harness_out_of_sight = load_script("tools/harness_out_of_sight.py")


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, "no notebooks found under notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_saved_executed_with_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name} has no code cells"
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{path.name}: execution counts {counts} are not 1..{len(code)}; re-run it with "
        "`make notebooks` so it is executed top to bottom in one kernel"
    )
    with_output = [c for c in code if c.outputs]
    assert len(with_output) >= len(code) // 2, f"{path.name}: most code cells have no output"
    for i, cell in enumerate(code, 1):
        for out in cell.outputs:
            assert out.output_type != "error", f"{path.name} cell {i}: saved with an error"
            text = out.get("text", "")
            assert "Traceback (most recent call last)" not in text, f"{path.name} cell {i}"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_ignored_outputs_are_checked_another_way(path: Path) -> None:
    """A cell whose output nbval ignores must prove its point with an assert instead."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        ignored = "nbval-ignore-output" in cell.metadata.get("tags", [])
        if cell.cell_type == "code" and (ignored or "NBVAL_IGNORE_OUTPUT" in cell.source):
            assert "assert " in cell.source, (
                f"{path.name}: a cell whose output nbval ignores has no assert:\n{cell.source}"
            )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_harness_is_out_of_sight(path: Path) -> None:
    """nbval's markers are cell tags, not comments the reader sees, and the long set-up cells
    are collapsed: tools/harness_out_of_sight.py has nothing left to change."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        visible = [line for line in cell.source.splitlines() if line.strip().startswith("# NBVAL_")]
        assert not visible, (
            f"{path.name} cell {i}: {visible[0]} (run tools/harness_out_of_sight.py)"
        )
    assert harness_out_of_sight.tidy(path, write=False) == [], (
        f"{path.name}: run tools/harness_out_of_sight.py"
    )
