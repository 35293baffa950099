"""Loading one verified step: the part of `refimpl.sharded.load_sharded` after rank 0 chose it.

Every rank checks ``.metadata`` (the bytes rank 0 verified) and the model's keys, DCP loads
weights-only through a `VerifyingReader`, the ``state=`` entries are decoded (weights-only,
every rank agreeing before anything is set), and only then is anything put in place.
"""

from __future__ import annotations

import logging
import pickle
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from refimpl import _sharded_state
from refimpl._dcp_metadata import UnsafeMetadata, check_metadata
from refimpl._sharded_commit import METADATA, Expected
from refimpl._sharded_errors import LOAD_ADVICE, ShardedCheckpointError, dcp_errors
from refimpl._sharded_group import Group, quiet_no_dist
from refimpl._sharded_read import VerifyingReader, WeightsOnlyLoadPlanner, _few, check_keys
from refimpl._sharded_seen import Seen

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


def load_step(
    group: Group,
    step_dir: Path,
    expected: Expected,
    saved_world: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: Mapping[str, Any] | None = None,
    exclude: Sequence[str | re.Pattern[str]] = (),
    seen: Mapping[str, Seen] | None = None,
) -> None:
    """Load ``step_dir`` into ``model``, ``optimizer`` and ``state``. A step refused before
    anything was loaded raises `ShardedCheckpointError` with ``unsafe`` set (the caller falls
    back); a step that does not fit raises one without. ``exclude``d model entries (and
    their optimizer state) are not planned, so DCP never reads them, and keep their values.
    ``seen``: rank 0's records of the files it hashed (`refimpl._sharded_seen`)."""
    sizes = {name: size for name, (size, _d) in expected.items() if name != METADATA}
    metadata = None
    try:
        metadata = check_metadata(step_dir / METADATA, sizes, expect=expected.get(METADATA))
        mine = None
    except (UnsafeMetadata, OSError) as exc:
        mine = f"rank {group.rank}: {exc}"
    _refuse(group, step_dir / METADATA, mine, "refused before DCP opened it", unsafe=True)
    assert metadata is not None  # every rank raised otherwise
    what = f"load of {step_dir.name}"
    with dcp_errors(step_dir, what, group.rank, LOAD_ADVICE):
        if optimizer is None:
            target: dict[str, Any] = {"model": get_model_state_dict(model)}
        else:
            msd, osd = get_state_dict(model, optimizer)
            target = {"model": msd, "optim": osd}
    excluded = excluded_names(target["model"], exclude)  # raises the same on every rank
    misfit = check_keys(metadata, target["model"], excluded)  # the same on every rank: all raise
    if misfit is not None:
        raise ShardedCheckpointError(step_dir, f"{misfit}. {LOAD_ADVICE}", rank=group.rank)
    skipped: list[str] = []
    if state:
        same_world = saved_world in (0, group.size)
        saved = set(metadata.state_dict_metadata)
        wanted, missing, skipped = _sharded_state.targets(state, group.rank, same_world, saved)
        shared_names, rank_names, _ranks = _sharded_state.names_in(sorted(saved))
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
        target.update(wanted)
    planned = _without(target, excluded)
    with dcp_errors(step_dir, what, group.rank, LOAD_ADVICE), quiet_no_dist(group):
        dcp_load(
            planned,
            storage_reader=VerifyingReader(step_dir, expected, metadata, seen),
            planner=WeightsOnlyLoadPlanner(),
            **group.dcp_kwargs(),
        )
    _merge(target, planned)
    values: dict[str, Any] = {}
    if state:
        loaded = {k: v for k, v in target.items() if k not in ("model", "optim")}
        try:
            values, mine = _sharded_state.decode(loaded), None
        except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
            mine = f"rank {group.rank}: a state entry is not weights-only ({exc})"
        _refuse(group, step_dir, mine, "refused before anything was set", unsafe=True)
    with dcp_errors(step_dir, what, group.rank, LOAD_ADVICE):
        if optimizer is None:
            set_model_state_dict(model, target["model"])
        else:
            set_state_dict(
                model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"]
            )
    if state:
        _sharded_state.apply(state, values, skipped)
        if skipped and group.rank == 0:
            logger.warning(
                "load_sharded: %s was saved at %d ranks and is loaded at %d: per-rank state %s "
                "not restored (each object keeps its current state)",
                step_dir.name,
                saved_world,
                group.size,
                skipped,
            )
