"""refimpl.demos.porting: chapter 12's two nanoGPT-style scripts. Run alone and stopped after
a save, the original resumes onto other batches and ends elsewhere while the port ends bit
for bit where an uninterrupted run does; the RNG table, the torn save, the draw logs and the
diff the chapter prints say what they claim."""

from __future__ import annotations

import ast
import os
import re
import runpy
import signal
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from refimpl.chaos import ChaosRow
from refimpl.data import RandomOffsets
from refimpl.demos import porting
from refimpl.demos.porting import (
    SCRIPTS,
    chaos_scripts,
    differing_tensors,
    draws_after_resume,
    prepare_data,
    relative_paths,
    rng_capture_points,
    script_command,
    script_diff,
    torn_save,
)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread, as torchrun gives each worker: a model this small runs 10x faster
    than with threads that wait for each other on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("porting") / "data"
    sizes = prepare_data(d)
    assert sizes["train"] + sizes["val"] == len(porting.TEXT) and sizes["vocab_size"] < 64
    return d


def _run(
    name: str,
    out: Path,
    data: Path,
    max_iters: int,
    monkeypatch: pytest.MonkeyPatch,
    *more: str,
) -> None:
    """The script in this process, as ``python SCRIPT --key=value ...`` (a world of one)."""
    argv = [
        str(SCRIPTS[name]),
        f"--out_dir={out}",
        f"--data_dir={data}",
        f"--max_iters={max_iters}",
        f"--draws_log={out}/draws",
        *more,
    ]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.delenv("RANK", raising=False)
    runpy.run_path(str(SCRIPTS[name]), run_name="__main__")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["original", "port"])
