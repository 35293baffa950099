"""Chapter 10 with ``--sharded`` (`refimpl.train._sharded`): FSDP2 and DCP checkpoints.

A worker killed under torchrun is restarted and the run ends bit-identical to one never
interrupted; a resume that leaves out the optimizer does not. A run saved at 2 ranks and
resumed at 3 finishes, and every sample of the interrupted epoch is trained exactly once
(the sample indices each rank trained are logged by ``--sample-log`` and counted here).
With ``--async-save`` and a warmup + cosine schedule (`refimpl.train._async`,
`refimpl.train._schedule`): every save commits, SIGTERM waits for the stop step's commit, and
a resume after SIGTERM is bit-identical (the kill test of the same flags, rank 1 and rank 0
in a save SIGKILLed under torchrun, is chapter 10's, asserted under nbval).
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
from helpers.sharded_craft import bytes_item_in_place_of, drop_item

from refimpl.demos.train import TrainRun, run_train, same_weights
from refimpl.launch import WorkerError, spawn
from refimpl.sharded import verify_sharded
from refimpl.train import main, parse_args

ARGS = ["--steps", "12", "--save-every", "4", "--samples", "64", "--seed", "3", "--sharded"]


def _args(d: Path, *extra: str) -> list[str]:
    return [*ARGS, "--ckpt-dir", str(d / "ckpt"), "--final-weights", str(d / "w.pt"), *extra]


def _ok(run: TrainRun) -> TrainRun:
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr[-4000:]}"
    return run


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted torchrun run of the sharded trainer on 2 ranks (its log in run.txt)."""
    d = tmp_path_factory.mktemp("sharded-reference")
    (d / "run.txt").write_text(_ok(run_train(_args(d), timeout_s=100)).stdout)
    return d


# The sharded run killed at step 7 under torchrun, restarted, bit-identical, every committed
# step verifying: chapter 10's sharded cell runs and asserts that under nbval.


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.parametrize("forget", [None, "optimizer", "data"])
def test_sharded_resume_from_step_4_matches_unless_state_is_left_out(
    forget: str | None, reference: Path, tmp_path: Path
) -> None:
    shutil.copytree(reference / "ckpt", tmp_path / "ckpt")
    for later in ("step_00000008", "step_00000012"):
        shutil.rmtree(tmp_path / "ckpt" / later)
    extra = ("--no-restore", forget) if forget else ()
    assert spawn(main, 2, _args(tmp_path, *extra), timeout_s=90) == [0, 0]
    assert same_weights(reference / "w.pt", tmp_path / "w.pt") == (forget is None)


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_sharded_resume_at_another_world_size_trains_every_sample_once(tmp_path: Path) -> None:
    # 96 samples, 8 per rank: an epoch is 6 steps at 2 ranks and 4 at 3. Stop after step 3
    # (half of epoch 0), resume at 3 ranks: 2 steps finish epoch 0, 2 more start epoch 1.
    common = [
        "--samples",
        "96",
        "--save-every",
        "3",
        "--sharded",
        "--seed",
        "5",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--sample-log",
        str(tmp_path / "samples"),
    ]
    assert spawn(main, 2, ["--steps", "3", *common], timeout_s=90) == [0, 0]
    assert spawn(main, 3, ["--steps", "7", *common], timeout_s=90) == [0, 0, 0]
    trained: dict[int, Counter[int]] = {0: Counter(), 1: Counter()}
    steps: Counter[int] = Counter()
    for log in tmp_path.glob("samples.rank*"):
        for line in log.read_text().splitlines():
            step, epoch, *indices = map(int, line.split())
            steps[step] += 1
            trained[epoch].update(indices)
    assert steps == {1: 2, 2: 2, 3: 2, 4: 3, 5: 3, 6: 3, 7: 3}  # ranks per step: 2, then 3
    assert trained[0] == Counter(range(96))  # each sample of the interrupted epoch once
    assert sum(trained[1].values()) == 48 and max(trained[1].values()) == 1


def test_sharded_has_no_rng_to_leave_out() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--sharded", "--no-restore", "rng"])


ASYNC = [
    "--steps",
    "8",
    "--save-every",
    "2",
    "--keep-last",
    "4",
    "--samples",
    "32",
    "--seed",
    "3",
    "--sharded",
    "--lr-schedule",
    "cosine",
    "--warmup-steps",
    "3",
]


def _async_args(d: Path, *extra: str) -> list[str]:
    return [*ASYNC, "--ckpt-dir", str(d / "ckpt"), "--final-weights", str(d / "w.pt"), *extra]


