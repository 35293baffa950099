"""Loading one verified step: the part of `refimpl.sharded.load_sharded` after rank 0 chose it.

Every rank checks ``.metadata`` (the bytes rank 0 verified) and the model's keys; DCP reads the
``state=`` entries' bytes first, weights-only through a `VerifyingReader`; they are decoded
and put in place on every rank or on none (a ``load_state_dict`` that raises on one rank puts
every rank's entries back and raises the same error everywhere); then DCP reads the model and
optimizer in place, and a failure there puts the ``state=`` entries back too.
"""

from __future__ import annotations

import logging
import pickle
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from refimpl.sharded._commit import METADATA, Expected
from refimpl.sharded._dcp_metadata import UnsafeMetadata, check_metadata
from refimpl.sharded._errors import LOAD_ADVICE, ShardedCheckpointError, dcp_errors
from refimpl.sharded._group import Group, quiet_no_dist
from refimpl.sharded._read import (
    VerifyingReader,
    WeightsOnlyLoadPlanner,
    _few,
    check_keys,
    check_kinds,
)
from refimpl.sharded._seen import Seen
from refimpl.sharded._state import Applied, apply, decode, names_in, targets

logger = logging.getLogger("refimpl.sharded")


def _refuse(group: Group, path: Path, mine: str | None, prefix: str, unsafe: bool) -> None:
    """Raise on every rank if any rank has a reason (one collective)."""
    refused = [why for why in group.gather(mine) if why]
    if refused:
        err = ShardedCheckpointError(path, f"{prefix}: {'; '.join(refused)}", rank=group.rank)
        err.unsafe = unsafe
        raise err


def excluded_names(
    model_state: Mapping[str, Any], exclude: Sequence[str | re.Pattern[str]]
) -> set[str]:
    """The model keys ``exclude`` names: a str is a key or a module prefix (``"head"`` names
    ``head.weight`` and ``head.bias``), a compiled pattern fullmatches keys. An entry that
    names no key raises ``ValueError``: a typo must not load what it meant to keep."""
    names: set[str] = set()
    for entry in exclude:
        if isinstance(entry, re.Pattern):
            hits = {k for k in model_state if entry.fullmatch(k)}
        else:
            hits = {k for k in model_state if k == entry or k.startswith(entry + ".")}
        if not hits:
            raise ValueError(
                f"exclude entry {entry!r} names no key of the model (its keys are "
                f"{_few(sorted(model_state))}); pass a key, a module prefix or a re.compile()d "
                "pattern"
            )
        names |= hits
    return names


def _without(target: dict[str, Any], excluded: set[str]) -> dict[str, Any]:
    """``target`` minus the excluded model entries and their optimizer state (shallow: the
    tensors are the same objects, so DCP's in-place reads land in ``target``)."""
    if not excluded:
        return target
    planned = dict(target)
    planned["model"] = {k: v for k, v in target["model"].items() if k not in excluded}
    if "optim" in target:
        optim = target["optim"]
        state = {k: v for k, v in optim["state"].items() if k not in excluded}
        planned["optim"] = {**optim, "state": state}
    return planned


def _merge(target: dict[str, Any], planned: dict[str, Any]) -> None:
    """Put what DCP loaded into ``planned`` (non-tensor items are replaced, not copied into)
    back into ``target``, whose excluded entries keep their current values."""
    if planned is target:
        return
    target["model"] = {**target["model"], **planned["model"]}
    if "optim" in target:
        state = {**target["optim"]["state"], **planned["optim"]["state"]}
        target["optim"] = {**planned["optim"], "state": state}
    for key, value in planned.items():
        if key not in ("model", "optim"):
            target[key] = value


def _load_into(
    group: Group,
    step_dir: Path,
    expected: Expected,
    metadata: Metadata,
    seen: Mapping[str, Seen] | None,
    planned: dict[str, Any],
) -> VerifyingReader:
    """``dcp.load`` of ``planned`` (in place) through a `VerifyingReader`; returns it."""
    reader = VerifyingReader(step_dir, expected, metadata, seen)
    what = f"load of {step_dir.name}"
    with dcp_errors(step_dir, what, group.rank, LOAD_ADVICE), quiet_no_dist(group):
        dcp_load(
            planned, storage_reader=reader, planner=WeightsOnlyLoadPlanner(), **group.dcp_kwargs()
        )
    return reader


def _failed(group: Group, mine: str | None) -> list[tuple[int, str]]:
    """Every rank's ``(rank, why)`` that is not None (one collective)."""
    return [(rank, why) for rank, why in enumerate(group.gather(mine)) if why]


def _apply_agreed(
    group: Group,
    step_dir: Path,
    state: Mapping[str, Any],
    values: Mapping[str, Any],
    skipped: list[str],
    applied: Applied,
) -> None:
    """Put the ``state=`` values in place on every rank, or on none: when any rank's
    ``load_state_dict`` raises, every rank puts its entries back and raises one error."""
    try:
        apply(state, values, skipped, applied)
        mine = None
    except Exception as exc:
        mine = str(exc)
    except BaseException:
        applied.undo()
        raise
    failed = _failed(group, mine)
    if not failed:
        return
    refused = applied.undo()
    detail = "; ".join(f"rank {rank}: {why}" for rank, why in failed)
    message = (
        f"state= could not be restored ({detail}). Nothing was loaded: every rank put back the "
        "state= entries it had set, and the model and optimizer were not touched. Check that "
        "the objects in state= are built as they were when this step was saved"
    )
    if refused:
        message += f" (on rank {group.rank}, {', '.join(refused)} could not be put back)"
    raise ShardedCheckpointError(step_dir, message, rank=failed[0][0], failures=dict(failed))


