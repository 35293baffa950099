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


# --- the reap signal: only the timer server's ends the worker ----------------------------

_WORKER = """
import os, resource, sys, time
from refimpl.train._watchdog import Watchdog
from refimpl.atomic import atomic_write_bytes
watchdog = Watchdog(float(sys.argv[2]))
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # ulimit -f: a real file-size limit
try:
    atomic_write_bytes(b"x" * 10000, sys.argv[1])  # how refimpl.train writes its files
except OSError as exc:
    print("write:", exc, flush=True)
reader, writer = os.pipe()
os.close(reader)
try:
    os.write(writer, b"x")  # the kernel's own SIGPIPE, to this thread
except OSError as exc:
    print("pipe:", exc, flush=True)
print("stuck", flush=True)
with watchdog.guard("step"):
    time.sleep(600)  # a step that never ends
"""


@pytest.mark.timeout(120)
def test_a_file_size_limit_is_an_error_and_only_the_timer_server_ends_the_worker(
    tmp_path: Path,
) -> None:
    """Before: the watchdog's signal was SIGXFSZ with its default action restored, so a real
    ``ulimit -f`` killed the worker (status -25, a core dump where allowed) instead of raising
    ``OSError: File too large`` naming the file. Now a write past the limit and a write to a
    dead pipe are errors, and the timer server (torch's own FileTimerServer, in this process as
    in torchrun's agent) ends the stuck worker with REAP_SIGNAL, which this process, like the
    agent, survives receiving itself."""
    import signal
    import subprocess
    import sys

    from torch.distributed.elastic.timer import FileTimerServer

    from refimpl.train._watchdog import REAP_SIGNAL

    assert signal.getsignal(REAP_SIGNAL) == signal.SIG_IGN  # Python's start-up default
    fifo = tmp_path / "timer"
    server = FileTimerServer(str(fifo), run_id="test", max_interval=0.1, daemon=True)
    server.start()
    try:
        env = {**os.environ, "TORCHELASTIC_TIMER_FILE": str(fifo)}
        big = tmp_path / "big.bin"
        cmd = [sys.executable, "-c", _WORKER, str(big), "1"]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)
    finally:
        server.stop()
    assert f"write: [Errno 27] atomic write of {big} failed (File too large)" in run.stdout, run
    assert "pipe: [Errno 32] Broken pipe" in run.stdout, run
    assert "stuck" in run.stdout
    assert run.returncode == -REAP_SIGNAL, run  # ended by the server, not by the kernel
    assert REAP_SIGNAL not in (signal.SIGXFSZ, signal.SIGKILL)
