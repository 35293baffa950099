"""Chapter 10's restart runs (`refimpl.demos.restarts`): a save stuck forever under
``--step-timeout`` ends in a restart and bit-identical weights; R's parts read from the logs."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch

from refimpl.demos import restarts
from refimpl.demos.restarts import PARTS, readme_runs, split_restarts, stuck_save
from refimpl.demos.train import TrainRun
from refimpl.train._watchdog import REAP_SIGNAL


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_save_stuck_forever_is_killed_and_the_job_finishes_bit_identical(
    tmp_path: Path,
) -> None:
    result = stuck_save(tmp_path, step_timeout=5, hang_at=10)
    assert result["ref_ok"] and result["returncode"] == 0, result
    assert "[rank0] injected hang: the save of step 10 blocks forever" in result["trainer"]
    assert "[rank0] resumed from step_5" in result["trainer"]
    sig = int(REAP_SIGNAL)  # SIGPIPE, 13
    assert any(f"exitcode: -{sig}" in line for line in result["agent"]), result["agent"]
    # whichever rank's timer the server reaps first (a race), it was ended by REAP_SIGNAL
    ended = result["ended"]
    assert ended and {s for _, s in ended} == {sig} and {r for r, _ in ended} <= {0, 1}, ended
    assert f"ended a worker of the stuck save after 5 s (signal {sig})" in result["verdict"]
    assert result["identical"], result["verdict"]


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
