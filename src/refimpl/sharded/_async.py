"""Chapter 9: `AsyncSaver`, the background half of `refimpl.sharded.async_save_sharded`.

What ``dcp.async_save`` does (torch 2.13, ``state_dict_saver.py``): it *stages* the state
(copies every tensor to CPU memory through an ``AsyncStager``), then runs ``dcp.save`` on the
copy in a thread, using the process group it is given for its collectives. Two things are
ours:

- one ``DefaultStager`` kept for the saver's lifetime. Its ``StateDictStager`` caches one CPU
  buffer per source storage and copies into it on every later save, so the staging memory
  (one copy of this rank's shard of the model and optimizer) is allocated once;
- a dedicated gloo process group for the background collectives (DCP's plan exchange, and
  our digest gather and commit broadcast), so they never interleave with the training
  loop's collectives on the default group; and one save in flight at a time.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.constants import default_pg_timeout
from torch.distributed.tensor import DTensor

from refimpl._group_timeout import group_timeout
from refimpl._pacer import lower_thread_priority
from refimpl.sharded._async_handle import AsyncSaveHandle
from refimpl.sharded._errors import dcp_errors
from refimpl.sharded._group import Group, commit_step, discard, prepare_step
from refimpl.sharded._paced_writer import PacedWriter, check_cpu_share
from refimpl.sharded._state import pack_checked


class _ReusingStager(DefaultStager):
    """DCP's ``DefaultStager``, copying in the calling thread (page-locked buffers if
    ``pinned``, no shared memory), that remembers where the staged tensors live."""

    def __init__(self, pinned: bool) -> None:
        super().__init__(StagingOptions(pinned, False, False, False))
        self.pinned = pinned
        self.addresses: tuple[int, ...] = ()
        self.nbytes = 0

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        staged = super().stage(state_dict, **kwargs)
        tensors = [t.to_local() if isinstance(t, DTensor) else t for t in _tensors(staged)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        self.addresses = tuple(sorted(storages))
        self.nbytes = sum(storages.values())
        return staged


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _as_int(value: Any) -> int | None:
    """``value`` as an int if it is one (numpy and 0-d tensor integers too), else None."""
    try:
        return operator.index(value)
    except TypeError:
        return None


class AsyncSaver:
    """Background sharded saves, one at a time, on a dedicated gloo process group.

    Create it on every rank after the process group is initialised (creating the dedicated
    group is collective); ``process_group`` limits it to that group's ranks, whose collective
    timeout it inherits unless ``timeout_s`` is given (``dist.new_group`` alone would give
    it torch's 30-minute default). Its staging buffers live until `close`.
    `refimpl.sharded.async_save_sharded` uses a per-process default; create one yourself to
    control its lifetime::

        saver = AsyncSaver()
        handle = saver.save("ckpt", model, optimizer, step)
        ...
        saver.close()          # waits for the last save, frees the staging memory

    Call it from the training thread only, and wait for the last save (``close``, `wait` or
    the handle's ``result``) before the process group is destroyed: a save still running
    then fails, and is never published.

    ``pinned_memory`` chooses page-locked staging buffers, which CUDA copies into at full
    speed and without staging through a bounce buffer: None (the default) pins them when
    CUDA is available, True insists (and raises ``ValueError`` without CUDA: page-locking
    needs the CUDA driver, and torch's stager would only warn and fall back), False never
    pins (pinned memory cannot be swapped out: for a host short of RAM). On CPU-only
    machines the buffers are ordinary memory either way.

    ``writer_nice`` (0 by default: the caller's priority; 1-19) lowers the CPU priority of
    the threads that write and commit (``refimpl.sharded._low_priority``; Linux keeps a nice
    value per thread), so they take the CPU time training leaves idle first. It moves the
    write's CPU work rather than removing it, and a save at low priority becomes durable
    later, so it is not the default; on a host whose trainer leaves cores idle, try 19
    (chapter 9 measures both).

    ``writer_cpu_share`` (None by default: unpaced; 0.01 <= share <= 1) paces the background
    write to at most that share of one core (``refimpl.sharded._paced_writer``): the
    checkpoint commits about ``1 / share`` times the write's CPU time later, and the steps
    it overlaps share the cores with a thinner write (chapter 9 measures both). A smaller
    share (or ``True``) is a ``ValueError``: the write would never end.

    A process that exits with a save nobody waited for stops pacing it and waits for it, at
    most the collective timeout, before Python joins the saver's threads; then names the save
    and what became of it on stderr (a `refimpl.launch.spawn` rank too, before it reports). A
    save still running after that is lost, and the process exits at once with status 1.

    The background write runs in a thread of this process (DCP's default); there is no
    process mode (chapter 9 compares torch's ``AsyncCheckpointerType.PROCESS``): its daemon
    would break this class's promises: one per process, bound to the ranks of the
    first group that used it, a gloo world with torch's 30-minute timeout, a caller that
    waits with no timeout, and a training script re-imported by the spawned daemon.
    """

    def __init__(
        self,
        process_group: torch.distributed.ProcessGroup | None = None,
        *,
        timeout_s: float | None = None,
        pinned_memory: bool | None = None,
        writer_nice: int = 0,
        writer_cpu_share: float | None = None,
    ) -> None:
        nice = None if isinstance(writer_nice, bool) else _as_int(writer_nice)
        if nice is None or not 0 <= nice <= 19:  # 5.5 would fail every save in setpriority
            raise ValueError(f"writer_nice must be an int from 0 to 19, got {writer_nice!r}")
        writer_nice = nice
        check_cpu_share(writer_cpu_share)
        if pinned_memory and not torch.cuda.is_available():
            raise ValueError(
                "pinned_memory=True needs CUDA (page-locking is a CUDA driver call); pass "
                "None to pin only where CUDA is available"
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "AsyncSaver needs an initialised process group (refimpl.launch.spawn or "
                "torchrun); without one, use save_sharded"
            )
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        timeout = (
            group_timeout(process_group) if timeout_s is None else timedelta(seconds=timeout_s)
        )
        self._pg = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        self._timeout_s = (timeout or default_pg_timeout).total_seconds()  # None: torch's default
        pinned = torch.cuda.is_available() if pinned_memory is None else pinned_memory
        self._stager = _ReusingStager(pinned)
        self.writer_nice = writer_nice
        self.writer_cpu_share = writer_cpu_share
        self._pool = ThreadPoolExecutor(
            1,
            thread_name_prefix="refimpl-async-save",
            initializer=lower_thread_priority,
            initargs=(writer_nice,),
        )
        self._pending: AsyncSaveHandle | None = None
        self._closed = False

    @property
    def pinned_memory(self) -> bool:
        """Whether the staging buffers are page-locked (see the class docstring)."""
        return self._stager.pinned

    @property
    def staging_addresses(self) -> tuple[int, ...]:
        """Addresses of the last save's staging buffers, the same on every save (reused)."""
        return self._stager.addresses

    def save(
        self,
        ckpt_dir: str | os.PathLike[str],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        step: int,
        *,
        keep_last: int | None = 3,
        process_group: dist.ProcessGroup | None = None,
        state: Mapping[str, Any] | None = None,
    ) -> AsyncSaveHandle:
        """Wait for the previous save, stage, start writing; see `async_save_sharded`.

        Takes what `refimpl.sharded.save_sharded` takes. ``process_group``, if given, must
        span the ranks this saver was created for (its own gloo group does the work).
        ``state`` is serialised during the call, so later changes are not saved. The handle's
        ``path`` is the step directory the commit will publish."""
        if self._closed:
            raise RuntimeError("this AsyncSaver is closed; create a new one")
        if process_group is not None and dist.get_process_group_ranks(
            process_group
        ) != dist.get_process_group_ranks(self._pg):
            raise ValueError(
                "process_group spans other ranks than this AsyncSaver's; create an "
                "AsyncSaver(process_group=...) for that group"
            )
        self.wait()
        group = Group(self._pg)
        packed = pack_checked(group, state)  # refused on every rank before touching the disk
        tmp, final = prepare_step(group, Path(ckpt_dir), step)
        what = f"async save of step {step}"
        with dcp_errors(final, what, group.rank, on_error=lambda: discard(group, tmp)):
            msd, osd = get_state_dict(model, optimizer)
            upload = async_save(
                {"model": msd, "optim": osd, **packed},
                storage_writer=PacedWriter(
                    tmp,
                    nice=self.writer_nice,
                    cpu_share=self.writer_cpu_share,
                    sync_files=True,
                    overwrite=False,
                ),
                process_group=self._pg,
                async_stager=self._stager,
            )
        if not isinstance(upload, Future):  # an AsyncSaveResponse: only with async staging
            raise TypeError(f"dcp.async_save returned {type(upload).__name__}, not a Future")
        future = self._pool.submit(self._finish, group, upload, tmp, final, step, keep_last)
        self._pending = AsyncSaveHandle(
            step, final, future, self._stager.nbytes, exit_wait_s=self._timeout_s
        )
        return self._pending

    @staticmethod
    def _finish(
        group: Group, upload: Future[Any], tmp: Path, final: Path, step: int, keep: int | None
    ) -> Path:
        what = f"async save of step {step}"
        with dcp_errors(final, what, group.rank, on_error=lambda: discard(group, tmp)):
            upload.result()  # every rank's shards written and fsynced, .metadata written
        return commit_step(group, tmp, final, step, keep)

    def wait(self) -> Path | None:
        """Wait for the save in flight, if any; return its step directory, or raise its error
        unless its handle already raised it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        seen = pending.error_seen
        try:
            return pending.result()
        except BaseException:
            if seen and pending.done():
                return None
            raise

    def close(self) -> None:
        """Wait for the last save, then free the staging buffers and the worker thread."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._stager.close()
            self._pool.shutdown(wait=True)


_DEFAULT: dict[str, Any] = {}


def default_saver() -> AsyncSaver:
    """The process's `AsyncSaver` for the current default process group (made on first use)."""
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    saver = _DEFAULT.get("saver")
    if not isinstance(saver, AsyncSaver) or saver._closed or _DEFAULT.get("world") is not world:
        saver = AsyncSaver()
        _DEFAULT.update(saver=saver, world=world)
    return saver
