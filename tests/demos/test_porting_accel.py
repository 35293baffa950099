"""refimpl.demos.porting.accel and .sampling: the Accelerate trace reading finds replayed
batches and a moved RNG, the command and the diff are the chapter's, and the sampling costs
scale by the arithmetic the chapter states. (The kill tests of train_accelerate.py and its
port run in chapter 12, under nbval, with accelerate installed.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from refimpl.demos.porting.accel import (
    ACCELERATE,
    accelerate_command,
    accelerate_diff,
    resume_evidence,
)
from refimpl.demos.porting.sampling import sampling_costs


def test_accelerate_command_and_diff() -> None:
    with pytest.raises(KeyError):
        accelerate_command("nope")
    cmd = accelerate_command("port")
    assert str(ACCELERATE["port"]) in cmd and "--nproc-per-node=2" in cmd and "{out}" in cmd
    hunks, added, removed = accelerate_diff()
    body = "\n".join(hunks).splitlines()
    assert added == sum(ln.startswith("+") for ln in body) > 0
    assert removed == sum(ln.startswith("-") for ln in body) > 0
    for gone in ("accelerator.save_state(", "accelerator.load_state(", "skip_first_batches("):
        assert any(ln.startswith("-") and gone in ln for ln in body), gone
    for new in ("capture_every_rank(", "resume_every_rank(", "ResumableSampler(", "init_from_env("):
        assert any(ln.startswith("+") and new in ln for ln in body), new


def _trace(path: Path, lines: list[str]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "trace.rank0").write_text("".join(f"{ln}\n" for ln in lines))


def test_resume_evidence_reads_replayed_batches_and_rng(tmp_path: Path) -> None:
    ref = [f"{s} r{s:07d} g0 {s * 10},{s * 10 + 1}" for s in range(1, 7)]
    _trace(tmp_path / "ref", ref)
    # killed after step 4, resumed at step 3 (the save of step 2) with epoch 0's batches
    run = ref[:4] + [f"{s} x{s:07d} g1 {(s - 2) * 10},{(s - 2) * 10 + 1}" for s in (3, 4, 5, 6)]
    _trace(tmp_path / "run", run)
    (e,) = resume_evidence(tmp_path / "run", tmp_path / "ref", nproc=1)
    assert (e.resumed_at, e.rng_equal, e.same_batch, e.steps) == (3, False, 0, 4)
    assert e.batch_from == [1, 2, 3, 4] and not e.shuffle_equal
    _trace(tmp_path / "good", ref[:4] + ref[2:])
    (g,) = resume_evidence(tmp_path / "good", tmp_path / "ref", nproc=1)
    assert (g.rng_equal, g.same_batch, g.batch_from, g.shuffle_equal) == (True, 4, [], True)
    _trace(tmp_path / "none", ref)
    with pytest.raises(ValueError, match="no resume"):
        resume_evidence(tmp_path / "none", tmp_path / "ref", nproc=1)


def test_sampling_costs_scale_by_arithmetic() -> None:
    c = sampling_costs(1_000_000, measured_n=100_000, batch_size=12, batches=10, repeats=1)
    assert c.permutation_bytes == 8_000_000 and c.offsets_bytes == 96
    assert c.permutation_s > 0 and c.offsets_s_per_batch > 0
    assert c.offsets_s_per_epoch == pytest.approx(c.offsets_s_per_batch * 1_000_000 / 12)
    with pytest.raises(ValueError, match="measured_n"):
        sampling_costs(10, measured_n=20)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_to_one_rank_of_the_accelerate_port_saves_that_step_and_exits_0(
    tmp_path: Path,
) -> None:
    import os
    import re
    import signal
    import subprocess

    from refimpl._processes import workers

    cmd = [a.replace("{out}", str(tmp_path)) for a in accelerate_command("port", step_sleep=0.3)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONUNBUFFERED"] = "1"  # each line as printed: the signal follows "step 3"
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:  # a preemption notice to rank 1 only, in the middle of the run
        lines.append(line.rstrip("\n"))
        if re.search(r"epoch 0 step 3 loss", line):
            os.kill(workers(proc.pid, until=lambda found: 1 in found)[1], signal.SIGTERM)
    out = "\n".join(lines)
    assert proc.wait(timeout=120) == 0, out
    last = max(int(m) for m in re.findall(r"epoch \d+ step (\d+) loss", out))
    assert 3 <= last < 16, out  # stopped early: 2 epochs of 8 steps (64 samples, 2 x 4) end at 16
    assert (tmp_path / "checkpoints" / f"step_{last:08d}").is_dir(), out  # that step, saved
    assert not (tmp_path / "final.pt").exists(), out
