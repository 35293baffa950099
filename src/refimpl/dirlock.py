"""Chapter 5: one writer per checkpoint directory, and a directory that can be written.

Two jobs started in one checkpoint directory (a job submitted twice, an old ``--ckpt-dir``
reused) both run to the end: each re-saves over the other's steps and prunes the other's, and
a restart of one resumes whichever model saved last. Nothing in a step tells them apart, so
the check has to happen at start. `DirLock` holds an exclusive ``flock`` on
``ckpt_dir/.lock`` (`LOCK_FILE`) for as long as the run lives; a second writer is refused at
once with `DirLocked`, naming the directory and the holder (host, pid, torchrun run and
attempt) recorded in the file. The kernel drops a ``flock`` when the last descriptor of it is
closed, which process death does: a killed job (SIGKILL, the OOM killer) never leaves a stale
lock, so there is no lock to delete by hand, and the file itself is never removed (deleting
a lock file lets two processes lock two different files of one name).

Under torchrun a restart is the same job: the agent stops every worker of the failed attempt
(SIGTERM, then SIGKILL 30 s later) before it starts the next, but it waits only a bounded time
for a worker that does not die (one in uninterruptible sleep), so the new rank 0 can start
while the old one still holds the lock. When the holder is an earlier attempt of the same
torchrun job (same ``TORCHELASTIC_RUN_ID``; for the default id ``none``, also the same agent),
`DirLock` waits up to ``restart_wait_s`` for it to go, then refuses. A forked child (a
DataLoader worker) would inherit the descriptor and keep the lock after its parent died; the
descriptor is closed in every child at fork, so only the process that locked holds it.

A holder on this machine that is being torn down (SIGKILLed in uninterruptible sleep, or
freeing a large address space in ``do_exit``, which comes before its descriptors are closed)
is waited for the same way, whatever job it was: a job restarted right after a kill is not
refused by the corpse of its predecessor.

The lock also checks that the directory can be written (`check_writable`: a probe file
created, written and removed), so a read-only mount is refused before the first
step is trained, not at the first save of every restart.

Hold it for the whole run, around everything that saves (`refimpl.checkpoint.save_checkpoint`,
`refimpl.sharded.save_sharded`, `refimpl.sharded.AsyncSaver`) and the load that resumes::

    with DirLock("ckpt"):          # collective under a process group: call it on every rank
        found = load_latest("ckpt")
        ...train, save_checkpoint("ckpt", state, step) on rank 0...

``python -m refimpl.train`` does exactly this. `LOCK_FILE` is not a step: every listing of
steps (`refimpl.checkpoint.list_checkpoints`, the sharded loaders, pruning, ``python -m
refimpl.checkpoint list/verify``) passes over it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

import torch.distributed as dist

from refimpl._group_timeout import group_timeout
from refimpl._system import proc
from refimpl.atomic import temp_path
from refimpl.checkpoint import CheckpointError

__all__ = ["LOCK_FILE", "DirLock", "DirLocked", "Holder", "check_writable"]

LOCK_FILE = ".lock"
"""The lock's file in the checkpoint directory; hidden, never a step, never removed."""

_HOLDER_BYTES = 4096  # what a reader reads of the holder record: the file is untrusted
_POLL_S = 0.2
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}
logger = logging.getLogger(__name__)

_held: set[int] = set()  # descriptors this process locked: closed in forked children


def _close_in_child() -> None:
    """After a fork, in the child: drop the inherited lock descriptors (never LOCK_UN, which
    would unlock the parent's)."""
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


