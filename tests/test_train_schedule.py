"""``refimpl.train --lr-schedule`` (`refimpl.train._schedule`): the multiplier, its state
round trip, and an exact resume with the schedule on (the file backend here;
tests/test_train_sharded.py has ``--sharded``, with and without ``--async-save``)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from refimpl.checkpoint import list_checkpoints, load_latest
from refimpl.demos.train import same_weights
from refimpl.launch import spawn
from refimpl.train import main, parse_args
from refimpl.train._schedule import MIN_LR_RATIO, check_restored, lr_factor, make_scheduler

LR = 1e-2


@pytest.mark.timeout(10)
def test_warmup_then_cosine_to_the_floor() -> None:
    f = lr_factor("cosine", 4, 12)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and math.isclose(f(8), (1 + MIN_LR_RATIO) / 2)
    assert all(f(s) > f(s + 1) for s in range(4, 12))  # falls all the way
    assert f(12) == f(40) == pytest.approx(MIN_LR_RATIO)  # and stays at the floor
    assert [lr_factor("constant", 2, 12)(s) for s in (0, 1, 2, 11)] == [0.5, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_factor("linear", 0, 10)


def _opt() -> torch.optim.Optimizer:
    return torch.optim.AdamW(torch.nn.Linear(2, 1).parameters(), lr=LR)


@pytest.mark.timeout(10)
def test_state_round_trip_gives_the_same_rates_after_as_an_unbroken_run() -> None:
    opt = _opt()
    sched = make_scheduler(opt, "cosine", 2, 10)
    for _ in range(5):
        opt.step()
        sched.step()
    saved = sched.state_dict()
    fresh_opt = _opt()
    fresh = make_scheduler(fresh_opt, "cosine", 2, 10)
    assert fresh_opt.param_groups[0]["lr"] == LR * 0.5  # step 0 of the warmup
    fresh.load_state_dict(saved)
    check_restored(fresh, fresh_opt, 5, "ckpt", flat=False)
    for _ in range(5):  # both go on: the same rate at every step
        assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        for o, s in ((opt, sched), (fresh_opt, fresh)):
            o.step()
            s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * MIN_LR_RATIO)


@pytest.mark.timeout(10)
def test_a_checkpoint_without_the_schedule_is_refused_unless_the_schedule_is_flat() -> None:
    opt = _opt()
    sched = make_scheduler(opt, "cosine", 2, 10)  # not loaded: still at step 0
    with pytest.raises(RuntimeError, match=r"LR schedule at step 0.*--lr-schedule constant"):
        check_restored(sched, opt, 4, "ckpt", flat=False)
    flat = make_scheduler(opt, "constant", 0, 10)
    check_restored(flat, opt, 4, "ckpt", flat=True)
    assert flat.last_epoch == 4 and opt.param_groups[0]["lr"] == LR


@pytest.mark.timeout(10)
def test_defaults_keep_the_constant_rate_and_async_save_works_on_both_backends() -> None:
    args = parse_args([])
    assert (args.lr_schedule, args.warmup_steps, args.async_save) == ("constant", 0, False)
    assert parse_args(["--async-save"]).async_save  # the file backend too, since issue 35
    with pytest.raises(SystemExit):
        parse_args(["--warmup-steps", "-1"])


@pytest.mark.timeout(120)
def test_file_backend_resume_with_warmup_and_cosine_is_bit_identical(tmp_path: Path) -> None:
    """One run of 8 steps; its step-4 checkpoint alone, resumed, ends on the same weights."""
    args = [
        "--steps",
        "8",
        "--save-every",
        "4",
        "--samples",
        "32",
        "--seed",
        "3",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "3",
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run = [*args, "--final-weights"]
    ok = [0, 0]
    assert spawn(main, 2, [*run, str(full / "w.pt"), "--ckpt-dir", str(full)], timeout_s=60) == ok
    found = load_latest(full)
    assert found is not None and found[0] == 8
    sched = found[1]["scheduler"]  # the schedule rides in the checkpoint, at its step
    assert sched["last_epoch"] == 8 and sched["_last_lr"][0] == pytest.approx(
        LR * lr_factor("cosine", 3, 8)(8)
    )
    shutil.copytree(full / "step_00000004", cut / "step_00000004")
    assert spawn(main, 2, [*run, str(cut / "w.pt"), "--ckpt-dir", str(cut)], timeout_s=60) == ok
    assert [s for s, _ in list_checkpoints(cut)] == [4, 8]
    assert same_weights(full / "w.pt", cut / "w.pt")
