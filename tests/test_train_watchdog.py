"""``--step-timeout`` runs only under a live torchrun file timer: TORCHELASTIC_TIMER_FILE must
name a FIFO that a timer server reads. A stale value (a regular file, a FIFO nobody reads, a
missing path) is refused at start-up, and the file it names is left as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from refimpl.train import parse_args


def _refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], path: Path
) -> str:
    monkeypatch.setenv("TORCHELASTIC_TIMER_FILE", str(path))
    with pytest.raises(SystemExit) as info:
        parse_args(["--step-timeout", "5"])
    assert info.value.code == 2  # argparse's usage error, before anything runs
    err = capsys.readouterr().err
    assert f"TORCHELASTIC_TIMER_FILE={path}" in err and "TORCHELASTIC_ENABLE_FILE_TIMER=1" in err
    return err


@pytest.mark.timeout(30)
def test_a_stale_timer_file_that_is_a_regular_file_is_refused_and_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: accepted; torch's client opened it write-only and wrote its JSON requests over
    the file's first bytes, and no server ever read them: no watchdog at all."""
    stale = tmp_path / "notes.txt"
    stale.write_text("someone's file\n" * 100)
    err = _refused(monkeypatch, capsys, stale)
    assert "not a FIFO (named pipe) but a regular file" in err
    assert stale.read_text() == "someone's file\n" * 100


@pytest.mark.timeout(30)
def test_a_timer_fifo_nobody_reads_or_a_missing_path_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(tmp_path / "orphan")  # its timer server is gone
    assert "is a FIFO but no process reads it" in _refused(monkeypatch, capsys, tmp_path / "orphan")
    assert "No such file or directory" in _refused(monkeypatch, capsys, tmp_path / "gone")
    assert "but a directory" in _refused(monkeypatch, capsys, tmp_path)


@pytest.mark.timeout(30)
def test_a_timer_fifo_with_a_reader_is_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    os.mkfifo(tmp_path / "timer")
    reader = os.open(tmp_path / "timer", os.O_RDONLY | os.O_NONBLOCK)
    try:
        monkeypatch.setenv("TORCHELASTIC_TIMER_FILE", str(tmp_path / "timer"))
        assert parse_args(["--step-timeout", "5"]).step_timeout == 5.0
        assert os.read(reader, 100) == b""  # the check wrote nothing to the server
    finally:
        os.close(reader)
