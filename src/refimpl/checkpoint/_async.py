"""Chapters 5 and 9: `AsyncCheckpointer`, `refimpl.checkpoint.save_checkpoint` in the background.

A synchronous save stops training for the whole write and fsync. Here the call only
*stages* the state: every tensor is copied into a buffer this object keeps (allocated on the
first save, reused by every later save of the same shapes; page-locked where CUDA is
available, so device-to-host copies run at full speed), everything else is deep-copied.
After the call returns, training may change the originals at once. A single worker thread
then runs `save_checkpoint` on the copy: the same file, manifest, digests, fallback and
``keep_last`` as a synchronous save, so a kill at any moment loses at most the step in
flight and never tears a committed one.

At most one save is in flight: the next `save` first waits for it. A failed save raises
its `CheckpointError` at the next `save`, at `wait` or at `close`, never silently. At
interpreter exit the worker thread finishes the save in flight (``concurrent.futures``
joins it before ``atexit`` handlers run), and a save that failed with nobody waiting is
logged. On SIGTERM (the usual pre-emption notice), the handler this object installs in the
main thread waits for the save in flight before the previous handler runs.

It is a one-process object: in a DDP job, create and call it on rank 0 only; the other ranks
never wait for rank 0's write (chapter 4's barrier guards a *synchronous* save, which
takes long enough for the other ranks to time out in their next collective).
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import signal
import threading
import weakref
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from refimpl._manifest import as_step, refusal
from refimpl._pacer import Pacer, check_cpu_share, lower_thread_priority
from refimpl._pack import paced
from refimpl._step_dirs import CheckpointError, step_dir_name
from refimpl.checkpoint._files import save_checkpoint

__all__ = ["AsyncCheckpointer"]

logger = logging.getLogger(__name__)
_LIVE: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()


class _Stager:
    """Copies a state into buffers kept between saves: one per tensor position in the state
    (its path of keys), reused while its shape, dtype and layout stay the same."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.nbytes = 0
        self.cuda_copies = False

    def stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        self.nbytes, self.cuda_copies = 0, False
        seen: dict[tuple[Any, ...], torch.Tensor] = {}  # views of one storage stay one storage
        staged = {k: self._copy(v, (k,), seen) for k, v in state.items()}
        if self.cuda_copies:
            torch.cuda.synchronize()  # non-blocking device-to-host copies: done before return
        return staged

    def _copy(self, value: Any, path: tuple[Any, ...], seen: dict[tuple[Any, ...], Any]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path, seen)
        if isinstance(value, dict):  # OrderedDict too: type(value) keeps it
            out = type(value)()
            for k, v in value.items():
                out[k] = self._copy(v, (*path, k), seen)
            return out
        if type(value) in (list, tuple):
            items = [self._copy(v, (*path, i), seen) for i, v in enumerate(value)]
            return items if type(value) is list else tuple(items)
        return copy.deepcopy(value)  # numbers, strings, sets, torch.Size: small

    def _tensor(self, t: torch.Tensor, path: tuple[Any, ...], seen: dict[Any, Any]) -> Any:
        src = t.detach()
        alias = (
            src.untyped_storage().data_ptr(),
            src.storage_offset(),
            src.shape,
            src.stride(),
            src.dtype,
            src.device,
        )
        if alias in seen:  # tied weights: the same bytes, staged once
            return seen[alias]
        buf = self._buffers.get(path)
        if (
            buf is None
            or (buf.shape, buf.dtype) != (src.shape, src.dtype)
            or buf.stride() != src.stride()
        ):
            pin = self.pinned and src.device.type == "cuda"
            buf = torch.empty_like(src, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        non_blocking = src.device.type == "cuda" and buf.is_pinned()
        buf.copy_(src, non_blocking=non_blocking)
        self.cuda_copies |= non_blocking
        self.nbytes += buf.numel() * buf.element_size()
        seen[alias] = buf
        return buf

    def buffers(self) -> list[torch.Tensor]:
        return list(self._buffers.values())

    def close(self) -> None:
        self._buffers.clear()


class AsyncCheckpointer:
    """`save_checkpoint` in a background thread, one save at a time; the caller blocks only
    while the state is copied.

    ``ckpt_dir`` and ``keep_last`` are `save_checkpoint`'s. ``pinned_memory``: None (the
    default) page-locks the staging buffers where CUDA is available; True insists (and
    raises ``ValueError`` without CUDA); False never pins. ``writer_nice`` (0-19) lowers the
    writing thread's CPU priority; ``writer_cpu_share`` (0 < share <= 1, None: unpaced) paces
    the write to that share of one core, in 1 MiB pieces (chapter 9 measures both: a paced
    write barely slows the steps it overlaps and commits about ``1 / share`` times its CPU
    time later). ``wait_on_sigterm`` (default True; only from the main thread) installs a
    SIGTERM handler that waits for the save in flight, then calls the handler it replaced
    (the default one ends the process, as before).

    Example::

        saver = AsyncCheckpointer("ckpt", keep_last=3)     # on rank 0
        for step in range(1, steps + 1):
            train_one_step()
            if step % 100 == 0:
                saver.save({"model": model.state_dict(), "optim": opt.state_dict()}, step)
        saver.close()  # the last step is committed (or its error raised) here

    `save` raises what `save_checkpoint` refuses (a bad step, an unloadable value) during
    the call, before anything is staged; the previous save's `CheckpointError`, if it failed;
    and ``RuntimeError`` once closed.
    """

    def __init__(
        self,
        ckpt_dir: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        pinned_memory: bool | None = None,
        writer_nice: int = 0,
        writer_cpu_share: float | None = None,
        wait_on_sigterm: bool = True,
    ) -> None:
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ValueError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
        if not (type(writer_nice) is int and 0 <= writer_nice <= 19):
            raise ValueError(f"writer_nice must be an int from 0 to 19, got {writer_nice!r}")
        check_cpu_share(writer_cpu_share)
        if pinned_memory and not torch.cuda.is_available():
            raise ValueError(
                "pinned_memory=True needs CUDA (page-locking is a CUDA driver call); pass "
                "None to pin only where CUDA is available"
            )
        self.ckpt_dir = Path(ckpt_dir)
        self.keep_last = keep_last
        self.writer_nice = writer_nice
        self.writer_cpu_share = writer_cpu_share
        pinned = torch.cuda.is_available() if pinned_memory is None else pinned_memory
        self._stager = _Stager(pinned)
        self._pool = ThreadPoolExecutor(
            1,
            thread_name_prefix="refimpl-async-checkpoint",
            initializer=lower_thread_priority,
            initargs=(writer_nice,),
        )
        self._pending: Future[Path] | None = None
        self._closed = False
        self._previous_handler: Any = None
        if wait_on_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        _LIVE.add(self)

    @property
    def pinned_memory(self) -> bool:
        """Whether the staging buffers are page-locked where the source is on a GPU."""
        return self._stager.pinned

    @property
    def staging_addresses(self) -> tuple[int, ...]:
        """Addresses of the staging buffers in ascending order; the same after every save of
        the same shapes, since the buffers are reused, not reallocated."""
        return tuple(sorted(b.data_ptr() for b in self._stager.buffers()))

    @property
    def staged_bytes(self) -> int:
        """Bytes of tensors the last `save` copied into the staging buffers."""
        return self._stager.nbytes

    def save(self, state: Mapping[str, Any], step: int) -> Path:
        """Wait for the save in flight (raising its error), copy ``state``, start writing it
        as ``ckpt_dir/step_N``; return that path (published once the write commits)."""
        if self._closed:
            raise RuntimeError("this AsyncCheckpointer is closed; create a new one")
        step = as_step(step)
        final = self.ckpt_dir / step_dir_name(step)
        problem = refusal(state)  # a bad value is the caller's error now, not a step later
        if problem:
            raise CheckpointError(final, f"refused before staging anything: {problem}")
        self.wait()
        staged = self._stager.stage(state)
        self._pending = self._pool.submit(self._write, staged, step)
        return final

    def _write(self, staged: dict[str, Any], step: int) -> Path:
        pacer = None if self.writer_cpu_share is None else Pacer(self.writer_cpu_share)
        if pacer is not None:
            pacer.start()
        with paced(None if pacer is None else pacer.wait):
            return save_checkpoint(self.ckpt_dir, staged, step, self.keep_last)

    def done(self) -> bool:
        """Whether no save is in flight (the last one committed or failed)."""
        return self._pending is None or self._pending.done()

    def wait(self) -> Path | None:
        """Wait for the save in flight, if any; return its step directory or raise its error
        (`CheckpointError`: nothing of that step was published; older steps are intact)."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        """Wait for the last save (raising its error), then free the staging buffers and the
        thread, and put back the SIGTERM handler this object replaced."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            self._stager.close()
            _LIVE.discard(self)
            self._restore_handler()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _restore_handler(self) -> None:
        if self._previous_handler is None:
            return
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_handler)
        self._previous_handler = None

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous_handler
        pending = self._pending
        if pending is not None:
            try:
                pending.result()
            except Exception as exc:  # still report it; the process is being stopped anyway
                logger.error("SIGTERM: the checkpoint in flight failed: %s", exc)
            else:
                logger.warning("SIGTERM: waited for the checkpoint in flight to commit")
        self._restore_handler()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGTERM)  # the default action, now that we are done


@atexit.register
def _report_unwaited_at_exit() -> None:
    """By now the worker threads have finished (concurrent.futures joins them first): say so
    when a save that nobody waited for failed, since no caller will ever see its error."""
    for saver in list(_LIVE):
        pending = saver._pending
        if pending is not None and pending.done() and pending.exception() is not None:
            logger.error(
                "AsyncCheckpointer: the last save failed and was never waited for: %s",
                pending.exception(),
            )
