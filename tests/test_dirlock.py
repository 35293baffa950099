"""refimpl.dirlock: one writer per checkpoint directory, and a directory that can be written.

A second writer is refused at start, naming the holder; a killed holder (SIGKILL) leaves no
stale lock, not even through a forked child; an earlier torchrun attempt of the same job is
waited for; the lock file is never taken for a step by any lister, loader, pruner or the CLI.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.sharded_models import fresh, trained

from refimpl._checkpoint_cli import main as cli_main
from refimpl.atomic import remove_stale_temps
from refimpl.checkpoint import CheckpointError, list_checkpoints, load_latest, save_checkpoint
from refimpl.demos.faults import make_state
from refimpl.dirlock import LOCK_FILE, DirLock, DirLocked, Holder, check_writable
from refimpl.sharded import load_sharded, save_sharded
from refimpl.train._resume import refuse_fresh_start

_HOLD = """
import os, sys, time
from refimpl.dirlock import DirLock
DirLock(sys.argv[1]).acquire()
if sys.argv[2] == "fork":  # a DataLoader-like child, forked after the lock was taken
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print(child, flush=True)
print("locked", flush=True)
time.sleep(600)
"""


def _holder(
    d: Path, mode: str = "plain", env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], int | None]:
    """A process that holds ``d``'s lock (and, with ``mode="fork"``, a forked child's pid)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(d), mode],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline()) if mode == "fork" else None
    assert proc.stdout.readline().strip() == "locked"
    return proc, child


