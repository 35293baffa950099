"""Chapter 10: `refimpl.train` killed under torchrun, preempted by SIGTERM, run alone.

The claim each test checks is the book's: a run that loses a worker (or gets SIGTERM) and is
restarted ends with weights bit-identical (``torch.equal`` on every tensor) to a run that was
never interrupted, and a resume that leaves out part of the state (RNG, data position,
optimizer) does not. The trainer runs in subprocesses exactly as a reader starts it, with
``PYTHONUNBUFFERED`` removed (`run_train` does that), so the log lines checked here are the
ones a job's log file would hold. 12 steps of a small MLP; the dataset is 4 global batches, so
the checkpoints at step 4 and 8 sit on epoch boundaries.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from refimpl.checkpoint import PACK, list_checkpoints
from refimpl.demos.train import (
    Event,
    TrainRun,
    attempts,
    parse_log,
    plot_attempts,
    run_train,
    same_weights,
    train_command,
)
from refimpl.launch import WorkerError, spawn
from refimpl.train import main, parse_args

ARGS = ["--steps", "12", "--save-every", "4", "--samples", "64", "--seed", "3"]


def _args(d: Path, *extra: str) -> list[str]:
    return [*ARGS, "--ckpt-dir", str(d / "ckpt"), "--final-weights", str(d / "w.pt"), *extra]


def _ok(run: TrainRun) -> TrainRun:
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr[-4000:]}"
    return run


def _latest(ckpt: Path) -> int:
    return list_checkpoints(ckpt)[-1][0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainRun]:
    """An uninterrupted torchrun run on 2 ranks: the weights every other run must match."""
    d = tmp_path_factory.mktemp("reference")
    return d / "w.pt", _ok(run_train(_args(d), timeout_s=100))


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainRun]:
    """A torchrun run whose rank 1 (only) gets SIGTERM once rank 0 has logged step 5."""
    d = tmp_path_factory.mktemp("preempted")
    run = run_train(
        _args(d, "--step-sleep", "0.3"), sigterm_rank=1, sigterm_after_step=5, timeout_s=100
    )
    return d / "ckpt", run


# A worker killed at step 7 under torchrun, restarted, ending bit-identical with the same
# losses (the replayed steps' too), its last line in the log, no mixed lines: chapter 10's
# crash cells run and assert exactly that under nbval, so it is not run a second time here.


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step_and_saves_it(
    preempted: tuple[Path, TrainRun],
) -> None:
    ckpt, run = _ok(preempted[1]) and preempted
    stops = [e for e in run.events if e.kind == "stop"]
    assert sorted(e.rank for e in stops) == [0, 1] and len({e.step for e in stops}) == 1
    step = stops[0].step
    assert step is not None and 5 <= step < 12
    assert _latest(ckpt) == step  # the step it stopped at, even off the --save-every grid
    assert not any(e.kind in ("done", "final") for e in run.events)


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_resume_after_sigterm_is_bit_identical_under_spawn(
    reference: tuple[Path, TrainRun], preempted: tuple[Path, TrainRun], tmp_path: Path
) -> None:
    """The preempted run continued by `refimpl.launch.spawn` (the notebook's launcher)."""
    shutil.copytree(preempted[0], tmp_path / "ckpt")
    assert spawn(main, 2, _args(tmp_path), timeout_s=60) == [0, 0]
    assert same_weights(reference[0], tmp_path / "w.pt")


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.parametrize("forget", ["rng", "data", "optimizer"])
def test_negative_control_a_resume_that_forgets_state_ends_elsewhere(
    forget: str,
    reference: tuple[Path, TrainRun],
    preempted: tuple[Path, TrainRun],
    tmp_path: Path,
) -> None:
    shutil.copytree(preempted[0], tmp_path / "ckpt")
    assert spawn(main, 2, _args(tmp_path, "--no-restore", forget), timeout_s=60) == [0, 0]
    assert not same_weights(reference[0], tmp_path / "w.pt")


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_world_of_one_with_plain_python_sigterm_resume_and_rerun(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full, cut = tmp_path / "full", tmp_path / "cut"
    _ok(run_train(_args(full), launcher="python", timeout_s=60))
    stopped = _ok(
        run_train(
            _args(cut, "--step-sleep", "0.3"),
            launcher="python",
            sigterm_rank=0,
            sigterm_after_step=5,
            timeout_s=60,
        )
    )
    step = next(e.step for e in stopped.events if e.kind == "stop")
    assert step is not None and _latest(cut / "ckpt") == step
    assert not (cut / "w.pt").exists()
    resumed = _ok(run_train(_args(cut), launcher="python", timeout_s=60))
    assert attempts(resumed.events)[0]["resumed_from"] == step
    assert same_weights(full / "w.pt", cut / "w.pt")
    # Starting a finished run again is harmless: it finds step 12 and trains nothing (under
    # spawn, which is quicker to start; no arithmetic happens, so threads cannot matter).
    (cut / "w.pt").unlink()
    assert spawn(main, 1, _args(cut), timeout_s=60, rank_output="show") == [0]
    out = capsys.readouterr().out
    assert "resumed from step_12" in out and " loss " not in out
    assert same_weights(full / "w.pt", cut / "w.pt")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_corrupt_latest_checkpoint_is_skipped_and_its_steps_retrained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--steps", "8", "--save-every", "4", "--samples", "64", "--ckpt-dir", str(tmp_path)]
    assert spawn(main, 1, args, timeout_s=60) == [0]
    weights = tmp_path / "step_00000008" / PACK
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # one flipped bit pattern, same size: only the digest can tell
    weights.write_bytes(bytes(data))
    assert spawn(main, 1, args, timeout_s=60, rank_output="show") == [0]
    out = capsys.readouterr().out
    assert "skipped step_00000008: " in out and "resumed from step_4" in out
    assert "step 5 loss" in out and _latest(tmp_path) == 8


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("first_sharded", [True, False])
def test_a_forgotten_or_extra_sharded_flag_refuses_to_start_over_the_other_backends_steps(
    tmp_path: Path, first_sharded: bool
) -> None:
    """``--sharded`` then plain (or the reverse) on one --ckpt-dir: the other backend's steps
    are not loadable here, and starting at step 0 would overwrite them. The second run must
    stop, naming what it found and the flag to pass, and leave every step as it was."""
    ckpt = tmp_path / "ckpt"
    args = ["--steps", "2", "--save-every", "1", "--samples", "32", "--ckpt-dir", str(ckpt)]
    flag = ["--sharded"] if first_sharded else []
    _ok(run_train([*args, *flag], launcher="python", timeout_s=60))
    before = {d.name: sorted(p.name for p in d.iterdir()) for _, d in list_checkpoints(ckpt)}
    stamps = {d.name: (d / "MANIFEST.json").stat().st_mtime_ns for _, d in list_checkpoints(ckpt)}
    other = [] if first_sharded else ["--sharded"]
    run = run_train([*args, "--steps", "4", *other], launcher="python", timeout_s=60)
    assert run.returncode != 0, run.stdout
    out = run.stdout + run.stderr
    written = "written with --sharded" if first_sharded else "written without --sharded"
    advice = "run again with --sharded" if first_sharded else "run again without --sharded"
    assert written in out and advice in out, out[-3000:]
    assert " loss " not in run.stdout  # not one step trained
    after = {d.name: sorted(p.name for p in d.iterdir()) for _, d in list_checkpoints(ckpt)}
    assert after == before
    assert stamps == {
        d.name: (d / "MANIFEST.json").stat().st_mtime_ns for _, d in list_checkpoints(ckpt)
    }


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_committed_steps_that_all_fail_to_load_stop_the_trainer_with_the_reasons(
    tmp_path: Path,
) -> None:
    """Every committed step damaged: starting at 0 would overwrite them, so it stops instead."""
    args = ["--steps", "8", "--save-every", "4", "--samples", "64", "--ckpt-dir", str(tmp_path)]
    assert spawn(main, 1, args, timeout_s=60) == [0]
    for _, step_dir in list_checkpoints(tmp_path):
        weights = step_dir / PACK
        data = bytearray(weights.read_bytes())
        data[-100] ^= 0xFF
        weights.write_bytes(bytes(data))
    with pytest.raises(WorkerError) as exc:
        spawn(main, 1, args, timeout_s=60)
    text = str(exc.value)
    assert "none of them loads" in text and "step_00000004" in text, text
    assert "xxh3_128 mismatch" in text and "another --ckpt-dir" in text, text
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 8]


@pytest.mark.timeout(10)
def test_parse_args_refuses_nonsense() -> None:
    assert parse_args([]).save_every == 5
    with pytest.raises(SystemExit):
        parse_args(["--save-every", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--no-restore", "weights"])
    assert train_command(["--steps", "3"], launcher="python")[-3:] == [
        "refimpl.train",
        "--steps",
        "3",
    ]
    with pytest.raises(ValueError, match="launcher"):
        train_command([], launcher="mpirun")


BAD_FLAGS = [
    ("--steps", "-1"),
    ("--steps", "ten"),
    ("--save-every", "0"),
    ("--keep-last", "0"),
    ("--keep-last", "-2"),
    ("--ckpt-dir", ""),
    ("--final-weights", " "),
    ("--seed", "-1"),
    ("--seed", str(2**32)),
    ("--batch-size", "0"),
    ("--samples", "0"),
    ("--lr", "0"),
    ("--lr", "nan"),
    ("--lr", "-0.001"),
    ("--dropout", "1.5"),
    ("--dropout", "-0.1"),
    ("--pg-timeout", "0"),
    ("--pg-timeout", "-1"),
    ("--pg-timeout", "inf"),
    ("--save-timeout", "0"),
    ("--log-every", "0"),
    ("--fail-at-step", "0"),
    ("--fail-rank", "-2"),
    ("--step-sleep", "-1"),
    ("--step-sleep", "nan"),
    ("--sample-log", ""),
]


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("flag", "value"), BAD_FLAGS)
def test_every_bad_flag_is_a_parse_error_naming_it(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before anything starts (exit 2, argparse's ``argument FLAG: ...``), not at the
    first save on every rank (``--keep-last 0``) or as a raw C++ error (``--pg-timeout 0``)."""
    with pytest.raises(SystemExit) as exc:
        parse_args([flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must " in err, err


LOG = """\
W1123 torchrun noise
[rank1] start: world 2, restart 0, device cpu
[rank0] start: world 2, restart 0, device cpu
[rank0] no checkpoint in ckpt: starting at step 0
[rank0] step 1 loss 0.5
[rank0] step 2 loss 0.25
[rank0] saved step_00000002
[rank1] injected fault: exiting with code 1 at the start of step 3
[rank0] start: world 2, restart 1, device cpu
[rank1] start: world 2, restart 1, device cpu
[rank0] resumed from step_2
[rank0] step 3 loss 0.125
[rank0] SIGTERM: stopped after step 3, checkpoint saved; exit 0
"""


@pytest.mark.timeout(30)
def test_parse_log_and_attempts() -> None:
    events = parse_log(LOG)
    assert events[0] == Event(0, 1, "start", None)
    assert Event(0, 1, "fault", 3) in events and Event(1, 0, "loss", 3, 0.125) in events
    assert attempts(events) == [
        {
            "attempt": 0,
            "resumed_from": 0,
            "losses": {1: 0.5, 2: 0.25},
            "saved": [2],
            "end": "fault on rank 1 at step 3",
        },
        {
            "attempt": 1,
            "resumed_from": 2,
            "losses": {3: 0.125},
            "saved": [],
            "end": "SIGTERM after step 3",
        },
    ]
    import matplotlib

    matplotlib.use("Agg")
    ax = plot_attempts(attempts(events))
    assert [t.get_text() for t in ax.get_yticklabels()] == ["attempt 0", "attempt 1"]
    label_x = {t.get_text(): t.get_position()[0] for t in ax.texts}
    assert label_x["fault on rank 1 at step 3"] > 3.4  # right of the cross at step 3, not on it


# --- Issue 18: the README's command, as printed, with no setting in the environment --------

README = ["--steps", "30", "--save-every", "5", "--seed", "3", "--ckpt-dir", "ck"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_readme_command_survives_a_killed_worker_5_times_in_a_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's shared store, five restarted runs: each ends in 120 s, bit-identical.

    Two jobs at a time (each its own torchrun, store and port): the runs are independent, and
    a busier machine only makes the restart race this guards against more likely."""
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)

    def one(name: str, *extra: str) -> TrainRun:
        (tmp_path / name).mkdir()
        return run_train(
            [*README, "--final-weights", "w.pt", *extra], cwd=tmp_path / name, timeout_s=120
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        ref_job = pool.submit(one, "ref")
        runs = list(pool.map(lambda i: one(f"run{i}", "--fail-at-step", "17"), range(5)))
    ref = ref_job.result()
    assert ref.returncode == 0, ref.stderr
    for i, run in enumerate(runs):
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in run.stdout + run.stderr
        assert run.returncode == 0, f"run {i}: {run.stderr[-2000:]}"
        assert "[rank0] resumed from step_15" in run.stdout
        assert same_weights(tmp_path / "ref" / "w.pt", tmp_path / f"run{i}" / "w.pt"), i


@pytest.mark.timeout(10)
def test_step_timeout_is_refused_when_torchruns_timer_is_off(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import os

    monkeypatch.delenv("TORCHELASTIC_TIMER_FILE", raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--step-timeout", "5"])
    assert "TORCHELASTIC_ENABLE_FILE_TIMER=1" in capsys.readouterr().err
    os.mkfifo(tmp_path / "timer-fifo")  # what torchrun's timer server makes and reads
    reader = os.open(tmp_path / "timer-fifo", os.O_RDONLY | os.O_NONBLOCK)
    monkeypatch.setenv("TORCHELASTIC_TIMER_FILE", str(tmp_path / "timer-fifo"))
    try:
        assert parse_args(["--step-timeout", "5"]).step_timeout == 5.0
    finally:
        os.close(reader)
    with pytest.raises(SystemExit):
        parse_args(["--step-timeout", "0"])


@pytest.mark.timeout(150)
def test_file_async_save_commits_every_step_and_its_step_4_resumes_bit_identically(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--async-save`` without ``--sharded``: rank 0 writes each file checkpoint in the
    background (the commit is logged after the next steps trained), the last one before the
    final weights; a synchronous resume from its step 4 ends on the same weights."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    args = [*ARGS, "--steps", "8", "--save-every", "2", "--keep-last", "4"]
    run = [*args, "--ckpt-dir", str(full / "ckpt"), "--final-weights", str(full / "w.pt")]
    assert spawn(main, 2, [*run, "--async-save"], timeout_s=120, rank_output="show") == [0, 0]
    out = capsys.readouterr().out
    assert [s for s, _ in list_checkpoints(full / "ckpt")] == [2, 4, 6, 8]
    assert out.index("saving step 2 in the background") < out.index("step 3 loss")
    assert out.index("step 3 loss") < out.index("saved step_00000002")
    assert out.index("saved step_00000008") < out.index("final weights at step 8")
    shutil.copytree(full / "ckpt" / "step_00000004", cut / "ckpt" / "step_00000004")
    resumed = [*args, "--ckpt-dir", str(cut / "ckpt"), "--final-weights", str(cut / "w.pt")]
    assert spawn(main, 2, resumed, timeout_s=120) == [0, 0]
    assert same_weights(full / "w.pt", cut / "w.pt")
