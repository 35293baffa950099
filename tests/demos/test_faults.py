"""Kill the saver: SIGKILL a child process at random moments while it saves, and check what
the next run would load. refimpl's writers must never leave a torn or stale checkpoint;
plain torch.save is the control that shows the test can see torn files at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from refimpl.atomic import TEMP_TAG
from refimpl.checkpoint import load_latest, save_checkpoint
from refimpl.demos.faults import (
    KillReport,
    kill_trials,
    main,
    make_state,
)


def _assert_survived(report: KillReport, kills: int) -> None:
    assert report.kills == kills
    assert report.saves_returned > 0, "the child never finished a save: kills came too early"
    assert report.ok, report.examples


@pytest.mark.slow
def test_checkpoint_survives_30_random_kills(tmp_path: Path) -> None:
    report = kill_trials("checkpoint", tmp_path, 30, seed=1)
    _assert_survived(report, 30)
    found = load_latest(tmp_path)
    assert found is not None and found[1]["meta"] == make_state(found[0], 1)["meta"]


@pytest.mark.slow
def test_async_checkpoint_survives_30_random_kills(tmp_path: Path) -> None:
    """Kills land while a save is staged, written or committed in the background: the next
    run still loads a complete step, never older than the last save known to be committed."""
    report = kill_trials("async", tmp_path, 30, seed=5)
    _assert_survived(report, 30)
    found = load_latest(tmp_path)
    assert found is not None and found[1]["meta"] == make_state(found[0], 1)["meta"]


@pytest.mark.slow
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
