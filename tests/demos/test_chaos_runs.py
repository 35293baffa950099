"""refimpl.demos.chaos_runs: chapter 10's kill tests point `run_chaos` at lines the trainers
really print. The runs themselves are chapter 10's cells (nbval checks their verdicts) and
tests/test_chaos_trainers.py; here each regex is matched against a real log, and each command
is checked for the flags the scenarios rely on."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from refimpl.demos import chaos_runs


def _captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def fake_run_chaos(cmd: list[str], **kwargs: Any) -> list[Any]:
        seen.update(cmd=cmd, **kwargs)
        return []

    monkeypatch.setattr(chaos_runs, "run_chaos", fake_run_chaos)
    return seen


@pytest.mark.timeout(150)
def test_chaos_train_kills_and_resumes_on_lines_refimpl_train_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _captured(monkeypatch)
    chaos_runs.chaos_train(sharded=True, scenarios=["kill-rank1"], work=tmp_path)
    cmd = " ".join(seen["cmd"])
    assert "--max-restarts=2" in cmd and "-m refimpl.train" in cmd and "--sharded" in cmd
    assert seen["scenarios"] == ["kill-rank1"] and seen["compare"] == "w.pt"
    # One rank, plain python: the same log lines as under torchrun, from rank 0.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    args = [a.replace("{out}", str(tmp_path)) for a in chaos_runs.TRAIN_ARGS]
    first = subprocess.run(
        [sys.executable, "-m", "refimpl.train", *args, "--steps", "8"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert first.returncode == 0, first.stdout + first.stderr
    lines = first.stdout.splitlines()
    assert any(re.search(seen["kill_on"], line) for line in lines), lines
    assert any(re.search(seen["save_on"], line) for line in lines), lines
    again = subprocess.run(
        [sys.executable, "-m", "refimpl.train", *args, "--steps", "10"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    resumed = [ln for ln in again.stdout.splitlines() if re.search(seen["resume_on"], ln)]
    assert resumed and "step_8" in resumed[0], again.stdout


@pytest.mark.timeout(30)
def test_toy_command_runs_the_chosen_variant_under_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cmd = chaos_runs.toy_command("no-rng", nproc=3)
    assert "--nproc_per_node=3" in cmd and "--max-restarts=2" in cmd and "--standalone" in cmd
    assert cmd[-6:] == [
        "-m",
        "refimpl.demos.chaos_trainers",
        "--variant",
        "no-rng",
        "--out",
        "{out}",
    ]
    seen = _captured(monkeypatch)
    chaos_runs.chaos_toy("no-sampler", scenarios=["kill-job"], work=tmp_path, env={"A": "1"})
    assert seen["cmd"] == chaos_runs.toy_command("no-sampler")
    assert seen["compare"] == "final.pt" and seen["env"] == {"A": "1"}
    assert seen["kill_on"] == r"^step 6 loss" and seen["save_on"] == r"^saving step 12"


@pytest.mark.timeout(10)
def test_chaos_report_keeps_every_fact_of_the_table_within_100_columns() -> None:
    from refimpl.chaos import ChaosRow

    long_path = "Resuming training from /tmp/ch11-abcdefgh/chaos/original/kill-rank1/out/ckpt.pt"
    rows = [
        ChaosRow(
            "kill-rank1",
            "iter 6: loss 3.6343",
            1,
            long_path,
            False,
            "model.transformer.wte.weight: max abs diff 0.00315 " + "x" * 80,
            3.0,
        ),
        ChaosRow(
            "kill-rank0-save", "[rank0] step 8 loss 0.714118", 2, "[rank0] resumed", True, None, 4.0
        ),
    ]
    text = chaos_runs.chaos_report(rows)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "kill-rank1" in text and "DIFFERS" in text and "bit-identical" in text
    assert long_path in text and "max abs diff 0.00315" in text  # wrapped, not cut
    dicts = [dict(vars(r)) for r in rows]  # what --json writes
    assert chaos_runs.chaos_report(dicts) == text
