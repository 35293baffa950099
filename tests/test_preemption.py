"""refimpl.preemption: a real SIGTERM to a running trainer finishes the step, saves, exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from workers import preemption as w

from refimpl.checkpoint import list_checkpoints, load_latest
from refimpl.launch import spawn
from refimpl.preemption import StopOnSigterm

SCRIPT = Path(__file__).parent / "workers" / "preemption_script.py"


def _run_and_signal(ckpt: Path, *extra: str) -> tuple[int, list[str]]:
    """Start the script, SIGTERM it once it has started step 3."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("PYTHONUNBUFFERED", None)
    cmd = [sys.executable, str(SCRIPT), str(ckpt), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == "start 3":
                proc.send_signal(signal.SIGTERM)
                break
        lines += [ln.strip() for ln in proc.stdout]
        return proc.wait(timeout=120), lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_finishes_the_step_saves_it_and_exits_0(tmp_path: Path, signals: int) -> None:
    """SIGTERM during step 3 or later (and a second one in the middle of that step): every
    step started is finished, none starts after, the last one is saved with its state, and
    the exit is 0."""
    code, lines = _run_and_signal(tmp_path / "ckpt", *(["--again"] if signals == 2 else []))
    assert code == 0, lines
    starts = [ln for ln in lines if ln.startswith("start")]
    dones = [ln for ln in lines if ln.startswith("done")]
    assert [s.split()[1] for s in starts] == [d.split()[1] for d in dones], lines
    last = int(dones[-1].split()[1])
    assert lines[-1] == f"stopped after step {last}, saved; {signals} SIGTERM"
    found = load_latest(tmp_path / "ckpt")
    assert found is not None and found[0] == last
    assert found[1]["step"] == last and found[1]["total"].item() == last * (last + 1) / 2


@pytest.mark.timeout(150)
def test_without_the_guard_sigterm_ends_the_step_half_done_and_saves_nothing(
    tmp_path: Path,
) -> None:
    """The failure it prevents: Python's default for SIGTERM ends the process in the middle
    of step 3, killed by the signal, with nothing saved."""
    code, lines = _run_and_signal(tmp_path / "ckpt", "--no-guard")
    assert code == -signal.SIGTERM and lines[-1] == "start 3", lines
    assert list_checkpoints(tmp_path / "ckpt") == []


@pytest.mark.timeout(120)
def test_should_stop_stops_every_rank_after_the_same_step() -> None:
    """Rank 1 alone gets SIGTERM during step 3; both ranks learn it from should_stop and stop
    after step 3, and each rank's SIGTERM handler is back to what it was."""
    assert spawn(w.stop_when_one_rank_is_signalled, 2, timeout_s=90) == [(3, True), (3, True)]


def test_the_handler_is_put_back_and_the_main_thread_is_required() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSigterm() as preempt:
        assert signal.getsignal(signal.SIGTERM) != before
        os.kill(os.getpid(), signal.SIGTERM)
        assert preempt.requested and preempt.received == 1 and preempt.should_stop()
    assert signal.getsignal(signal.SIGTERM) == before
    import threading

    errors: list[BaseException] = []

    def enter() -> None:
        try:
            with StopOnSigterm():
                pass
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=enter)
    t.start()
    t.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])
