"""The public entry points of `refimpl.sharded`: save, load, verify and consolidate a step.

The package docstring (`refimpl.sharded`) says what each adds to DCP and why.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from refimpl._manifest import as_step
from refimpl.atomic import atomic_save
from refimpl.sharded._async import AsyncSaver, default_saver
from refimpl.sharded._async_handle import AsyncSaveHandle
from refimpl.sharded._commit import verify_step
from refimpl.sharded._digested_writer import DigestedWriter
from refimpl.sharded._errors import ShardedCheckpointError, dcp_errors
from refimpl.sharded._export import check_output_file, read_full
from refimpl.sharded._group import Group, commit_step, discard, prepare_step, quiet_no_dist
from refimpl.sharded._load import load_step
from refimpl.sharded._paths import Choice, choose_step
from refimpl.sharded._state import check_mapping, pack_checked

logger = logging.getLogger(__name__)


def _check_keep_last(keep_last: int | None) -> None:
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        raise ValueError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")


def save_sharded(
    ckpt_dir: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    *,
    keep_last: int | None = 3,
    process_group: dist.ProcessGroup | None = None,
    state: Mapping[str, Any] | None = None,
) -> Path:
    """Save ``model``, ``optimizer`` and ``state`` as the committed step ``ckpt_dir/step_N``.

    Collective: call it on every rank. The state comes from ``get_state_dict(model,
    optimizer)`` (FSDP2 / DTensor shards stay sharded, each rank writes its own) and is
    written by ``dcp.save({"model": ..., "optim": ...})`` into a fresh temporary directory,
    which rank 0 commits (manifest, marker, fsync, rename) only after every rank's files are
    on disk; then the ``keep_last`` newest committed steps up to this one are kept. Any
    failure on any rank (a full disk, a rank that died: the others get an error within the
    process group's timeout, not a hang) raises `ShardedCheckpointError` on every rank that
    is still alive, naming the failed ranks; nothing is published and earlier steps are
    untouched. Re-saving an existing step swaps the new copy in atomically. Returns the step.

    ``state`` maps names to everything else the run needs: objects with ``state_dict()`` /
    ``load_state_dict()`` (an LR scheduler, `refimpl.data.ResumableSampler`) and plain values
    (a step counter, a config dict), serialised now and saved in the same commit, under the
    same manifest and digests. An entry is shared (equal on every rank: checked, saved once)
    unless wrapped in `PerRank` (saved by each rank; see `load_sharded` for the rule at
    another world size). An entry that would not load weights-only is refused (``TypeError``)
    and a shared one that differs between ranks too (``ValueError``), on every rank, before
    anything is written.

    Example::

        state = {"sched": scheduler, "rng": PerRank(rng), "epoch": epoch}
        path = save_sharded("ckpt", model, optimizer, 200, state=state)  # ckpt/step_00000200
    """
    step = as_step(step)
    _check_keep_last(keep_last)
    group = Group(process_group)
    packed = pack_checked(group, state)  # refused on every rank before touching the disk
    tmp, final = prepare_step(group, Path(ckpt_dir), step)
    what = f"save of step {step}"
    with dcp_errors(final, what, group.rank, on_error=lambda: discard(group, tmp)):
        msd, osd = get_state_dict(model, optimizer)
        with quiet_no_dist(group):
            dcp_save(
                {"model": msd, "optim": osd, **packed},
                storage_writer=DigestedWriter(tmp, sync_files=True, overwrite=False),
                **group.dcp_kwargs(),
            )
    return commit_step(group, tmp, final, step, keep_last)


def async_save_sharded(
    ckpt_dir: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    *,
    keep_last: int | None = 3,
    process_group: dist.ProcessGroup | None = None,
    state: Mapping[str, Any] | None = None,
    saver: AsyncSaver | None = None,
) -> AsyncSaveHandle:
    """Start saving like `save_sharded`, but return once the state is copied; commit later.

    Collective. It first waits for this process's previous async save (never two in flight;
    a failure of that one is raised here), copies this rank's state into staging buffers
    that are allocated on the first save and reused by every later one, and hands the rest
    to ``dcp.async_save`` on a dedicated gloo process group: writing, then the same commit
    as `save_sharded`, in a background thread, while training goes on. The saved values are
    those at the time of the call, ``state`` included (serialised during the call).
    ``saver`` defaults to one `AsyncSaver` per process (created on the first call, on every
    rank; ``process_group`` must then be None or span the same ranks as the saver's). Call
    ``.result()`` on the returned `AsyncSaveHandle` (or `AsyncSaver.wait`) before exiting.

    Example::

        handle = async_save_sharded("ckpt", model, optimizer, step, state={"sched": sched})
        ...                          # keep training
        handle.result()              # -> ckpt/step_N, committed (handle.path names it)
    """
    step = as_step(step)
    _check_keep_last(keep_last)
    return (saver or default_saver()).save(
        ckpt_dir,
        model,
        optimizer,
        step,
        keep_last=keep_last,
        process_group=process_group,
        state=state,
    )


def verify_sharded(step_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Check one sharded step without letting DCP unpickle anything; return its manifest.

    Raises `refimpl.checkpoint.CheckpointError` naming the first problem: no commit marker,
    a bad manifest, files that differ from it (missing, extra, truncated, changed bytes), or
    a ``.metadata`` that names anything outside the allowlist of DCP's own metadata classes
    or points an item outside the checkpoint's shard files.
    """
    return verify_step(Path(step_dir))


def _log_skip(step_dir: Path, reason: str) -> None:
    logger.warning("load_sharded: skipped %s (%s); trying an older step", step_dir.name, reason)


def load_sharded(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    on_skip: Callable[[Path, str], None] | None = None,
    state: Mapping[str, Any] | None = None,
    exclude: Sequence[str | re.Pattern[str]] = (),
) -> int | None:
    r"""Load the newest verified step of ``path`` into ``model``, ``optimizer`` and ``state``.

    Collective. ``path`` is a checkpoint directory (steps are tried newest first; each one
    that is incomplete, corrupt or hostile is skipped and reported through ``on_skip(step_dir,
    reason)``, by default a warning logged on rank 0) or one ``step_N`` directory (loaded or
    refused, no fallback). Rank 0 verifies the manifest and every digest; each rank checks
    ``.metadata`` (the verified bytes) with the allowlist unpickler, and digests every shard
    file it is about to read, from the open file DCP then reads, unless that file is, on
    rank 0's machine, the very file rank 0 just hashed, unchanged since
    (`refimpl.sharded._seen`): a file that changed after rank 0's check, or differs on that
    rank's node, skips the step before anything is loaded. ``dcp.load`` loads non-tensor
    items weights-only (one that is not is refused, and the next older step tried, as is a
    step whose item is another kind than the model's: a non-tensor item for a weight), each
    tensor from only the bytes of the rows this rank holds (`refimpl.sharded._ranges`);
    ``set_state_dict`` puts the result in place. The world size may differ from the one that
    saved: DCP reshards.

    Returns the step loaded, or None for an existing checkpoint directory with no step yet
    (a fresh start). Everything else raises `ShardedCheckpointError` saying what was found
    and what to pass: a path that does not exist, a file, a folder whose subfolder holds the
    steps, a folder of `refimpl.checkpoint` file steps, committed steps none of which loads,
    a step whose model keys differ from the model's (naming them) or that does not fit it.

    ``state``: the mapping given to `save_sharded`, or a subset of it (other saved entries
    are left alone). Stateful objects get ``load_state_dict(saved)``; plain values are put
    back into the mapping (``state[name] = saved``). `PerRank` entries are restored on the
    same rank when the world size equals the saving one (the manifest's ``world_size``); at
    another world size they are left as they are, their ``restored`` is False and a warning
    names them. A name the step does not have, or has as the other kind, raises. The entries
    are restored before the model, on every rank or on none: when a ``load_state_dict``
    raises on any rank, every rank puts back the entries it had set and raises the same
    `ShardedCheckpointError` naming the rank and the entry, the model and optimizer untouched.

    Fine-tuning from a step: without ``optimizer`` and ``state`` only the model's weights
    are read (the step's optimizer and state entries are not planned, so DCP reads none of
    their bytes); ``exclude`` leaves model entries out of the load: a str names a key or a
    module prefix (``"head"``: ``head.weight`` and ``head.bias``), a ``re.compile``\ d
    pattern fullmatches keys. Excluded entries keep their current values (and, with an
    optimizer, their optimizer state); they are not compared with the step, so a new output
    head of another shape, or one the step does not have, loads the rest. An entry that
    names no key of the model raises ``ValueError``. torchtitan's ``exclude_from_loading``
    of the optimizer or a scheduler is here not passing them.

    Example::

        state = {"sched": scheduler, "rng": PerRank(rng), "epoch": 0}
        step = load_sharded("ckpt", model, optimizer, state=state)
        start = 0 if step is None else step + 1        # state["epoch"] is the saved one
        load_sharded("ckpt/step_00000200", new_vocab_model, exclude=["output"])  # fine-tune
    """
    if isinstance(exclude, (str, re.Pattern)):
        raise TypeError(f"exclude takes a list of keys or patterns, not one: [{exclude!r}]")
    if state:
        check_mapping(state)
    group = Group(process_group)
    report = on_skip or (_log_skip if group.rank == 0 else lambda _d, _w: None)
    below: int | None = None
    while True:
        chosen: Choice = group.broadcast(
            choose_step(Path(path), below) if group.rank == 0 else None
        )
        for skipped_dir, why in chosen.skipped:
            report(Path(skipped_dir), why)
        if chosen.fatal is not None:
            raise ShardedCheckpointError(path, chosen.fatal)
        if chosen.step_dir is None or chosen.step is None:
            logger.info("load_sharded: no step in %s yet: starting fresh", path)
            return None
        try:
            load_step(
                group,
                Path(chosen.step_dir),
                model,
                optimizer,
                expected=chosen.expected,
                saved_world=chosen.saved_world,
                state=state,
                exclude=exclude,
                seen=chosen.seen,
            )
            return chosen.step
        except ShardedCheckpointError as err:
            if chosen.single or not err.unsafe:
                raise
            report(Path(chosen.step_dir), str(err))
            below = chosen.step


def consolidate(
    step_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    key: str = "model",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the full (unsharded) ``key`` of a sharded step to one ``torch.save`` file.

    For inference or export, in one process, no process group needed. The step is verified
    first (`verify_sharded`); DCP then rebuilds every tensor whole (what
    ``format_utils.dcp_to_torch_save`` does, but with non-tensor items loaded weights-only
    and only ``key`` read); floating-point tensors are cast to ``dtype`` if given; the file
    is written with `refimpl.atomic.atomic_save`, so a crash leaves the old file or the new
    one. The result loads with ``refimpl.checkpoint.safe_load`` and, for ``key="model"``,
    ``model.load_state_dict`` on an unwrapped model. Returns ``out_path``. `export_hf`
    writes the model as Hugging Face safetensors instead. An ``out_path`` inside the step, or
    inside any other step directory, raises ``ValueError`` before anything is read (a step
    must hold only what its manifest lists).
    """
    check_output_file(Path(step_dir), Path(out_path))
    value = read_full(Path(step_dir), key)
    if dtype is not None:
        value = {
            k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in value.items()
        }
    return atomic_save(value, out_path)