@pytest.fixture
def no_torchrun(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    yield


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_torchrun")
def test_a_second_writer_is_refused_naming_the_holder_and_sigkill_leaves_no_stale_lock(
    tmp_path: Path,
) -> None:
    proc, _ = _holder(tmp_path)
    try:
        with pytest.raises(DirLocked) as exc:
            DirLock(tmp_path).acquire()
        text = str(exc.value)
        assert str(tmp_path) in text and f"pid {proc.pid}" in text, text
        assert f"host {socket.gethostname()}" in text and "another checkpoint directory" in text
        assert exc.value.holder == Holder(socket.gethostname(), proc.pid, "", 0, os.getpid())
    finally:
        proc.send_signal(signal.SIGKILL)  # no cleanup code runs: only the kernel can unlock
        proc.wait(30)
    with DirLock(tmp_path) as lock:  # at once, no stale lock to remove
        assert lock.held
    assert (tmp_path / LOCK_FILE).is_file()  # never removed: a new file would be a new lock


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_torchrun")
def test_a_forked_child_does_not_keep_a_dead_holders_lock(tmp_path: Path) -> None:
    """A DataLoader worker forked by the holder outlives it: the lock must still go with it."""
    proc, child = _holder(tmp_path, "fork")
    assert child is not None
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        os.kill(child, 0)  # the child still runs, with a copy of every descriptor but ours
        lock = DirLock(tmp_path)
        lock.acquire()
        lock.release()
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_torchrun_restart_waits_for_its_earlier_attempt_another_job_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder is attempt 0 of run ``job1``. Attempt 1 of ``job1`` (a restart whose
    predecessor is still being stopped) waits and gets the lock when it dies; another run is
    refused without waiting, and so is another job under torchrun's shared default id."""
    proc, _ = _holder(
        tmp_path, env={"TORCHELASTIC_RUN_ID": "job1", "TORCHELASTIC_RESTART_COUNT": "0"}
    )
    try:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job2")
        with pytest.raises(DirLocked, match="torchrun run job1 attempt 0") as exc:
            DirLock(tmp_path, restart_wait_s=600).acquire()  # another job: no wait
        assert "waited" not in str(exc.value)
        none = Holder("h", 1, "none", 0, agent=10)  # torchrun's default id: agent and count
        assert none.earlier_attempt_of(Holder("h", 2, "none", 1, agent=10))
        assert not none.earlier_attempt_of(Holder("h", 2, "none", 1, agent=11))  # other job
        assert not none.earlier_attempt_of(Holder("h", 2, "none", 0, agent=10))
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
        with pytest.raises(DirLocked, match=r"earlier attempt of this job; waited 0 s"):
            DirLock(tmp_path, restart_wait_s=0).acquire()
        lock = DirLock(tmp_path, restart_wait_s=600)
        got: list[BaseException | None] = []
        waiter = threading.Thread(target=lambda: got.append(_try(lock.acquire)))
        waiter.start()
        proc.send_signal(signal.SIGKILL)  # the agent's SIGKILL of the old worker
        waiter.join(120)
        assert got == [None] and lock.held
        lock.release()
    finally:
        proc.kill()
        proc.wait(30)


def _try(fn: object) -> BaseException | None:
    try:
        fn()  # type: ignore[operator]
    except BaseException as exc:  # handed to the test thread
        return exc
    return None


@pytest.mark.timeout(60)
def test_the_lock_file_is_no_step_for_any_lister_loader_pruner_or_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files, sharded = tmp_path / "files", tmp_path / "sharded"
    for root in (files, sharded):
        with DirLock(root):
            assert load_latest(root) is None  # only the lock file: a fresh start
            assert refuse_fresh_start(str(root), root == sharded, []) is None
    model, opt = fresh()
    assert load_sharded(sharded, model, opt) is None  # an empty root, not an error
    with DirLock(files), DirLock(sharded, collective=False):
        for step in (1, 2, 3):
            save_checkpoint(files, make_state(step, 10), step, keep_last=2)  # prunes step 1
            save_sharded(sharded, *trained(), step, keep_last=2)
        for root in (files, sharded):
            assert [s for s, _ in list_checkpoints(root)] == [2, 3]
            assert sorted(p.name for p in root.iterdir()) == [
                LOCK_FILE,
                "step_00000002",
                "step_00000003",
            ]
            assert remove_stale_temps(root) == []
            capsys.readouterr()
            assert cli_main(["list", str(root)]) == 0
            assert cli_main(["verify", str(root)]) == 0
            out = capsys.readouterr().out
            assert LOCK_FILE not in out and "BAD" not in out, out
        found = load_latest(files)
        assert found is not None and found[0] == 3
        assert load_sharded(sharded, *fresh()) == 3


@pytest.mark.timeout(30)
def test_an_unwritable_directory_is_refused_at_start(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("not a directory")
    with pytest.raises(CheckpointError, match=r"cannot be written.*another checkpoint directory"):
        check_writable(target / "ckpt")
    with pytest.raises(CheckpointError, match="cannot be written"):
        DirLock(target / "ckpt").acquire()
    check_writable(tmp_path / "new" / "ckpt")  # created, probed, left empty
    assert list((tmp_path / "new" / "ckpt").iterdir()) == []


def _train_cmd(ckpt: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "refimpl.train",
        "--samples",
        "64",
        "--save-every",
        "2",
        "--progress",
        "never",
        "--ckpt-dir",
        str(ckpt),
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.usefixtures("no_torchrun")
def test_a_second_train_job_in_one_ckpt_dir_is_refused_and_the_first_runs_on(
    tmp_path: Path,
) -> None:
    """Job A runs; the same job submitted again (B) must stop before it loads or trains,
    naming the directory and A's pid; A, stopped by SIGTERM, saves and exits 0."""
    ckpt = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    a = subprocess.Popen(
        _train_cmd(ckpt, "--steps", "100000", "--step-sleep", "0.05"),
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert a.stdout is not None
        for line in a.stdout:  # A has saved a step: B would resume A's model
            if line.startswith("[rank0] saved step_00000002"):
                break
        b = subprocess.run(
            _train_cmd(ckpt, "--steps", "4"), capture_output=True, text=True, env=env, timeout=120
        )
        assert b.returncode != 0, b.stdout
        assert f"{ckpt}: rank 0: is in use by another run" in b.stderr, b.stderr[-3000:]
        assert f"pid {a.pid}" in b.stderr and "another checkpoint directory" in b.stderr
        assert " loss " not in b.stdout and "resumed" not in b.stdout, b.stdout
        a.send_signal(signal.SIGTERM)
        rest = a.stdout.read()
        assert a.wait(60) == 0 and "SIGTERM: stopped after step" in rest, rest
    finally:
        a.kill()
        a.wait(30)


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_torchrun_restart_after_rank_0_is_sigkilled_gets_the_lock_and_finishes(
    tmp_path: Path,
) -> None:
    """Rank 0 (the lock's holder) SIGKILLed at step 5: the restarted rank 0, a new process of
    the same job, gets the lock and finishes from step 4."""
    from refimpl.demos.train import attempts, run_train

    args = [
        "--steps",
        "8",
        "--save-every",
        "4",
        "--samples",
        "64",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        # The kill is sent when rank 0's "step 5" line is read; without a pause between steps
        # a loaded machine read it after step 8 was saved (the restart then resumed from 8).
        "--step-sleep",
        "0.5",
    ]
    run = run_train(args, kills=[(0, 5)], timeout_s=150)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-3000:]}"
    summary = attempts(run.events)
    assert [a["resumed_from"] for a in summary] == [0, 4], run.stdout
    assert summary[-1]["end"] == "done at step 8"
    assert "in use by another run" not in run.stdout + run.stderr


def _read_only(cmd: list[str], d: Path) -> list[str]:
    """``cmd`` run with ``d`` read-only: mode 0555 for a user, a read-only bind mount in a
    private mount namespace for root (whom modes do not stop)."""
    if os.geteuid() != 0:
        d.chmod(0o555)
        return cmd
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"]).returncode:
        pytest.skip("root without mount namespaces: no way to make a directory read-only")
    mount = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, str(d), *cmd]


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_a_read_only_ckpt_dir_is_refused_before_the_first_step(tmp_path: Path) -> None:
    """Found at the first save, on every restart, it was: now at start, before any step."""
    ckpt = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    first = subprocess.run(
        _train_cmd(ckpt, "--steps", "4"), capture_output=True, text=True, env=env, timeout=120
    )
    assert first.returncode == 0, first.stderr[-3000:]
    cmd = _read_only(_train_cmd(ckpt, "--steps", "8"), ckpt)
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    finally:
        ckpt.chmod(0o755)
    assert run.returncode != 0, run.stdout
    assert f"{ckpt}: rank 0: cannot be written (Read-only file system" in run.stderr or (
        os.geteuid() != 0 and "cannot be written (Permission denied" in run.stderr
    ), run.stderr[-3000:]
    assert "another checkpoint directory" in run.stderr
    assert " loss " not in run.stdout and "resumed" not in run.stdout, run.stdout
    assert [s for s, _ in list_checkpoints(ckpt)] == [2, 4]


@pytest.mark.timeout(30)
def test_a_holder_being_torn_down_is_recognised_from_proc() -> None:
    """A SIGKILLed holder keeps its lock until the kernel closes its descriptors, which comes
    after freeing its memory; such a holder is waited for, not refused (`_exiting`)."""
    from refimpl.dirlock import _exiting

    live = Path("/proc/self/stat").read_text(), Path("/proc/self/status").read_text()
    assert not _exiting(*live)
    head = "123 (a (b) c) S 1 123 123 0 -1 "  # a name with spaces and parentheses
    assert _exiting(head.replace(" S ", " Z ") + "4194560 0", "")  # a zombie
    assert _exiting(head + "4194564 0", "")  # flags with PF_EXITING (0x4)
    assert not _exiting(head + "4194560 0", "SigPnd:\t0000000000000000\n")
    assert _exiting(head + "4194560 0", "ShdPnd:\t0000000000000100\n")  # SIGKILL pending
