"""An async sharded save nobody waited for is not discarded in silence (issue 19 item 15)."""

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
    else:  # close the saver: it waits for the last save
        saver = AsyncSaver()
        saver.save(sys.argv[1], model, opt, 7)
        saver.close()
    print("script done", flush=True)
"""


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    code = textwrap.dedent(_SCRIPT)
    args = [str(tmp_path / "ckpt"), str(tmp_path / "store"), mode]
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=90, env=env)  # fmt: skip


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
