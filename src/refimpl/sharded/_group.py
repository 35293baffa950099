"""The collective side of `refimpl.sharded`: who makes the temporary directory, who commits.

The protocol every sharded save follows, synchronous or in the background:

1. rank 0 removes temporaries of dead writers, creates a fresh hidden temporary directory
   next to the final ``step_N`` and broadcasts its name (a save never writes into an
   existing DCP directory: an old ``.metadata`` beside new shards loads silently wrong);
2. every rank runs ``dcp.save`` into it (DCP's writer fsyncs each file it writes);
3. every rank fsyncs and digests its own ``__RANK_N.distcp`` files; the digests are gathered:
   the gather is the barrier after which rank 0 knows all data is durable;
4. rank 0 digests ``.metadata``, writes ``MANIFEST.json`` and ``COMMITTED``, fsyncs the
   directory, renames it to ``step_N``, fsyncs the parent, prunes old steps; the outcome is
   broadcast, so every rank returns the same path or raises the same error.

A kill at any point before the rename leaves only the hidden temporary, which no loader
reads and a later save on this machine removes once its writer is dead.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from refimpl._publish import publish_dir, temp_dir
from refimpl._step_dirs import prune, step_dir_name
from refimpl.sharded._commit import METADATA, digest_files, own_shards, write_manifest
from refimpl.sharded._errors import ShardedCheckpointError

logger = logging.getLogger("refimpl.sharded")
_INTACT = (
    "Earlier steps (and any earlier copy of this one) are intact and this save was not "
    "published: fix that and save again"
)


class Group:
    """The ranks of one save or load: a process group, or a world of one without one."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.pg = process_group
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.size = dist.get_world_size(process_group) if self.distributed else 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj``, on every rank."""
        if not self.distributed or self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, group_src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed or self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def dcp_kwargs(self) -> dict[str, Any]:
        """The ``process_group`` / ``no_dist`` arguments for ``dcp.save`` and ``dcp.load``."""
        return {"process_group": self.pg, "no_dist": not self.distributed}


@contextmanager
def quiet_no_dist(group: Group) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is the intent."""
    if group.distributed:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def prepare_step(group: Group, root: Path, step: int) -> tuple[Path, Path]:
    """Steps 1 of the protocol: ``(fresh temporary directory, final step directory)``."""
    final = root / step_dir_name(step)
    made: tuple[str, str] | None = None
    if group.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = temp_dir(final, sweep="parent")
            made = ("ok", str(tmp))
        except OSError as exc:
            made = ("error", f"rank 0 cannot create a temporary directory in {root} ({exc})")
    status, value = group.broadcast(made)
    if status != "ok":
        raise ShardedCheckpointError(final, f"{value}. Check the path and its permissions.")
    return Path(value), final


def discard(group: Group, tmp: Path) -> None:
    """After a failed save, rank 0 removes the temporary directory (best effort)."""
    if group.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish_step(
    tmp: Path, final: Path, step: int, reports: list[Any], world: int, keep_last: int | None
) -> str | None:
    """Rank 0's step 4; returns None, or why the step could not be committed."""
    problems = [why for _files, why in reports if why]
    if problems:
        return "; ".join(problems)
    files: dict[str, dict[str, Any]] = {}
    for rank_files, _why in reports:
        files.update(rank_files)
    try:
        files.update(digest_files(tmp, [METADATA]))
        present = {p.name for p in tmp.iterdir()}
        if present != set(files):
            return f"rank 0 found files no rank reported in {tmp}: {sorted(present - set(files))}"
        write_manifest(tmp, step, files, world)
        publish_dir(tmp, final, replace=True)
    except OSError as exc:
        return f"rank 0 could not commit {final} ({exc})"
    if keep_last is not None:
        try:
            prune(final.parent, keep_last, step)
        except OSError as exc:  # the step is committed; only the clean-up failed
            logger.warning("save_sharded: step %d committed, pruning failed (%s)", step, exc)
    return None


def commit_step(group: Group, tmp: Path, final: Path, step: int, keep_last: int | None) -> Path:
    """Steps 3 and 4 of the protocol, on every rank; returns ``final`` once committed."""
    try:
        mine = digest_files(tmp, own_shards(tmp, group.rank))
        report: tuple[dict[str, Any], str | None] = (mine, None)
    except OSError as exc:
        report = ({}, f"rank {group.rank} cannot read back its shards in {tmp} ({exc})")
    reports = group.gather(report)
    outcome = None
    if group.rank == 0:
        outcome = _publish_step(tmp, final, step, reports, group.size, keep_last)
        if outcome is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # ours alone; never the published step
    outcome = group.broadcast(outcome)
    if outcome is not None:
        raise ShardedCheckpointError(final, f"commit of step {step} failed: {outcome}. {_INTACT}")
    return final
