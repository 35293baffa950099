"""refimpl.sharded._low_priority and AsyncSaver's writer_nice (chapter 9): the background
threads that write and commit run at the requested nice value, the training thread never changes
priority, and what they write is a plain DCP checkpoint."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from refimpl.sharded import AsyncSaver, load_sharded
from refimpl.sharded._low_priority import LowPriorityWriter, lower_thread_priority
from refimpl.sharded._paced_writer import PacedWriter

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


class _Observed(LowPriorityWriter):
    seen: ClassVar[list[int]] = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        _Observed.seen.append(_nice())


class _ObservedPaced(PacedWriter):
    """AsyncSaver's writer: records its thread's nice value and its CPU share."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        _Observed.seen.append(_nice())
        _ObservedPaced.shares.append(self.cpu_share)

    shares: ClassVar[list[float | None]] = []


@linux_only
def test_the_async_writer_thread_is_reniced_and_the_caller_is_not(tmp_path: Path) -> None:
    _Observed.seen = []
    before = _nice()
    state = {"w": torch.arange(10.0)}
    future: Any = async_save(
        state, storage_writer=_Observed(tmp_path / "a", nice=before + 7), no_dist=True
    )
    future.result()
    assert _Observed.seen == [before + 7]
    assert _nice() == before
    back = {"w": torch.zeros(10)}
    dcp_load(back, checkpoint_id=tmp_path / "a", no_dist=True)  # a plain DCP checkpoint
    assert torch.equal(back["w"], state["w"])


@linux_only
def test_a_synchronous_save_leaves_the_calling_thread_alone(tmp_path: Path) -> None:
    _Observed.seen = []
    before = _nice()
    dcp_save({"w": torch.ones(3)}, storage_writer=_Observed(tmp_path / "s", nice=19), no_dist=True)
    assert _Observed.seen == [before] and _nice() == before


@linux_only
def test_lower_thread_priority_never_raises_a_threads_priority() -> None:
    result: dict[str, Any] = {}

    def body() -> None:
        result["first"] = lower_thread_priority(12)
        result["second"] = lower_thread_priority(5)  # asks for a higher priority: ignored
        result["nice"] = _nice()

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert result == {"first": True, "second": True, "nice": 12}
    assert lower_thread_priority(0) is False  # 0: leave the thread as it is


def test_writer_nice_out_of_range_is_refused_before_anything_starts() -> None:
    # 5.5 passed the range check, then every save failed in os.setpriority's int argument
    for bad in (-1, 20, 5.5, True, "5"):
        with pytest.raises(ValueError, match="writer_nice must be an int from 0 to 19"):
            AsyncSaver(writer_nice=bad)


def test_writer_cpu_share_out_of_range_is_refused_before_anything_starts() -> None:
    # 1e-7 was accepted: each 1 MiB piece then slept for hours and the save never committed
    for bad in (0, 2.0, -0.5, 1e-7, True):
        with pytest.raises(ValueError, match="cpu_share must be a number in"):
            AsyncSaver(writer_cpu_share=bad)  # before asking for a process group


@linux_only
def test_async_saver_writes_and_commits_from_low_priority_threads(tmp_path: Path) -> None:
    _Observed.seen, _ObservedPaced.shares = [], []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = _nice()
        default = AsyncSaver()  # the measured choice: the trainer's priority (chapter 9)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("refimpl.sharded._async.PacedWriter", _ObservedPaced)
            default.save(tmp_path / "default", model, opt, 1).result(timeout=60)
        default_commit_nice = default._pool.submit(_nice).result()
        default.close()
        assert _Observed.seen == [before] and default_commit_nice == before, _Observed.seen
        _Observed.seen = []
        saver = AsyncSaver(writer_nice=13, writer_cpu_share=0.5)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("refimpl.sharded._async.PacedWriter", _ObservedPaced)
            path = saver.save(tmp_path / "ckpt", model, opt, 1).result(timeout=60)
        commit_nice = saver._pool.submit(_nice).result()
        saver.close()
        assert _Observed.seen == [13] and commit_nice == 13 and _nice() == before
        assert _ObservedPaced.shares == [None, 0.5]  # unpaced by default
        fresh = torch.nn.Linear(4, 4)
        assert load_sharded(path, fresh) == 1
        assert torch.equal(fresh.weight, model.weight)
    finally:
        dist.destroy_process_group()
