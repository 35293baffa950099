"""``python -m refimpl.bench save --sizes-mb 256 1024 --out DIR``: what saving costs training.

For each state size, every method saves the same state, round robin (the order rotating
every round), one cold round and then ``--repeats`` timed rounds. Each method reports two
times: **blocking** (how long the training loop is stopped: until the call returns) and
**total** (until the checkpoint is on disk and fsynced). For a synchronous save they are
equal.

- ``floor_memcpy``: copy the state into pre-allocated buffers, the least any save that
  snapshots the state must block for;
- ``floor_write_fsync``: one large ``os.write`` of the same bytes, then ``fsync``: the disk's
  floor for making them durable;
- ``torch_save``, ``torch_save_fsync``, ``atomic_save`` (`refimpl.atomic`);
- ``dcp_sync``: ``dcp.save`` (``FileSystemWriter`` fsyncs its files by default);
- ``dcp_async``: ``dcp.async_save`` with its default stager: a new CPU copy of the state on
  every save, then the write in a background thread;
- ``dcp_async_staged``: ``dcp.async_save`` with one ``DefaultStager`` kept across saves, which
  reuses its staging buffers after the first save (pinned and shared memory off: there is no
  GPU here);
- ``dcp_async_staged_low``: the same, written by
  ``refimpl.sharded._low_priority.LowPriorityWriter``: the writing thread at nice 19, as
  `AsyncSaver` writes;
- ``dcp_async_process``: the same, with ``async_checkpointer_type=AsyncCheckpointerType.PROCESS``:
  the write runs in DCP's checkpoint daemon (a spawned process with its own interpreter, so
  no GIL shared with training) and the staging buffers are in shared memory, which the
  daemon maps. The daemon is started by the cold round (``cold_*`` in its row);
- ``save_checkpoint`` (`refimpl.checkpoint`: the pack, manifest, fsyncs, publish) and
  ``async_checkpoint`` (`refimpl.checkpoint.AsyncCheckpointer`: blocking until staged,
  total until committed), measured by `refimpl.bench._save_files`.

Beside them (`refimpl.bench._save_inflight`), training step time alone and with a staged save
in flight, by each writer: the cost of the background write to the steps that overlap it
(here, on a disk and two CPU cores shared with compute). Saves use ``no_dist=True``, but
the process checkpointer needs a process group to start its daemon, so the benchmark runs in
a one-rank gloo group (`one_rank_group`); the chapters' multi-rank saves are measured in their
notebooks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import _async_process_executor
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from refimpl.atomic import atomic_save
from refimpl.bench import summarize
from refimpl.bench._save_files import Timed, file_methods, timed_sync
from refimpl.bench._save_inflight import LOW_NICE
from refimpl.checkpoint import AsyncCheckpointer
from refimpl.sharded._low_priority import LowPriorityWriter

__all__ = ["METHODS", "make_stager", "measure_size", "one_rank_group"]

METHODS = (
    "floor_memcpy",
    "floor_write_fsync",
    "torch_save",
    "torch_save_fsync",
    "atomic_save",
    "dcp_sync",
    "dcp_async",
    "dcp_async_staged",
    "dcp_async_staged_low",
    "dcp_async_process",
    "save_checkpoint",
    "async_checkpoint",
)
PROCESS = AsyncCheckpointerType.PROCESS


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _start(
    state: dict[str, torch.Tensor],
    path: Path,
    stager: DefaultStager | None,
    process: bool,
    nice: int = 0,
) -> Any:
    """Start one ``dcp.async_save`` of ``state`` to ``path``; return its future."""
    kwargs: dict[str, Any] = {} if stager is None else {"async_stager": stager}
    if process:
        kwargs["async_checkpointer_type"] = PROCESS
    if nice:
        kwargs["storage_writer"] = LowPriorityWriter(path, nice=nice)
    else:
        kwargs["checkpoint_id"] = path
    return dcp_async_save({"model": state}, no_dist=True, **kwargs)


def _methods(
    state: dict[str, torch.Tensor],
    stager: DefaultStager,
    shared: DefaultStager,
    files: dict[str, Timed],
) -> dict[str, Timed]:
    buffers = {k: torch.empty_like(v) for k, v in state.items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    blob = bytearray(os.urandom(1 << 20)) * (nbytes >> 20)  # incompressible, as tensors are

    def memcpy(path: Path) -> None:
        for k, v in state.items():
            buffers[k].copy_(v)

    def write_fsync(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def torch_save_fsync(path: Path) -> None:
        torch.save(state, path)
        _fsync_file(path)

    def async_timed(
        stager_for_call: DefaultStager | None, process: bool = False, nice: int = 0
    ) -> Timed:
        def timed(path: Path) -> tuple[float, float]:
            start = time.perf_counter()
            future = _start(state, path, stager_for_call, process, nice)
            blocking = time.perf_counter() - start
            future.result()  # the background write, fsync included, is done
            return blocking, time.perf_counter() - start

        return timed

    return {
        "floor_memcpy": timed_sync(memcpy),
        "floor_write_fsync": timed_sync(write_fsync),
        "torch_save": timed_sync(lambda p: torch.save(state, p)),
        "torch_save_fsync": timed_sync(torch_save_fsync),
        "atomic_save": timed_sync(lambda p: atomic_save(state, p)),
        "dcp_sync": timed_sync(lambda p: dcp_save({"model": state}, checkpoint_id=p, no_dist=True)),
        "dcp_async": async_timed(None),
        "dcp_async_staged": async_timed(stager),
        "dcp_async_staged_low": async_timed(stager, nice=LOW_NICE),
        "dcp_async_process": async_timed(shared, process=True),
        "save_checkpoint": files["save_checkpoint"],
        "async_checkpoint": files["async_checkpoint"],
    }


def _clean(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def make_stager(shared: bool = False) -> DefaultStager:
    """A stager for CPU tensors: synchronous copy into buffers it keeps for the next save;
    ``shared``: the buffers are in shared memory (what the process checkpointer sends)."""
    options = StagingOptions(
        use_pinned_memory=False,
        use_shared_memory=shared,
        use_async_staging=False,
        use_non_blocking_copy=False,
    )
    return DefaultStager(options)


def measure_size(
    state: dict[str, torch.Tensor], scratch: Path, repeats: int, bar: Any = None
) -> list[dict[str, Any]]:
    """One row per method for this state: blocking and total seconds (median, spread, cold)."""
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    stager, shared = make_stager(), make_stager(shared=True)
    saver = AsyncCheckpointer(scratch / "async", keep_last=None, wait_on_sigterm=False)
    todo = _methods(state, stager, shared, file_methods(state, scratch, saver))
    blocking: dict[str, list[float]] = {m: [] for m in todo}
    total: dict[str, list[float]] = {m: [] for m in todo}
    cold: dict[str, tuple[float, float]] = {}
    try:
        names = list(todo)
        for rnd in range(repeats + 1):
            # the order rotates each timed round, so that no method always follows the same
            # one (a method that frees a gigabyte of pages slows whichever comes next)
            shift = (rnd - 1) % len(names) if rnd else 0
            for name in names[shift:] + names[:shift]:
                path = scratch / f"{name}_{rnd}"
                blocked_s, total_s = todo[name](path)
                _clean(path)
                if rnd == 0:
                    cold[name] = (blocked_s, total_s)  # first buffers, first files: apart
                else:
                    blocking[name].append(blocked_s)
                    total[name].append(total_s)
                if bar is not None:
                    bar.update(1)
    finally:
        stager.close()
        shared.close()
        saver.close()
    rows = []
    for name in todo:
        b = summarize(blocking[name])
        t = summarize(total[name])
        rows.append(
            {
                "method": name,
                "bytes": nbytes,
                "blocking_s_median": b["median"],
                "blocking_s_min": b["min"],
                "blocking_s_max": b["max"],
                "total_s_median": t["median"],
                "total_s_min": t["min"],
                "total_s_max": t["max"],
                "repeats": repeats,
                "cold_blocking_s": cold[name][0],
                "cold_total_s": cold[name][1],
            }
        )
    return rows


@contextlib.contextmanager
def one_rank_group(scratch: Path) -> Iterator[None]:
    """A one-rank gloo process group for the benchmark's process checkpointer, unless one is
    initialised already; on exit, DCP's checkpoint daemon is stopped and the group destroyed.

    ``AsyncCheckpointerType.PROCESS`` reads ranks and broadcasts the daemon's address on a
    process group even with ``no_dist=True`` (torch 2.13, ``_async_process_executor.py``),
    and keeps its daemon in a module global for the life of the process: it is stopped
    here (private API: a benchmark may reach in, the library does not)."""
    owned = not dist.is_initialized()
    if owned:
        scratch.mkdir(parents=True, exist_ok=True)
        store = (scratch / "one_rank_store").resolve()
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        daemon = getattr(_async_process_executor, "_CHECKPOINT_PROCESS", None)
        if daemon is not None:
            _async_process_executor._CHECKPOINT_PROCESS = None
            daemon.__del__()  # asks the daemon to exit, SIGTERM after 5 s
            daemon._save_process.join(timeout=10)  # gone: its __del__ at collection is a no-op
        if owned:
            dist.destroy_process_group()