def _set_agreed(
    group: Group,
    step_dir: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    target: dict[str, Any],
) -> None:
    """``set_state_dict`` on every rank; when it raises on any, every rank raises."""
    try:
        with dcp_errors(step_dir, f"load of {step_dir.name}", group.rank, LOAD_ADVICE):
            if optimizer is None:
                set_model_state_dict(model, target["model"])
            else:
                set_state_dict(
                    model,
                    optimizer,
                    model_state_dict=target["model"],
                    optim_state_dict=target["optim"],
                )
        mine = None
    except ShardedCheckpointError as exc:
        mine = exc.reason
    failed = _failed(group, mine)
    if failed:
        detail = "; ".join(why for _rank, why in failed)
        raise ShardedCheckpointError(
            step_dir,
            f"{detail}. The model and optimizer may hold part of {step_dir.name} on every "
            "rank (any state= entries were put back): rebuild them before using them or "
            "loading again",
            rank=failed[0][0],
            failures=dict(failed),
        )


def load_step(
    group: Group,
    step_dir: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    expected: Expected,
    saved_world: int,
    state: Mapping[str, Any] | None = None,
    exclude: Sequence[str | re.Pattern[str]] = (),
    seen: Mapping[str, Seen] | None = None,
) -> None:
    """Load ``step_dir`` into ``model``, ``optimizer`` and ``state``. A step refused before
    anything was loaded raises `ShardedCheckpointError` with ``unsafe`` set (the caller falls
    back); a step that does not fit raises one without. ``expected``: the verified
    manifest's {file: (bytes, digest)}; ``saved_world``: the world size that saved the step
    (0 when unknown). ``exclude``d model entries (and their optimizer state) are not planned,
    so DCP never reads them, and keep their values. ``seen``: rank 0's records of the files
    it hashed (`refimpl.sharded._seen`).

    The ``state=`` entries are read (a ``dcp.load`` of their bytes only), decoded and put in
    place first, on every rank or on none (`_apply_agreed`); then DCP reads the model and
    optimizer, in place. A failure there puts the ``state=`` entries back on every rank."""
    sizes = {name: size for name, (size, _d) in expected.items() if name != METADATA}
    metadata = None
    try:
        metadata = check_metadata(step_dir / METADATA, sizes, expect=expected.get(METADATA))
        mine = None
    except (UnsafeMetadata, OSError) as exc:
        mine = f"rank {group.rank}: {exc}"
    _refuse(group, step_dir / METADATA, mine, "refused before DCP opened it", unsafe=True)
    assert metadata is not None  # every rank raised otherwise
    with dcp_errors(step_dir, f"load of {step_dir.name}", group.rank, LOAD_ADVICE):
        if optimizer is None:
            target: dict[str, Any] = {"model": get_model_state_dict(model)}
        else:
            msd, osd = get_state_dict(model, optimizer)
            target = {"model": msd, "optim": osd}
    excluded = excluded_names(target["model"], exclude)  # raises the same on every rank
    misfit = check_keys(metadata, target["model"], excluded)  # the same on every rank: all raise
    if misfit is not None:
        raise ShardedCheckpointError(step_dir, f"{misfit}. {LOAD_ADVICE}", rank=group.rank)
    planned = _without(target, excluded)
    wanted: dict[str, Any] = {}
    skipped: list[str] = []
    applied = Applied(state or {})
    if state:
        same_world = saved_world in (0, group.size)
        saved = set(metadata.state_dict_metadata)
        wanted, missing, skipped = targets(state, group.rank, same_world, saved)
        shared_names, rank_names, _ranks = names_in(sorted(saved))
        mine = (
            f"rank {group.rank}: no entry {', '.join(missing)} (the step has shared "
            f"{shared_names} and per-rank {rank_names})"
            if missing
            else None
        )
        _refuse(
            group,
            step_dir,
            mine,
            "state= does not fit this step: pass the names (and kinds) it was saved with",
            unsafe=False,
        )
    kinds = check_kinds(metadata, {**planned, **wanted})
    _refuse(group, step_dir, kinds and f"rank {group.rank}: {kinds}", "refused", unsafe=True)
    if state:
        reader = _load_into(group, step_dir, expected, metadata, seen, wanted)
        seen = {**(seen or {}), **reader.records}  # what this rank just hashed: not again
        values: dict[str, Any] = {}
        try:
            values, mine = decode(wanted), None
        except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
            mine = f"rank {group.rank}: a state entry is not weights-only ({exc})"
        _refuse(group, step_dir, mine, "refused before anything was set", unsafe=True)
        _apply_agreed(group, step_dir, state, values, skipped, applied)
    try:
        _load_into(group, step_dir, expected, metadata, seen, planned)
        _merge(target, planned)
        _set_agreed(group, step_dir, model, optimizer, target)
    except BaseException:
        applied.undo()
        raise
    if skipped and group.rank == 0:
        logger.warning(
            "load_sharded: %s was saved at %d ranks and is loaded at %d: per-rank state %s "
            "not restored (each object keeps its current state)",
            step_dir.name,
            saved_world,
            group.size,
            skipped,
        )
