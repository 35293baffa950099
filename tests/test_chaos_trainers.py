"""refimpl.demos.chaos_trainers: the toy trainer chapter 10 kill-tests. Alone it prints the
lines the kill test waits for and writes its weights; under ``python -m refimpl.chaos`` the
correct variant passes every scenario and the two broken ones fail, naming the differing key.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from _chaos_helpers import tagged_pids

from refimpl.chaos import SCENARIOS, format_table
from refimpl.demos.chaos_runs import chaos_toy


@pytest.mark.timeout(120)
def test_alone_it_prints_the_lines_the_kill_test_waits_for(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    run = subprocess.run(
        [sys.executable, "-m", "refimpl.demos.chaos_trainers", "--variant", "ok",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=100, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert any(re.match(r"^step 6 loss", line) for line in lines), lines  # chaos_toy's kill_on
    assert "saving step 12" in lines and lines[-1] == "done: 16 steps"  # its save_on
    weights = torch.load(tmp_path / "final.pt", weights_only=True)
    assert set(weights) == {"model", "step"} and weights["step"] == 16, list(weights)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run under torchrun, shared by the variants: they differ only in what
    a resume restores, and an uninterrupted run never resumes."""
    work = tmp_path_factory.mktemp("chaos-reference")
    assert chaos_toy("ok", scenarios=[], timeout_s=150, work=work) == []
    return work / "reference"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_correct_trainer_passes_every_scenario_and_leaves_no_process(
    tmp_path: Path, reference: Path
) -> None:
    tag = uuid.uuid4().hex
    rows = chaos_toy(
        "ok", timeout_s=150, work=tmp_path, env={"CHAOS_TEST_TAG": tag}, jobs=2, reference=reference
    )
    table = format_table(rows)
    assert [r.scenario for r in rows] == list(SCENARIOS), table
    assert all(r.equal and r.difference is None for r in rows), table
    assert all(r.restarts >= 1 for r in rows), table  # every kill took the workers down
    assert [r.landed for r in rows][1] == "saving step 12", table
    assert all(r.resume and r.resume.startswith("resumed from step") for r in rows), table
    assert tagged_pids(tag) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", ["no-rng", "no-sampler"])
def test_trainer_that_forgets_state_fails_naming_the_key(
    variant: str, tmp_path: Path, reference: Path
) -> None:
    rows = chaos_toy(
        variant, scenarios=["kill-rank1"], timeout_s=150, work=tmp_path, reference=reference
    )
    (row,) = rows
    assert row.resume == "resumed from step 4", format_table(rows)
    assert not row.equal
    # the first layer's weights come first in the file and differ after a wrong resume
    assert row.difference is not None
    assert re.fullmatch(r"model\.0\.weight: max abs diff \S+", row.difference), row.difference
    assert float(row.difference.rsplit(" ", 1)[1]) > 0
