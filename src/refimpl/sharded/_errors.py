"""Errors of `refimpl.sharded`: `ShardedCheckpointError`, and what DCP's failures become.

DCP runs each rank's part of a save or load inside ``except BaseException`` and re-raises every
rank's failure as one ``CheckpointException``, a ``BaseException`` in torch 2.13 that ``except
Exception`` misses. `dcp_errors` turns it into a `ShardedCheckpointError` naming the ranks, the
real cause (the disk error behind torch's ``unexpected pos``, a peer that died) and what to do.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from refimpl._write_errors import DISK_FULL, oserror_advice, root_oserror
from refimpl.checkpoint import CheckpointError
from refimpl.sharded._read import ShardMismatch, UnsafeItem

_PEER_GONE = ("Connection closed", "Connection reset", "timed out", "Timeout", "aborted")


class ShardedCheckpointError(CheckpointError):
    """A sharded save or load failed. ``path`` names the step or file; ``rank`` the rank that
    failed first (None when it is not known); ``failures`` maps each failed rank to its error.

    A `refimpl.checkpoint.CheckpointError`, hence an ``Exception``, unlike the
    ``torch.distributed.checkpoint.api.CheckpointException`` (a ``BaseException`` in torch
    2.13) it replaces, so a trainer's ``except Exception`` catches it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        message: str,
        *,
        rank: int | None = None,
        failures: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(path, message)
        self.rank = rank
        self.failures = dict(failures or {})
        # True when the step was refused before anything was loaded (hostile, or its files
        # differ from the verified manifest on some rank): load_sharded then falls back.
        self.unsafe = False


SAVE_ADVICE = (
    "Earlier steps are intact and this one was never published; fix the cause on the rank "
    "named (its own error says more: disk space, permissions, a crash) and save again"
)
LOAD_ADVICE = "Check that the model and optimizer are built as they were when this was saved"
_UNSAFE_ADVICE = "Refused as unsafe: restore the step from a copy you trust, never load it plainly"
_MISMATCH_ADVICE = (
    "Nothing was loaded: the file changed after rank 0 verified it, or that rank's node sees "
    "another copy (node-local disk, a cache); make every node see the same step"
)


def dcp_failure(
    exc: BaseException, path: Path, what: str, rank: int, advice: str = SAVE_ADVICE
) -> BaseException:
    """What to raise instead of ``exc``, an error out of ``dcp.save`` / ``dcp.load``.

    DCP runs each rank's part inside ``except BaseException`` and re-raises every rank's
    failure as one ``CheckpointException``, which ``except Exception`` does not catch. It
    becomes a `ShardedCheckpointError` naming the ranks and ending with ``advice``; a Ctrl-C
    (or SystemExit) of this rank stays what it was. A collective that failed because a peer
    died is named as such.
    """
    if isinstance(exc, CheckpointException):
        for failed_rank, (inner, _trace) in exc.failures.items():
            if failed_rank == rank and isinstance(inner, (KeyboardInterrupt, SystemExit)):
                return inner
        failures = {r: _describe(e, path) for r, (e, _t) in sorted(exc.failures.items())}
        detail = "; ".join(f"rank {r}: {text}" for r, text in failures.items())
        errors = [e for e, _t in exc.failures.values()]
        hostile = any(isinstance(e, UnsafeItem) for e in errors)
        mismatch = any(isinstance(e, ShardMismatch) for e in errors)
        message = f"{what} failed on rank(s) {sorted(failures)} ({detail}). "
        disk_advice = next((oserror_advice(d, path) for d in map(root_oserror, errors) if d), None)
        message += _UNSAFE_ADVICE if hostile else _MISMATCH_ADVICE if mismatch else ""
        message += "" if hostile or mismatch else (disk_advice or advice)
        err = ShardedCheckpointError(path, message, rank=min(failures), failures=failures)
        err.unsafe = hostile or mismatch
        return err
    if isinstance(exc, (KeyboardInterrupt, SystemExit)) or not isinstance(exc, Exception):
        return exc
    text = _describe(exc, path)
    peer = any(s in text for s in _PEER_GONE)
    hint = " (another rank died or stopped answering: see its error)" if peer else ""
    message = f"{what} failed on rank {rank}{hint}: {text}. {advice}"
    return ShardedCheckpointError(path, message, rank=rank, failures={rank: text})


def _describe(exc: BaseException, path: Path) -> str:
    """``exc`` as text, naming the disk error behind it: torch.save's zip writer reports a
    write that failed with ENOSPC as ``RuntimeError: unexpected pos 704 vs 598``, the
    ``OSError`` being only its ``__context__`` (torch 2.13, caffe2 inline_container.cc)."""
    text = f"{type(exc).__name__}: {exc}"
    disk = root_oserror(exc)
    if disk is None:
        return text
    free = _free(path) if disk.errno in DISK_FULL else ""
    if disk is exc:
        return text + free
    return f"{type(disk).__name__}: {disk}{free} (torch reported it as {text})"


def _free(path: Path) -> str:
    """How much room is left where ``path`` lives, as a clause; empty if unknown."""
    for where in (path, *path.parents):
        try:
            st = os.statvfs(where)
        except OSError:
            continue
        return f"; {st.f_bavail * st.f_frsize} bytes free on the filesystem of {where}"
    return ""


@contextmanager
def dcp_errors(
    path: Path,
    what: str,
    rank: int,
    advice: str = SAVE_ADVICE,
    on_error: Callable[[], None] | None = None,
) -> Iterator[None]:
    """Run DCP work; on any failure call ``on_error`` (a save's clean-up), then raise what
    `dcp_failure` makes of the error, chained to it (a Ctrl-C stays a Ctrl-C)."""
    try:
        yield
    except BaseException as exc:
        failure = dcp_failure(exc, path, what, rank, advice)  # free space before the clean-up
        if on_error is not None:
            on_error()
        if failure is exc:
            raise
        raise failure from exc
