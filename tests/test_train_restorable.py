"""``refimpl.train`` resuming a step that verifies but cannot be restored.

`refimpl.train._restorable`: content that passes the digests can still not fit, an RNG state
of another size, a scheduler with other param groups (a step edited, or written by another
trainer). Such a step crashed every restart although an older good step was on disk; now it
is skipped on every rank, the reason logged, and the run resumes from the step before it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from refimpl.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from refimpl.launch import WorkerError, spawn
from refimpl.train import main

ARGS = ["--save-every", "4", "--samples", "64", "--seed", "3", "--progress", "never"]


def _rng_of_rank_1_too_short(state: dict[str, Any]) -> None:
    state["rng"][1]["torch"] = state["rng"][1]["torch"][:10].clone()


def _scheduler_with_two_groups(state: dict[str, Any]) -> None:
    sched = state["scheduler"]
    sched["base_lrs"], sched["_last_lr"] = sched["base_lrs"] * 2, sched["_last_lr"] * 2


def _edit_step(ckpt: Path, step: int, edit: Any) -> None:
    """Rewrite ``step`` with ``edit`` applied, through save_checkpoint: it verifies."""
    step_dir = ckpt / f"step_{step:08d}"
    state = load_checkpoint(step_dir)
    edit(state)
    save_checkpoint(ckpt, state, step, keep_last=None)


@pytest.mark.timeout(170)
@pytest.mark.parametrize(
    ("edit", "entry"),
    [
        (_rng_of_rank_1_too_short, "the 'rng' entry of rank 1['torch'] holds 10 x torch.uint8"),
        (
            _scheduler_with_two_groups,
            "the 'scheduler' entry has 2 param group(s), this optimizer 1",
        ),
    ],
)
def test_a_verified_step_that_cannot_be_restored_is_skipped_on_every_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Any, entry: str
) -> None:
    ckpt = tmp_path / "ckpt"
    args = [*ARGS, "--ckpt-dir", str(ckpt)]
    assert spawn(main, 2, [*args, "--steps", "8"], timeout_s=90) == [0, 0]
    _edit_step(ckpt, 8, edit)
    capsys.readouterr()
    assert spawn(main, 2, [*args, "--steps", "12"], timeout_s=90, rank_output="show") == [0, 0]
    out = capsys.readouterr().out
    skipped = f"[rank0] skipped step_00000008: verified, but cannot be restored: {entry}"
    assert skipped in out and "[rank1] skipped step_00000008" in out, out
    assert "[rank0] resumed from step_4" in out and "[rank1] resumed from step_4" in out
    assert "[rank0] step 5 loss" in out, out  # steps 5-8 trained again
    assert [s for s, _ in list_checkpoints(ckpt)] == [4, 8, 12]
    state = load_checkpoint(ckpt / "step_00000008")  # the re-trained step replaced it
    assert state["rng"][1]["torch"].numel() == torch.get_rng_state().numel()
    assert len(state["scheduler"]["base_lrs"]) == 1


@pytest.mark.timeout(170)
def test_when_no_step_can_be_restored_the_trainer_stops_naming_each(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args = [*ARGS, "--ckpt-dir", str(ckpt)]
    assert spawn(main, 1, [*args, "--steps", "8"], timeout_s=90) == [0]
    for step in (4, 8):
        _edit_step(ckpt, step, _scheduler_with_two_groups)
    with pytest.raises(WorkerError) as exc:
        spawn(main, 1, [*args, "--steps", "12"], timeout_s=90)
    text = str(exc.value)
    assert "none of them loads" in text and "step_00000004: verified, but cannot" in text, text
    assert [s for s, _ in list_checkpoints(ckpt)] == [4, 8]


def rewrite_sharded_scheduler(ckpt: str, step: int) -> int:
    """Worker: re-save the sharded trainer's ``step`` with a scheduler of two param groups."""
    from refimpl.sharded import load_sharded, save_sharded
    from refimpl.train import make_model
    from refimpl.train._schedule import make_scheduler
    from refimpl.train._sharded import shard_model

    model = shard_model(make_model(3), torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = make_scheduler(opt, "constant", 0, 8)
    state: dict[str, Any] = {"step": None, "sampler": None, "scheduler": sched}
    path = f"{ckpt}/step_{step:08d}"
    assert load_sharded(path, model, opt, state=state) == step
    two = sched.state_dict()
    _scheduler_with_two_groups({"scheduler": two})
    save_sharded(ckpt, model, opt, step, keep_last=None, state={**state, "scheduler": two})
    return step


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_sharded_a_step_whose_scheduler_does_not_fit_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    args = [*ARGS, "--sharded", "--ckpt-dir", str(ckpt)]
    assert spawn(main, 2, [*args, "--steps", "8"], timeout_s=90) == [0, 0]
    assert spawn(rewrite_sharded_scheduler, 2, str(ckpt), 8, timeout_s=90) == [8, 8]
    capsys.readouterr()
    assert spawn(main, 2, [*args, "--steps", "12"], timeout_s=90, rank_output="show") == [0, 0]
    out = capsys.readouterr().out
    entry = "the 'scheduler' entry has 2 param group(s), this optimizer 1"
    assert f"[rank0] skipped step_00000008: verified, but cannot be restored: {entry}" in out, out
    assert "[rank0] resumed from step_4" in out and "[rank1] resumed from step_4" in out
    assert [s for s, _ in list_checkpoints(ckpt)] == [4, 8, 12]


@pytest.mark.timeout(30)
def test_load_latest_below_considers_only_older_steps(tmp_path: Path) -> None:
    from refimpl.checkpoint import load_latest

    for step in (1, 2, 3):
        save_checkpoint(tmp_path, {"step": step}, step, keep_last=None)
    assert [load_latest(tmp_path, below=b)[0] for b in (3, 2)] == [2, 1]  # type: ignore[index]
    assert load_latest(tmp_path, below=1) is None