@dataclass(frozen=True)
class Holder:
    """Who locked a checkpoint directory: written into `LOCK_FILE` by the holder.

    ``run_id`` and ``attempt`` are torchrun's ``TORCHELASTIC_RUN_ID`` and
    ``TORCHELASTIC_RESTART_COUNT`` ("" and 0 outside torchrun); ``agent`` is the parent's pid
    (torchrun's agent, for a worker)."""

    host: str
    pid: int
    run_id: str = ""
    attempt: int = 0
    agent: int = 0

    @classmethod
    def this_process(cls) -> Holder:
        """The holder record of the calling process."""
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""),
            attempt=int(attempt) if attempt.isdigit() else 0,
            agent=os.getppid(),
        )

    def describe(self) -> str:
        """``host H, pid P`` and, under torchrun, the run and attempt: for error messages."""
        job = f", torchrun run {self.run_id} attempt {self.attempt}" if self.run_id else ""
        return f"host {self.host}, pid {self.pid}{job}"

    def earlier_attempt_of(self, other: Holder) -> bool:
        """Whether this holder is an earlier attempt of ``other``'s torchrun job (a restart's
        predecessor, which its agent is stopping), not another job.

        A job runs one rank 0 at a time, so another holder with the same run id is an
        earlier one (restart counts are per agent: after an elastic membership change the
        new rank 0 may count lower). torchrun's default id ``none`` is shared by every job
        started without ``--rdzv-id``: there, the same agent and a lower count are required."""
        if not self.run_id or self.run_id != other.run_id:
            return False
        if self.run_id == "none":
            same_agent = (self.host, self.agent) == (other.host, other.agent)
            return same_agent and self.attempt < other.attempt
        return True


_PF_EXITING = 0x4  # linux/sched.h: the task is in do_exit, its descriptors not yet closed
_SIGKILL_BIT = 1 << (9 - 1)


def _exiting(stat: str, status: str) -> bool:
    """Whether ``/proc/PID/stat`` and ``/proc/PID/status`` (their text) describe a process
    that is on its way out: a zombie, in ``do_exit`` (``PF_EXITING``), or with SIGKILL
    pending (killed while in uninterruptible sleep, a long fsync say)."""
    fields = proc.stat_fields(stat)
    if len(fields) < 7:
        return False
    if fields[0] in ("Z", "X", "x") or int(fields[6]) & _PF_EXITING:
        return True
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in ("SigPnd", "ShdPnd") and int(value.strip() or "0", 16) & _SIGKILL_BIT:
            return True
    return False


def _dying(holder: Holder) -> bool:
    """Whether the holder runs on this machine and is being torn down: the kernel drops its
    lock within moments (once it closes its descriptors), so it is waited for, not refused."""
    if holder.host != socket.gethostname():
        return False
    try:
        return _exiting(proc.read(holder.pid, "stat"), proc.read(holder.pid, "status"))
    except (OSError, ValueError):
        return False


