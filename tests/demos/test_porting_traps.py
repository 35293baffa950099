"""refimpl.demos.porting.traps: chapter 12's MiniMind-style trainer writes, per trap, the
checkpoint the chapter says it writes (fp16 weights, no scaler, a save half way through an
accumulation window), and the fp16 round trip says what it claims. (The kill tests
themselves run in the chapter, under nbval.)"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from refimpl.demos.porting.traps import MINI, TRAPS, fp16_round_trip, mini_command


def _run_mini(out: Path, monkeypatch: pytest.MonkeyPatch, *flags: str) -> dict[str, Any]:
    """One epoch of train_mini.py in this process; its last checkpoint."""
    argv = [str(MINI), "--out", str(out), "--epochs", "1", "--step-sleep", "0", *flags]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(MINI), run_name="__main__")
    ckpt: dict[str, Any] = torch.load(out / "ckpt.pth", weights_only=False)
    return ckpt


@pytest.mark.timeout(120)
def test_each_trap_changes_what_the_checkpoint_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exact = _run_mini(tmp_path / "exact", monkeypatch)
    assert {v.dtype for v in exact["model"].values()} == {torch.float32}
    assert exact["step"] == 16 and "scaler" in exact  # after batch 15: an optimizer step
    half = _run_mini(tmp_path / "fp16", monkeypatch, "--trap", "fp16")
    assert {v.dtype for v in half["model"].values()} == {torch.float16}
    assert "scaler" not in _run_mini(tmp_path / "scaler", monkeypatch, "--trap", "scaler")
    accum = _run_mini(tmp_path / "accum", monkeypatch, "--trap", "accum")
    assert accum["step"] == 9  # after batch 8: the first half of the window of 8 and 9
    # The traps change only what is saved and restored: one epoch, no resume, same weights.
    final = [torch.load(tmp_path / d / "final.pt")["model"] for d in ("exact", "fp16", "accum")]
    assert all(torch.equal(final[0][k], f[k]) for f in final[1:] for k in final[0])


def test_fp16_round_trip_is_the_rounding_of_each_weight(tmp_path: Path) -> None:
    w = torch.tensor([1.0, 1.0 + 2**-12, 3.0])  # 1 + 2^-12 is not an fp16 number
    torch.save({"model": {"w": w}}, tmp_path / "ckpt.pth")
    assert fp16_round_trip(tmp_path / "ckpt.pth") == {"w": 2**-12}


def test_mini_command_refuses_an_unknown_trap() -> None:
    with pytest.raises(ValueError, match="unknown trap 'nope'"):
        mini_command("nope")
    assert mini_command(TRAPS[0])[-2:] == ["--trap", TRAPS[0]]