def test_a_run_stopped_after_a_save_and_started_again(
    name: str, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, stopped = tmp_path / "ref", tmp_path / "stopped"
    _run(name, ref, data, 8, monkeypatch)
    _run(name, stopped, data, 4, monkeypatch)  # saves at 4, trains iteration 4, ends
    _run(name, stopped, data, 8, monkeypatch)  # a new start: resumes from the save at 4
    (draws,) = draws_after_resume(stopped, ref, nproc=1)
    differ, tensors = differing_tensors(stopped, ref)
    assert draws.resumed_at == 4 and draws.trained == 5
    if name == "port":
        assert (draws.differ, differ) == (0, 0)  # the same batches, the same weights
    else:  # the seed's stream from its start: iterations 4.. train the batches of 0..
        assert (draws.differ, draws.replayed, draws.lag) == (5, 5, 4)
        assert differ == tensors == 16


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["original", "port"])
def test_a_resume_builds_the_model_the_checkpoint_was_trained_with(
    name: str, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nanoGPT's resume takes the model's shape from the checkpoint (a gpt2-xl fine-tune
    # resumes whatever the command line says); the port reads it with load_latest(keys=...).
    ref, stopped = tmp_path / "ref", tmp_path / "stopped"
    _run(name, ref, data, 8, monkeypatch)
    _run(name, stopped, data, 4, monkeypatch)
    _run(name, stopped, data, 8, monkeypatch, "--n_layer=3")  # the shape in the step wins
    (draws,) = draws_after_resume(stopped, ref, nproc=1)
    assert draws.resumed_at == 4
    differ, tensors = differing_tensors(stopped, ref)
    assert tensors == 16 and (name == "original" or differ == 0)


@pytest.mark.timeout(120)
def test_sigterm_to_the_port_saves_its_step_exits_0_and_the_rerun_ends_bit_identical(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, stopped = tmp_path / "ref", tmp_path / "stopped"
    _run("port", ref, data, 8, monkeypatch)
    script = str(SCRIPTS["port"])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    cmd = [sys.executable, script, f"--out_dir={stopped}", f"--data_dir={data}"]
    cmd += ["--max_iters=8", "--step_sleep=0.3"]
    env["PYTHONUNBUFFERED"] = "1"  # each line as printed: the signal follows "iter 5"
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # a preemption notice in the middle of the run
        lines.append(line.rstrip("\n"))
        if line.startswith("iter 5:"):
            proc.send_signal(signal.SIGTERM)
    out = "\n".join(lines)
    assert proc.wait(timeout=60) == 0, out
    saved = re.search(r"^SIGTERM: saving iter (\d+) to ", out, re.M)
    assert saved is not None and 5 < int(saved.group(1)) <= 8, out
    assert (stopped / "ckpt" / f"step_{int(saved.group(1)):08d}").is_dir(), out
    assert not (stopped / "final.pt").exists()  # a preempted run has no final weights
    _run("port", stopped, data, 8, monkeypatch)  # the next start resumes from that step
    assert differing_tensors(stopped, ref) == (0, differing_tensors(ref, ref)[1])


@pytest.mark.timeout(120)
def test_the_port_trains_the_random_offsets_stream_and_evaluation_draws_none_of_it(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Iteration k trains global batch k of RandomOffsets, whatever rank 0's evaluation reads
    # (it evaluates on train batches too: drawn from the counter, they would put rank 0 ahead
    # of the other ranks at every evaluation; chapter 12's kill test caught that once).
    _run("port", tmp_path / "port", data, 8, monkeypatch)
    train = np.fromfile(data / "train.bin", dtype=np.uint16).astype(np.int64)
    offsets = RandomOffsets(len(train) - 16, 4, seed=1337, rank=0, world_size=1)
    want = []
    for it in range(9):  # iterations 0..8, block_size 16, batch_size 4
        x = torch.stack([torch.from_numpy(train[i : i + 16]) for i in offsets.next()])
        want.append(f"{it} {zlib.crc32(x.numpy().tobytes()):08x}")
    assert (tmp_path / "port" / "draws.rank0").read_text().splitlines() == want


@pytest.mark.timeout(60)
def test_rng_capture_points_separates_whose_rng_from_where_it_is_captured() -> None:
    rows = {r["variant"]: (r["rank0"], r["rank1"], r["iterations"]) for r in rng_capture_points()}
    assert rows == {
        "nothing": (0, 0, 6),
        "rank0": (6, 0, 6),  # rank 1's stream was never saved
        "after-eval": (0, 6, 6),  # rank 0's eval runs again on resume, from a moved stream
        "before-eval": (6, 6, 6),  # capture_every_rank where the port calls it
    }


@pytest.mark.timeout(120)
def test_a_save_killed_mid_write_loses_the_only_ckpt_but_not_a_step(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in SCRIPTS:
        _run(name, tmp_path / name, data, 4, monkeypatch)
    original = torn_save("original", tmp_path / "original" / "ckpt.pt", 20_000)
    assert original["child"] == "killed by signal 25"  # SIGXFSZ: the kernel's kill
    assert original["bytes"] == 20_000 and original["load"] != "loads"
    port = torn_save("port", tmp_path / "port" / "ckpt", 20_000)
    assert port["child"] == "killed by signal 25"
    assert port["steps"] == ["step_00000004"] and port["load"] == "step 4"


def test_draw_logs_are_read_from_the_last_start_and_torn_lines_skipped(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir(), run.mkdir()
    (ref / "draws.rank0").write_text("".join(f"{i} {i:08x}\n" for i in range(6)))
    # started, killed after 4 (a torn last line), resumed at 2 and replaying from the start
    lines = [
        "0 00000000",
        "1 00000001",
        "2 00000002",
        "3 00000003",
        "4 0000",
        "2 00000000",
        "3 00000001",
        "4 00000004",
        "5 00000003",
    ]
    (run / "draws.rank0").write_text("\n".join(lines) + "\n")
    (d,) = draws_after_resume(run, ref, nproc=1)
    # 2, 3 and 5 differ, each the reference's batch of 2 iterations before; 4 happens to match
    assert (d.resumed_at, d.trained, d.differ, d.replayed, d.lag) == (2, 4, 3, 3, 2)
    a = {"w": torch.zeros(3), "b": torch.ones(2), "step": 3}
    torch.save(a, ref / "final.pt")
    torch.save({**a, "b": torch.tensor([1.0, 2.0])}, run / "final.pt")
    assert differing_tensors(run, ref) == (1, 2)


def test_the_diff_is_the_port_and_its_size_adds_up() -> None:
    hunks, added, removed = script_diff()
    body = "\n".join(hunks).splitlines()
    assert added == sum(ln.startswith("+") for ln in body) > 0
    assert removed == sum(ln.startswith("-") for ln in body) > 0
    for name in (
        "capture_every_rank(",
        "resume_every_rank(",
        "RandomOffsets(",
        "save_checkpoint(",
        "init_from_env(",
        "StopOnSigterm(",
    ):
        assert any(ln.startswith("+") and name in ln for ln in body), name
    assert "-                torch.save(checkpoint, ckpt_path)" in body
    assert added + removed < 110  # a port, not a rewrite (at 88 columns: ~105)


@pytest.mark.timeout(10)
def test_script_command_is_what_chaos_runs(tmp_path: Path) -> None:
    cmd = script_command("port", tmp_path)
    assert "--max-restarts=2" in cmd and "--nproc-per-node=2" in cmd
    assert str(SCRIPTS["port"]) in cmd and "--out_dir={out}" in cmd
    assert f"--data_dir={tmp_path}" in cmd and "--draws_log={out}/draws" in cmd


@pytest.mark.timeout(10)
def test_chaos_scripts_runs_both_scripts_with_the_chapters_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What chapter 12's kill test is given (the chapter runs it for real, on both scripts)."""
    seen: list[dict[str, object]] = []

    def fake_run_chaos(cmd: list[str], **kw: object) -> list[ChaosRow]:
        seen.append({"cmd": cmd, **kw})
        return []

    monkeypatch.setattr(porting, "run_chaos", fake_run_chaos)
    chaos_scripts(tmp_path / "data", tmp_path / "work", scenarios=["kill-rank1"])
    assert [s["cmd"] for s in seen] == [script_command(n, tmp_path / "data") for n in SCRIPTS]
    assert [s["work"] for s in seen] == [tmp_path / "work" / n for n in SCRIPTS]
    assert [s["env"] for s in seen] == [
        {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if n == "original" else {} for n in SCRIPTS
    ]
    assert all(s["kill_on"] == porting.KILL_ON and s["save_on"] == porting.SAVE_ON for s in seen)
    assert all(s["compare"] == "final.pt" and s["scenarios"] == ["kill-rank1"] for s in seen)


@pytest.mark.timeout(10)
def test_chaos_rows_show_paths_relative_to_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chapter prints the rows: no machine's temporary directory in them (issue 40)."""
    work = tmp_path / "work"
    run = work / "original" / "kill-rank1"

    def fake_run_chaos(cmd: list[str], **kw: object) -> list[ChaosRow]:
        row = ChaosRow(
            "kill-rank1",
            "iter 6: loss 3.6",
            1,
            f"Resuming training from {run}",
            False,
            f"exited 1; {run}/ckpt.pt is torn",
            2.0,
            f"see {run}/out",
            log=f"{run}.logs",
        )
        return [row]

    monkeypatch.setattr(porting, "run_chaos", fake_run_chaos)
    (row,) = chaos_scripts(tmp_path / "data", work, names=["original"])["original"]
    assert row.resume == "Resuming training from original/kill-rank1"
    assert row.difference == "exited 1; original/kill-rank1/ckpt.pt is torn"
    assert row.detail == "see original/kill-rank1/out"
    assert row.log == f"{run}.logs"  # still a path the caller can open
    assert relative_paths(row, tmp_path) == row  # nothing under another root changes


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", ["original", "port"])
def test_only_rank_0_prints(name: str) -> None:
    """Under chaos (PYTHONUNBUFFERED=1) a print is two writes, the text then the newline;
    two ranks printing at once shared one pipe and joined two lines into one
    ("...kill-rank0-saveResuming ..."). Every print of both scripts is rank 0's."""
    tree = ast.parse(SCRIPTS[name].read_text())
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "master_process" in ast.unparse(node.test):
            guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    prints = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"
    ]
    unguarded = [ast.unparse(n) for n in prints if id(n) not in guarded]
    assert prints and not unguarded, unguarded


@pytest.mark.timeout(30)
@pytest.mark.parametrize("module", ["", ".accel", ".traps", ".sampling", ".model"])
def test_the_api_page_shows_no_machine_path(module: str) -> None:
    """book/api/demos.md documents these modules: a documented constant whose value holds
    this machine's path (``/work/...``) must hide its value (``:meta hide-value:``)."""
    import importlib

    from sphinx.pycode import ModuleAnalyzer

    name = f"refimpl.demos.porting{module}"
    mod = importlib.import_module(name)
    documented = ModuleAnalyzer.for_module(name).find_attr_docs()
    shown = [
        attr
        for (scope, attr), doc in documented.items()
        if scope == ""
        and str(Path(porting.__file__).parent) in repr(getattr(mod, attr))
        and ":meta hide-value:" not in "".join(doc)
    ]
    assert not shown, f"{name}: {shown} would show this machine's path on the API page"