def _read_holder(fd: int) -> Holder | None:
    """The record in the lock file, or None (not written yet, or not ours)."""
    try:
        raw = os.pread(fd, _HOLDER_BYTES, 0)
        data = json.loads(raw)
        return Holder(
            host=str(data["host"]),
            pid=int(data["pid"]),
            run_id=str(data.get("run_id", "")),
            attempt=int(data.get("attempt", 0)),
            agent=int(data.get("agent", 0)),
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


@dataclass(frozen=True)
class _Refused:
    """Rank 0's answer to the other ranks when it could not lock (or write) the directory."""

    locked: bool  # DirLocked (else: the directory cannot be written)
    reason: str
    holder: Holder | None


class DirLocked(CheckpointError):
    """Another process holds the checkpoint directory's lock. ``holder`` names it (None when
    its record cannot be read)."""

    def __init__(self, path: str | os.PathLike[str], message: str, holder: Holder | None) -> None:
        super().__init__(path, message)
        self.holder = holder


def check_writable(ckpt_dir: str | os.PathLike[str]) -> None:
    """Create ``ckpt_dir`` if needed and prove a file can be written in it (created, written,
    removed); raise `CheckpointError` naming the directory, the error and the fix if not.

    A hidden temporary name of `refimpl.atomic.temp_path`'s form is used, so a probe left by a
    process killed in between is swept like any dead writer's temporary file."""
    root = Path(ckpt_dir)
    probe = temp_path(root / ".write-probe")
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink()
        raise CheckpointError(
            root,
            f"cannot be written ({exc.strerror or exc}): every save would fail. Make it "
            "writable (permissions, a read-only mount, a full disk), or pass another "
            "checkpoint directory",
        ) from exc


class DirLock:
    """Exclusive use of ``ckpt_dir`` by one run, from `acquire` (or ``with``) to `release`.

    `acquire` creates the directory, checks it can be written (`check_writable`) and takes the
    lock; it raises `DirLocked` naming the holder when another process has it, or
    `refimpl.checkpoint.CheckpointError` when the directory cannot be written. An earlier
    torchrun attempt of the same job is waited for, up to ``restart_wait_s`` seconds (see the
    module's text; under a process group at most half its timeout, which the other ranks
    spend waiting for rank 0's answer). On a filesystem without ``flock`` (some network
    mounts) it logs a warning and runs without the lock.

    Collective when a process group is initialised (``collective=True``): rank 0 locks, and
    every rank raises the same error, naming the rank, if it could not; call it on every rank.
    Otherwise (or with ``collective=False``) it locks in the calling process. Released by
    `release`, at the end of the ``with`` block, or by the kernel when the process dies.
    """

    def __init__(
        self,
        ckpt_dir: str | os.PathLike[str],
        *,
        restart_wait_s: float = 90.0,
        collective: bool = True,
    ) -> None:
        self.path = Path(ckpt_dir)
        self.restart_wait_s = restart_wait_s
        self.collective = collective
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this process holds the lock now."""
        return self._fd is not None

    def acquire(self) -> None:
        """Check the directory and take the lock (rank 0 of a group); raise if either fails."""
        grouped = self.collective and dist.is_available() and dist.is_initialized()
        if not grouped:
            self._acquire_here(self.restart_wait_s)
            return
        rank = dist.get_rank()
        outcome: list[_Refused | None] = [None]
        if rank == 0:
            # The other ranks wait in the broadcast below: rank 0 must answer within its timeout.
            timeout = group_timeout()
            wait = self.restart_wait_s if timeout is None else timeout.total_seconds() / 2
            try:
                self._acquire_here(min(wait, self.restart_wait_s))
            except DirLocked as exc:
                outcome[0] = _Refused(True, exc.reason, exc.holder)
            except CheckpointError as exc:
                outcome[0] = _Refused(False, exc.reason, None)
        dist.broadcast_object_list(outcome, src=0)
        refused = outcome[0]
        if refused is None:
            return
        if refused.locked:
            raise DirLocked(self.path, f"rank {rank}: {refused.reason}", refused.holder)
        raise CheckpointError(self.path, f"rank {rank}: {refused.reason}")

    def _acquire_here(self, wait_s: float) -> None:
        if self._fd is not None:
            raise RuntimeError(f"{self.path}: this DirLock is already held")
        check_writable(self.path)
        fd = self._open()
        me = Holder.this_process()
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _read_holder(fd)
                expected = holder is not None and (holder.earlier_attempt_of(me) or _dying(holder))
                if expected and time.monotonic() < deadline:
                    time.sleep(_POLL_S)
                    continue
                os.close(fd)
                raise self._refusal(holder, me, wait_s) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno not in _UNSUPPORTED:
                    raise CheckpointError(self.path / LOCK_FILE, f"cannot lock ({exc})") from exc
                logger.warning(
                    "%s: this filesystem cannot flock (%s): running without the one-writer lock",
                    self.path,
                    exc,
                )
                return
        _held.add(fd)
        self._fd = fd
        with contextlib.suppress(OSError):  # a lock file we may only read: lock, no record
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(asdict(me)).encode(), 0)

    def _open(self) -> int:
        path = self.path / LOCK_FILE
        flags = os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            try:
                return os.open(path, os.O_RDWR | flags, 0o644)
            except PermissionError:  # another user's lock file: flock works read-only too
                return os.open(path, os.O_RDONLY | flags)
        except OSError as exc:
            raise CheckpointError(
                path, f"cannot open the directory's lock file ({exc.strerror or exc})"
            ) from exc

    def _refusal(self, holder: Holder | None, me: Holder, wait_s: float) -> DirLocked:
        who = holder.describe() if holder is not None else "a process whose record is unreadable"
        waited = ""
        if holder is not None and holder.earlier_attempt_of(me):
            waited = f" (an earlier attempt of this job; waited {wait_s:g} s for it to exit)"
        elif holder is not None and _dying(holder):
            waited = f" (being killed; waited {wait_s:g} s for it to exit)"
        return DirLocked(
            self.path,
            f"is in use by another run: {who} holds {LOCK_FILE}{waited}. Two runs saving into "
            "one directory overwrite and prune each other's steps. Wait for that run to end "
            "(or stop it), or pass another checkpoint directory",
            holder,
        )

    def release(self) -> None:
        """Give the lock up (nothing happens when this process does not hold it)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _held.discard(fd)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # the record names a live holder only
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
