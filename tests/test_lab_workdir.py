"""`make lab` serves a working copy (tools/lab_workdir.py): a run never dirties the repo."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
lab_workdir = load_script("tools/lab_workdir.py")

pytestmark = pytest.mark.timeout(60)
CHAPTERS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))


def test_copies_every_chapter_once_and_links_the_book(tmp_path: Path) -> None:
    messages = lab_workdir.prepare(tmp_path)
    assert sorted(p.name for p in (tmp_path / "notebooks").iterdir()) == CHAPTERS
    assert (tmp_path / "book").resolve() == (ROOT / "book").resolve()
    assert (tmp_path / "notebooks" / "../book/figures").is_dir()  # the chapters' relative path
    assert f"copied {len(CHAPTERS)} chapter(s)" in messages[1]


def test_keeps_the_readers_copy_and_names_a_stale_one(tmp_path: Path) -> None:
    lab_workdir.prepare(tmp_path)
    mine = tmp_path / "notebooks" / CHAPTERS[0]
    mine.write_text("my edits")
    old = (ROOT / "notebooks" / CHAPTERS[0]).stat().st_mtime - 60
    os.utime(mine, (old, old))  # the committed chapter is newer than this copy

    messages = lab_workdir.prepare(tmp_path)
    assert mine.read_text() == "my edits"  # never overwritten
    assert len(messages) == 2 and CHAPTERS[0] in messages[1] and f"delete {mine}" in messages[1]

    os.utime(mine, None)  # edited after the committed chapter: no message
    assert lab_workdir.prepare(tmp_path) == messages[:1]
