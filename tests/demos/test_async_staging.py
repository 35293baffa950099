"""refimpl.demos.async_staging (chapter 9): what dcp.async_save returns with each kind of
staging, and the two ways a caller that does not wait gets a checkpoint that is not the
state at the call. The races are decided by events, so each outcome is asserted exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from refimpl.demos.async_staging import (
    NO_CPU_BACKEND_NOISE,
    overwritten_in_flight,
    return_types,
    torn_by_an_early_step,
    without_a_cpu_backend,
)


def test_async_staging_returns_a_response_at_once_and_sync_staging_a_future(
    tmp_path: Path,
) -> None:
    assert return_types(tmp_path) == {
        "sync staging": "Future",
        "sync staging: state at the call": "True",
        "async staging": "AsyncSaveResponse",
        "async staging: state at the call": "True",
    }


def test_a_step_before_staging_completes_tears_the_checkpoint(tmp_path: Path) -> None:
    # the model was copied before the step, the optimizer state after it: a torn checkpoint
    assert torn_by_an_early_step(tmp_path, wait_for_staging=False) == {
        "model": True,
        "optim": False,
    }
    assert torn_by_an_early_step(tmp_path, wait_for_staging=True) == {
        "model": True,
        "optim": True,
    }


def test_a_second_save_into_reused_buffers_overwrites_the_first_in_flight(
    tmp_path: Path,
) -> None:
    assert overwritten_in_flight(tmp_path / "a", wait_first=False) == {
        "first": 2.0,
        "second": 2.0,
    }
    assert overwritten_in_flight(tmp_path / "b", wait_first=True) == {
        "first": 1.0,
        "second": 2.0,
    }


def test_async_save_refuses_a_group_without_a_cpu_backend(
    capfd: pytest.CaptureFixture[str],
) -> None:
    message = without_a_cpu_backend()
    assert message.startswith("AssertionError: A CPU backend must be enabled for async save")
    assert "cpu:gloo,cuda:nccl" in message
    assert not dist.is_initialized()
    # torch's C++ warning on destroying that group (timestamped) is not printed: the
    # chapter's output stays the same from run to run
    assert NO_CPU_BACKEND_NOISE not in capfd.readouterr().err


def test_without_a_cpu_backend_refuses_to_replace_an_existing_group(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="makes its own process group"):
            without_a_cpu_backend()
    finally:
        dist.destroy_process_group()
