"""Prepare the working copy that `make lab` serves, so a reader's run never touches the repo.

Usage: python tools/lab_workdir.py DIR

JupyterLab saves a notebook whenever its autosave timer fires, and a notebook that was run
comes back with new outputs: served from `notebooks/`, one "Run All" rewrites a committed
(checked) chapter. `make lab` therefore serves DIR (default `lab/`, ignored by git):
DIR/notebooks holds a copy of each chapter, and DIR/book links to the repository's `book/`
so that the chapters' `../book/figures` paths resolve. A copy is made once; after that the
reader's copy is theirs (edits and outputs kept across `make lab` runs). When the committed
chapter is newer than the copy, this says so and names the file to delete for a fresh one.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prepare(workdir: Path) -> list[str]:
    """Copy missing chapters into ``workdir/notebooks`` and link the book; return messages."""
    notebooks = workdir / "notebooks"
    notebooks.mkdir(parents=True, exist_ok=True)
    book = workdir / "book"
    if not book.is_symlink() and not book.exists():
        book.symlink_to(ROOT / "book", target_is_directory=True)
    copied, stale = [], []
    for source in sorted((ROOT / "notebooks").glob("*.ipynb")):
        copy = notebooks / source.name
        if not copy.exists():
            shutil.copy2(source, copy)
            copied.append(source.name)
        elif source.stat().st_mtime > copy.stat().st_mtime and source.read_bytes() != (
            copy.read_bytes()
        ):
            stale.append(copy)
    messages = [f"make lab: serving {notebooks} (a copy; notebooks/ stays as committed)"]
    if copied:
        messages.append(f"  copied {len(copied)} chapter(s): {', '.join(copied)}")
    for copy in stale:
        messages.append(
            f"  {copy.name}: the committed chapter is newer than your copy; "
            f"delete {copy} and rerun `make lab` for the new one (your edits there go)"
        )
    return messages


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    for line in prepare(Path(argv[0]).resolve()):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
