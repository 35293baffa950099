"""Kill the saver: SIGKILL a child process at random moments while it saves, and check what
the next run would load. refimpl's writers must never leave a torn or stale checkpoint;
plain torch.save is the control that shows the test can see torn files at all."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from refimpl.atomic import TEMP_TAG
from refimpl.checkpoint import load_latest, save_checkpoint
from refimpl.demos.faults import (
    KillReport,
    flip_bit_in_record,
    kill_trials,
    main,
    make_state,
    rename_like_an_object_store,
)


def _assert_survived(report: KillReport, kills: int) -> None:
    assert report.kills == kills
    assert report.saves_returned > 0, "the child never finished a save: kills came too early"
    assert report.ok, report.examples


def test_checkpoint_survives_30_random_kills(tmp_path: Path) -> None:
    report = kill_trials("checkpoint", tmp_path, 30, seed=1)
    _assert_survived(report, 30)
    found = load_latest(tmp_path)
    assert found is not None and found[1]["meta"] == make_state(found[0], 1)["meta"]


def test_atomic_save_survives_25_random_kills(tmp_path: Path) -> None:
    _assert_survived(kill_trials("atomic", tmp_path, 25, seed=2), 25)


def test_plain_torch_save_is_torn_by_the_same_kills(tmp_path: Path) -> None:
    """The control: without the protocol, the same kills leave files torch.load rejects."""
    report = kill_trials("plain", tmp_path, 10, seed=3)
    assert report.torn > 0, report
    assert any("torn" in e for e in report.examples)


def test_temps_left_by_kills_are_cleaned_by_the_next_save(tmp_path: Path) -> None:
    kill_trials("checkpoint", tmp_path, 5, seed=4)
    last = load_latest(tmp_path)
    step = 1 if last is None else last[0] + 1
    save_checkpoint(tmp_path, make_state(step), step, keep_last=2)
    assert [p.name for p in tmp_path.iterdir() if TEMP_TAG in p.name] == []


def test_unknown_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        kill_trials("yolo", tmp_path, 1)


def test_command_line_reports_and_exits_zero(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    rc = main(
        [
            "--kills",
            "3",
            "--modes",
            "atomic,checkpoint",
            "--dir",
            str(tmp_path),
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "atomic: 3 kills" in out and "checkpoint: 3 kills" in out
    assert (tmp_path / "r.json").exists()


def test_torch_load_ignores_the_crc_that_zipfile_checks(tmp_path: Path) -> None:
    """The chapter's claim: torch.save writes a CRC-32 per record, torch.load never checks it."""
    path = tmp_path / "w.pt"
    w = torch.arange(1000, dtype=torch.float32)
    torch.save({"w": w}, path)
    record = flip_bit_in_record(path, "data/0", offset=4 * 500 + 3)  # exponent byte of w[500]
    loaded = torch.load(path, weights_only=True)["w"]  # no error ...
    assert (loaded != w).nonzero().flatten().tolist() == [500] and loaded[500] == 125.0
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() == record == "w/data/0"  # ... but the CRC names the record
    with pytest.raises(ValueError, match="out of range"):
        flip_bit_in_record(path, "data/0", offset=4000)


def test_an_object_store_rename_copies_the_marker_first(tmp_path: Path) -> None:
    for step in (1, 2):
        save_checkpoint(tmp_path / "ckpt", make_state(step, 100), step)
    step_dir = tmp_path / "ckpt" / "step_00000002"
    staged = step_dir.rename(tmp_path / "staged")
    copied = rename_like_an_object_store(staged, step_dir, crash_after=2)
    assert copied == ["COMMITTED", "MANIFEST.json"] and staged.exists()
    skipped: list[str] = []
    found = load_latest(tmp_path / "ckpt", on_skip=lambda d, why: skipped.append(why))
    assert found is not None and found[0] == 1 and "missing" in skipped[0]
    rename_like_an_object_store(staged, step_dir)  # finishing the copy deletes the source
    assert not staged.exists() and load_latest(tmp_path / "ckpt") is not None
