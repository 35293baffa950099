"""Crafted or unreadable entries in a checkpoint root: every listing of the steps (load, save,
the CLI, refimpl.train's start) judges each entry on its own, so one hidden name that is not a
step's cannot stop them all, and nothing it did not make is deleted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from refimpl.atomic import _OWNER
from refimpl.checkpoint import list_checkpoints, load_latest, save_checkpoint

_HUGE_PID = "9" * 20  # no process has it; int() of it overflows os.kill's pid_t

CRAFTED = {
    "aside_of_dot": "...aside-00000000-1-00000000",  # base "." : Path.with_name(".") raises
    "aside_of_dotdot": "....aside-00000000-1-00000000",  # base ".."
    "aside_20_digit_pid": f".step_00000002.aside-{_OWNER}-{_HUGE_PID}-00000000",
    "temp_20_digit_pid": f".step_00000003.tmp-{_OWNER}-{_HUGE_PID}-00000000",
    "aside_pid_0": f".step_00000005.aside-{_OWNER}-0-00000000",
}


@pytest.mark.parametrize("name", list(CRAFTED.values()), ids=list(CRAFTED))
def test_a_crafted_hidden_name_stops_no_load_save_or_listing(tmp_path: Path, name: str) -> None:
    from test_checkpoint import _cli

    save_checkpoint(tmp_path, {"w": torch.ones(2)}, 1)
    (tmp_path / name).mkdir()
    (tmp_path / name / "keep").write_text("not ours")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert load_latest(tmp_path)[0] == 1  # type: ignore[index]
    save_checkpoint(tmp_path, {"w": torch.zeros(2)}, 4, keep_last=None)
    step, state = load_latest(tmp_path)  # type: ignore[misc]
    assert step == 4 and torch.equal(state["w"], torch.zeros(2))
    code, out = _cli("list", str(tmp_path))
    assert code == 0 and out.count("verified") == 2, out
    assert (tmp_path / name / "keep").read_text() == "not ours"  # left exactly as it was
