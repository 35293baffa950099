"""Chapter 10's restart runs (`refimpl.demos.restarts`): R's parts read from the logs, and the
reference run made once per directory. The runs themselves (the README's command killed, a
save stuck forever under ``--step-timeout``) are chapter 10's cells, whose output nbval
compares line by line (the reaping signal, the resume step, the verdict)."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch

from refimpl.demos import restarts
from refimpl.demos.restarts import PARTS, readme_runs, split_restarts
from refimpl.demos.train import TrainRun


@pytest.mark.timeout(10)
def test_split_restarts_reads_the_parts_of_r_from_both_logs() -> None:
    t = datetime.datetime(2026, 3, 4, 5, 6, 7).timestamp()
    agent = [
        "I0304 05:06:08.500000 1 api.py:1] [default] Worker group FAILED. 2/2 attempts left",
        "I0304 05:06:10.000000 1 api.py:2] [default] Rendezvous complete for workers. Result:",
    ]
    stdout = [
        "[rank0] @0.0 start: world 2, restart 1, device cpu",
        "[rank1] @0.0 start: world 2, restart 1, device cpu",
        f"[rank0] @{t + 4:.6f} timing: restart 1 process {t + 3.5:.6f} imported {t + 4:.6f} "
        f"group {t + 4.25:.6f}",
        f"[rank1] @{t + 4:.6f} timing: restart 1 process {t + 3:.6f} imported {t + 4.5:.6f} "
        f"group {t + 4.5:.6f}",
        f"[rank0] @{t + 5:.6f} resumed from step_3",
        f"[rank0] @{t + 6:.6f} step 4 loss 0.1",
        f"[rank0] @{t + 7:.6f} step 5 loss 0.1",
    ]
    run = TrainRun(0, "\n".join(stdout), "\n".join(agent), 9.0, kill_times=[t])
    (row,) = split_restarts(run)
    # kill t; FAILED t+1.5; rendezvous t+3; the slower rank: process t+3.5, imported t+4.5,
    # group t+4.5; rank 0 resumed t+5 and logged its first step at t+6
    assert row == {"R": 6.0, **dict(zip(PARTS, [1.5, 1.5, 0.5, 1.0, 0.0, 0.5, 1.0], strict=True))}


@pytest.mark.timeout(10)
def test_the_uninterrupted_run_is_made_once_per_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # chapter 10 calls readme_runs then stuck_save in one directory: one reference, not two
    calls: list[str] = []

    def fake_run_train(args: list[str], *, cwd: Path, **kwargs: object) -> TrainRun:
        calls.append(Path(cwd).name)
        torch.save({"w": torch.zeros(1)}, Path(cwd) / "w.pt")
        return TrainRun(0, "", "", 0.1)

    monkeypatch.setattr(restarts, "run_train", fake_run_train)
    readme_runs(tmp_path, runs=0)
    readme_runs(tmp_path, runs=1)
    assert sorted(calls) == ["reference", "run0"]  # side by side: in either order