@pytest.mark.timeout(120)
def test_async_save_commits_every_step_and_its_step_4_resumes_bit_identically(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--async-save`` with warmup + cosine: every save commits (the last one before the
    final weights), and a sync resume from its step 4 ends on its weights: the background
    save holds the same state (weights, AdamW, sampler, schedule) a sync one would."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    args = _async_args(full, "--async-save")
    assert spawn(main, 2, args, timeout_s=90, rank_output="show") == [0, 0]
    out = capsys.readouterr().out
    committed = sorted((full / "ckpt").glob("step_*"))
    assert [d.name for d in committed] == [f"step_{s:08d}" for s in (2, 4, 6, 8)]
    for step_dir in committed:
        verify_sharded(step_dir)
        assert f"saved {step_dir.name}" in out
    # Each commit is logged after the next steps trained (the write overlapped them), the
    # last one before the final weights.
    assert out.index("saving step 2 in the background") < out.index("step 3 loss")
    assert out.index("step 3 loss") < out.index("saved step_00000002")
    assert out.index("saved step_00000008") < out.index("final weights at step 8")
    shutil.copytree(full / "ckpt" / "step_00000004", cut / "ckpt" / "step_00000004")
    assert spawn(main, 2, _async_args(cut), timeout_s=90) == [0, 0]
    assert same_weights(full / "w.pt", cut / "w.pt")


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_sigterm_with_async_save_commits_the_stop_step_and_the_rerun_is_bit_identical(
    tmp_path: Path,
) -> None:
    """SIGTERM to rank 1 under torchrun while background saves run: every rank stops after
    the same step, the trainer waits until that step is committed and exits 0, and running
    the command again finishes on the weights of a run never stopped."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert spawn(main, 2, _async_args(full, "--async-save"), timeout_s=90) == [0, 0]
    args = _async_args(cut, "--async-save", "--step-sleep", "0.3")
    run = _ok(run_train(args, sigterm_rank=1, sigterm_after_step=3, timeout_s=100))
    stops = [e for e in run.events if e.kind == "stop"]
    assert sorted(e.rank for e in stops) == [0, 1] and len({e.step for e in stops}) == 1
    step = stops[0].step
    assert step is not None and 3 <= step < 8
    rank0 = [ln for ln in run.stdout.splitlines() if ln.startswith("[rank0] ")]
    saved = rank0.index(f"[rank0] saved step_{step:08d}")  # the commit, waited for ...
    assert saved < rank0.index(
        f"[rank0] SIGTERM: stopped after step {step}, checkpoint saved; exit 0"
    )  # ... before the exit
    last = sorted((cut / "ckpt").glob("step_*"))[-1]
    assert last.name == f"step_{step:08d}"
    verify_sharded(last)
    assert not (cut / "w.pt").exists()
    assert spawn(main, 2, _async_args(cut, "--async-save"), timeout_s=90) == [0, 0]
    assert same_weights(full / "w.pt", cut / "w.pt")


@pytest.mark.timeout(170)
def test_a_crafted_step_is_skipped_with_its_reason_and_a_refused_one_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A non-tensor item in place of a weight in the newest step: the run resumes from the
    older step, saying why. A newest step that is refused outright (its state= lacks the
    sampler): the run stops, and its message carries the reason."""
    args = [
        "--save-every",
        "4",
        "--samples",
        "64",
        "--seed",
        "3",
        "--sharded",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
    ]
    assert spawn(main, 2, ["--steps", "8", *args], timeout_s=90) == [0, 0]
    bytes_item_in_place_of(tmp_path / "ckpt" / "step_00000008", "model.0.weight", "x")
    capsys.readouterr()
    # before: RuntimeError "... none of them loads: (no reason reported)"
    assert spawn(main, 2, ["--steps", "12", *args], timeout_s=90, rank_output="show") == [0, 0]
    out = capsys.readouterr().out
    assert "[rank0] skipped step_00000008: " in out
    assert "'model.0.weight' is a non-tensor item in the step, a DTensor here" in out
    assert "[rank0] resumed from step_4" in out
    drop_item(tmp_path / "ckpt" / "step_00000012", "state.sampler")
    with pytest.raises(WorkerError) as info:
        spawn(main, 2, ["--steps", "16", *args], timeout_s=90)
    text = str(info.value)
    assert "none of them loads: step_00000012: " in text and "(no reason reported)" not in text
    assert "state= does not fit this step" in text and "no entry 'sampler'" in text
