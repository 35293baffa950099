"""An async sharded save nobody waited for is not discarded in silence (issue 19 item 15), in a
plain process and in a rank of refimpl.launch.spawn; and it never keeps the process from
exiting: pacing stops at exit, and the wait for it is bounded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# One process, a world of one: the save commits in the background while the script exits.
_SCRIPT = """
    import os, sys, tempfile, torch, torch.distributed as dist
    from refimpl.demos.sharded import tiny_model, train
    from refimpl.sharded import AsyncSaver, async_save_sharded
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    model = tiny_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, range(1, 3))
    if sys.argv[3] == "forget":
        async_save_sharded(sys.argv[1], model, opt, 7)
    elif sys.argv[3] == "wait":
        print(async_save_sharded(sys.argv[1], model, opt, 7).result().name)
    elif sys.argv[3] == "close":  # close the saver: it waits for the last save
        saver = AsyncSaver()
        saver.save(sys.argv[1], model, opt, 7)
        saver.close()
    elif sys.argv[3] == "paced":  # the writer's clock far ahead: every piece wants an hour's sleep
        import itertools, time, types
        from refimpl import _pacer
        _pacer.MAX_SLEEP_S = 3600.0  # no cap to save it: only the exit can
        ticks = itertools.count()
        _pacer.time = types.ModuleType("time")  # time, with a CPU clock running fast
        _pacer.time.__dict__.update(vars(time), thread_time=lambda: 1e3 * next(ticks))
        AsyncSaver(writer_cpu_share=0.01).save(sys.argv[1], model, opt, 7)
    else:  # "stuck": the write never returns (a dead NFS server), the saver's timeout 2 s
        import threading
        from refimpl.sharded import _paced_writer
        _paced_writer._PacedStream.write = lambda self, data: threading.Event().wait()
        AsyncSaver(writer_cpu_share=0.5, timeout_s=2).save(sys.argv[1], model, opt, 7)
    print("script done", flush=True)
"""


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    code = textwrap.dedent(_SCRIPT)
    args = [str(tmp_path / "ckpt"), str(tmp_path / "store"), mode]
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=90, env=env
    )


@pytest.mark.timeout(120)
def test_an_async_save_never_waited_for_is_named_at_exit(tmp_path: Path) -> None:
    run = _run(tmp_path, "forget")
    assert run.returncode == 0, run.stderr
    assert "script done" in run.stdout
    warning = [line for line in run.stderr.splitlines() if line.startswith("refimpl warning")]
    assert len(warning) == 1, run.stderr
    assert "async save of step 7" in warning[0] and str(tmp_path / "ckpt") in warning[0]
    assert "never waited for" in warning[0] and "handle.result()" in warning[0]
    # The save itself finished (the worker thread is joined before atexit handlers run).
    assert "had committed" in warning[0] and (tmp_path / "ckpt" / "step_00000007").is_dir()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["wait", "close"])
def test_a_save_waited_for_exits_without_a_word(tmp_path: Path, mode: str) -> None:
    run = _run(tmp_path, mode)
    assert run.returncode == 0, run.stderr
    assert "refimpl warning" not in run.stderr, run.stderr
    assert (tmp_path / "ckpt" / "step_00000007").is_dir()


@pytest.mark.timeout(120)
def test_a_paced_save_nobody_waited_for_finishes_unpaced_at_exit(tmp_path: Path) -> None:
    """Before: the paced writer slept on (10**4 s a piece at a share of 1e-7) and the process
    never exited. Now the exit stops pacing, the save commits, the warning says so."""
    run = _run(tmp_path, "paced")
    assert run.returncode == 0, run.stderr
    warning = [line for line in run.stderr.splitlines() if line.startswith("refimpl warning")]
    assert len(warning) == 1 and "had committed" in warning[0], run.stderr
    assert (tmp_path / "ckpt" / "step_00000007" / "COMMITTED").is_file()


@pytest.mark.timeout(120)
def test_a_save_that_never_finishes_ends_the_process_after_its_timeout(tmp_path: Path) -> None:
    """Before: Python joined the stuck writer's thread forever. Now the exit waits the saver's
    collective timeout (2 s here), names the lost save, and exits with status 1."""
    run = _run(tmp_path, "stuck")
    assert run.returncode == 1, run.stderr
    assert "script done" in run.stdout
    lines = run.stderr.splitlines()
    warning = [line for line in lines if line.startswith("refimpl warning")]
    assert len(warning) == 1 and "was still running (it is lost" in warning[0], run.stderr
    error = [line for line in lines if line.startswith("refimpl error")]
    assert len(error) == 1 and "exiting with status 1" in error[0], run.stderr
    assert "step 7" in error[0] and "2 s after" in error[0]
    assert not (tmp_path / "ckpt" / "step_00000007").exists()


@pytest.mark.timeout(180)
def test_a_spawn_rank_names_the_save_it_never_waited_for(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spawn rank runs no atexit handler (multiprocessing leaves through os._exit) and is
    killed once it reports: the warning used to be lost there. Now it is in each rank's
    output, and the save committed."""
    from workers.sharded import async_save_never_waited

    from refimpl.launch import spawn

    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    spawn(
        async_save_never_waited,
        2,
        str(tmp_path / "ckpt"),
        rank_output="show",
        timeout_s=150,
        pg_timeout_s=30,
    )
    out = capfd.readouterr().out
    for rank in (0, 1):
        lines = [ln for ln in out.splitlines() if ln.startswith(f"[rank {rank}] refimpl warning")]
        assert len(lines) == 1, out
        assert "async save of step 5" in lines[0] and "had committed" in lines[0]
    assert (tmp_path / "ckpt" / "step_00000005" / "COMMITTED").is_file()
