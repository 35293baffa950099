"""Words of main text per chapter: the prose a reader meets without opening anything.

Usage: ``python tools/book_words.py [notebooks/NN_x.ipynb ...]`` (default: every chapter).

Main text is the markdown cells' prose outside collapsed blocks. Left out: fenced code
(```` ``` ```` / ``~~~`` blocks whose info string is not a MyST directive), MyST directives with
``:class: dropdown`` or of kind ``dropdown``/``toggle`` (the depth a reader opens on demand),
HTML and MyST comments (``<!-- -->``, lines starting ``%``), and directives' options. A
collapsed block's title counts as main text (the reader sees it and clicks it), and so does a
directive that is not collapsed (a note, a figure's caption).
The targets (issue 40): at most ``CHAPTER_LIMIT`` words per chapter, under ``BOOK_LIMIT`` for
the whole book; ``tests/test_book_structure.py`` checks them.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHAPTER_LIMIT = 4500
BOOK_LIMIT = 40000

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,}|:{3,})\s*(\{([\w-]+)\})?(.*)$")
_COLLAPSED_KINDS = {"dropdown", "toggle"}


@dataclass(frozen=True)
class ChapterWords:
    """One chapter's count: ``main`` words a reader sees, ``collapsed`` words behind a click."""

    path: Path
    main: int
    collapsed: int


def _count(text: str) -> int:
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    return len(text.split())


def markdown_words(source: str) -> tuple[int, int]:
    """(main, collapsed) words of one markdown cell's source."""
    main = collapsed = 0
    # A stack of open fences: (marker, is_code, collapsed).
    stack: list[tuple[str, bool, bool]] = []
    for line in source.splitlines():
        stripped = line.strip()
        if stack and stripped == stack[-1][0]:
            stack.pop()
            continue
        match = _FENCE.match(line)
        if match and (not stack or not stack[-1][1]):
            marker, kind = match.group(2), match.group(4)
            is_code = kind is None and not marker.startswith(":")
            outer_collapsed = bool(stack) and stack[-1][2]
            stack.append((marker, is_code, outer_collapsed or kind in _COLLAPSED_KINDS))
            # A title is seen even when its block is collapsed (it is what the reader clicks).
            outer_hidden = len(stack) > 1 and stack[-2][2]
            title = "" if is_code else match.group(5)
            if outer_hidden:
                collapsed += _count(title)
            else:
                main += _count(title)
            continue
        if stack and stack[-1][1]:
            continue  # code
        if stack and stripped.startswith(":") and re.match(r"^:[\w-]+:", stripped):
            if re.match(r"^:class:.*\bdropdown\b", stripped):
                marker, is_code, _ = stack[-1]
                stack[-1] = (marker, is_code, True)
            continue  # a directive's option
        if stripped.startswith("%"):
            continue  # a MyST comment
        if stack and stack[-1][2]:
            collapsed += _count(line)
        else:
            main += _count(line)
    return main, collapsed


def chapter_words(path: Path) -> ChapterWords:
    """The counts of one notebook's markdown cells."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    main = collapsed = 0
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        m, c = markdown_words("".join(cell["source"]))
        main += m
        collapsed += c
    return ChapterWords(path=path, main=main, collapsed=collapsed)


def book_words(paths: list[Path] | None = None) -> list[ChapterWords]:
    """Counts for the given notebooks, or for every chapter under ``notebooks/``."""
    if not paths:
        paths = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    return [chapter_words(p) for p in paths]


def main(argv: list[str]) -> int:
    rows = book_words([Path(a) for a in argv])
    for row in rows:
        flag = "  over" if row.main > CHAPTER_LIMIT else ""
        print(f"{row.path.name:50s} main {row.main:6d}  collapsed {row.collapsed:6d}{flag}")
    total = sum(r.main for r in rows)
    print(f"{'total':50s} main {total:6d}  collapsed {sum(r.collapsed for r in rows):6d}")
    print(f"targets: at most {CHAPTER_LIMIT} per chapter, under {BOOK_LIMIT} in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
