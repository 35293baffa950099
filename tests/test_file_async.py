"""`refimpl.checkpoint.AsyncCheckpointer`: file checkpoints written in the background with the
promises of `save_checkpoint` (chapters 5 and 9). No test relies on timing: the background
write is held on an Event where a test needs a save to be in flight."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import refimpl.checkpoint as ck
import refimpl.checkpoint._async as async_module
from refimpl.checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_latest,
)
from refimpl.demos.io_faults import inject_io_error


def _state(v: float) -> dict[str, Any]:
    model = {"w": torch.full((1000,), v), "b": torch.zeros(3)}
    model["tied"] = model["w"]  # the same tensor twice, as tied weights are
    return {"model": model, "meta": {"v": v, "names": ["a", "b"]}, "step": int(v)}


def test_the_saved_step_is_the_state_at_the_call_not_after(tmp_path: Path) -> None:
    state = _state(1.0)
    with AsyncCheckpointer(tmp_path) as saver:
        path = saver.save(state, 1)
        state["model"]["w"].add_(100)  # training goes on at once
        state["meta"]["names"].append("c")
    assert path == tmp_path / "step_00000001"
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["model"]["w"], torch.full((1000,), 1.0))
    assert loaded["meta"] == {"v": 1.0, "names": ["a", "b"]}
    assert loaded["model"]["tied"].data_ptr() == loaded["model"]["w"].data_ptr()  # still tied


def test_staging_buffers_are_reused_between_saves_and_keep_last_prunes(tmp_path: Path) -> None:
    saver = AsyncCheckpointer(tmp_path, keep_last=2)
    saver.save(_state(1.0), 1)
    first = saver.staging_addresses
    for step in (2, 3, 4):
        saver.save(_state(float(step)), step)
        assert saver.staging_addresses == first  # copied into, not reallocated
    saver.close()
    assert saver.staged_bytes == 1003 * 4  # the tied tensor is staged once
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    found = load_latest(tmp_path)
    assert found is not None and found[0] == 4 and found[1]["meta"]["v"] == 4.0


def test_at_most_one_save_is_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release, started = threading.Event(), threading.Event()
    real = ck.save_checkpoint

    def held(*args: Any, **kwargs: Any) -> Path:
        started.set()
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(async_module, "save_checkpoint", held)
    saver = AsyncCheckpointer(tmp_path)
    saver.save(_state(1.0), 1)
    assert started.wait(60) and not saver.done()
    second = threading.Thread(target=saver.save, args=(_state(2.0), 2))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waiting for step 1, not writing beside it
    assert not (tmp_path / "step_00000001").exists()
    release.set()
    second.join(60)
    assert not second.is_alive()
    saver.close()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2]


def test_a_failed_background_save_raises_at_the_next_call_and_loses_nothing(
    tmp_path: Path,
) -> None:
    saver = AsyncCheckpointer(tmp_path)
    saver.save(_state(1.0), 1)
    saver.wait()
    with inject_io_error(errno.ENOSPC, after_bytes=100):
        saver.save(_state(2.0), 2)
        with pytest.raises(CheckpointError, match="step 2 failed") as info:
            saver.save(_state(3.0), 3)  # step 2's error, at the next call
    assert "No space left" in str(info.value)
    saver.save(_state(3.0), 3)  # the saver goes on working
    saver.close()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 3]  # step 1 intact, no temps
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000003"]


def test_error_surfaces_at_wait_and_close_too(tmp_path: Path) -> None:
    saver = AsyncCheckpointer(tmp_path)
    with inject_io_error(errno.EIO, on="fsync"):
        saver.save(_state(1.0), 1)
        with pytest.raises(CheckpointError, match="Input/output error"):
            saver.wait()
        saver.save(_state(2.0), 2)
        with pytest.raises(CheckpointError):
            saver.close()
    assert list_checkpoints(tmp_path) == []
    with pytest.raises(RuntimeError, match="closed"):
        saver.save(_state(3.0), 3)


def test_bad_input_is_refused_during_the_call(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path) as saver:
        with pytest.raises(CheckpointError, match=r"refused before staging anything.*PosixPath"):
            saver.save({"meta": {"where": tmp_path}}, 1)
        with pytest.raises(ValueError, match="step must be"):
            saver.save(_state(1.0), -1)
        with pytest.raises(ValueError, match="file-name-safe"):
            saver.save({"a/b": 1}, 1)
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="writer_nice"):
        AsyncCheckpointer(tmp_path, writer_nice=20)
    with pytest.raises(ValueError, match="cpu_share"):
        AsyncCheckpointer(tmp_path, writer_cpu_share=0)


def test_a_paced_save_writes_the_same_checkpoint(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path / "paced", writer_cpu_share=0.5, writer_nice=5) as saver:
        saver.save(_state(1.0), 1)
    with AsyncCheckpointer(tmp_path / "plain") as saver:
        saver.save(_state(1.0), 1)
    paced = (tmp_path / "paced" / "step_00000001" / ck.PACK).read_bytes()
    assert paced == (tmp_path / "plain" / "step_00000001" / ck.PACK).read_bytes()


_CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    from refimpl.checkpoint import AsyncCheckpointer
    saver = AsyncCheckpointer(sys.argv[1], writer_cpu_share=0.02)  # slow: still in flight
    saver.save({"w": torch.randn(1 << 21, generator=torch.Generator().manual_seed(0))}, 5)
    if sys.argv[2] == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        print("survived SIGTERM")  # never printed: the default action ends the process
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["sigterm", "exit"])
def test_the_save_in_flight_commits_on_sigterm_and_at_exit(tmp_path: Path, how: str) -> None:
    """SIGTERM (pre-emption) or the end of the script while an 8 MiB save is paced to 2% of a
    core: the process waits for it, then ends as it would have (SIGTERM: killed by it)."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), how],
        capture_output=True,
        text=True,
        timeout=100,
    )
    expected = -signal.SIGTERM if how == "sigterm" else 0
    assert done.returncode == expected, done.stderr
    assert "survived" not in done.stdout
    found = load_latest(tmp_path)
    want = torch.randn(1 << 21, generator=torch.Generator().manual_seed(0))
    assert found is not None and found[0] == 5 and torch.equal(found[1]["w"], want)
    if how == "sigterm":
        assert "waited for the checkpoint in flight" in done.stderr, done.stderr
    assert os.listdir(tmp_path) == ["step_00000005"]
