"""refimpl.demos.reader_trainer: the trainer chapter 10 shows and kill-tests. Alone (a world of
one) it prints the lines the kill test waits for, resumes from a checkpoint to the very weights
of an uninterrupted run, and holds the one line the chapter removes to make its broken twin."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import refimpl.demos.reader_trainer as reader_trainer


def _run(out: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-m", "refimpl.demos.reader_trainer", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


@pytest.mark.timeout(150)
def test_a_resume_from_step_4_ends_on_the_uninterrupted_weights(tmp_path: Path) -> None:
    ref = _run(tmp_path / "ref")
    steps = [ln for ln in ref if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == [str(s) for s in range(1, reader_trainer.STEPS + 1)]
    assert [ln for ln in ref if ln.startswith("saving step")] == [
        "saving step 4",
        "saving step 8",
        "saving step 12",
    ]
    assert ref[-1] == "done"
    # a job killed after its step-4 save: only that checkpoint survives
    (tmp_path / "resumed" / "ckpt").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "ref" / "ckpt" / "step_00000004",
        tmp_path / "resumed" / "ckpt" / "step_00000004",
    )
    resumed = _run(tmp_path / "resumed")
    assert resumed[0] == "resumed from step 4"
    assert [ln for ln in resumed if ln.startswith("step ")] == steps[4:]
    a = torch.load(tmp_path / "ref" / "final.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "resumed" / "final.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_broken_twin_is_one_line_away() -> None:
    """Chapter 10 writes broken.py by dropping the line that saves every rank's RNG."""
    source = Path(reader_trainer.__file__).read_text()
    lines = [ln for ln in source.splitlines() if ln.strip() == "rng=rngs,"]
    assert len(lines) == 1, lines
    assert "# fmt: skip" not in source
