"""What the ecosystem reads: a sharded step as one full state dict, and as Hugging Face files.

`read_full` rebuilds one top-level key of a verified step whole, in one process (what
``format_utils.dcp_to_torch_save`` does, with non-tensor items loaded weights-only);
`refimpl.sharded.consolidate` writes it with ``torch.save`` and `export_hf` as safetensors
in the layout ``transformers`` and ``safetensors.torch.load_file`` read: ``model.safetensors``,
or ``model-00001-of-0000N.safetensors`` files plus ``model.safetensors.index.json``.
The export is built in a hidden temporary directory and renamed into place, so a kill
mid-export leaves the previous export (or none), never a mix that looks complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader

from refimpl._publish import staged_dir
from refimpl._weights import WRAPPER_PREFIXES, inference_tensor
from refimpl.atomic import COMMIT_MARKER
from refimpl.checkpoint import MANIFEST, CheckpointError
from refimpl.sharded._commit import verify_step
from refimpl.sharded._errors import LOAD_ADVICE, dcp_errors
from refimpl.sharded._read import WeightsOnlyEmptyPlanner

logger = logging.getLogger("refimpl.sharded")

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# Wrapper segments that can sit anywhere in a name (FSDP1, activation checkpointing, a
# compiled submodule); DDP's ``module.`` only ever comes first (refimpl._weights.WRAPPER_PREFIXES).
_WRAPPERS = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}
# A step directory, or the temporary or aside name a save gives one while it writes it.
_STEP_LIKE = re.compile(r"step_[0-9]+|\.step_[0-9]+\..*", re.ASCII)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def _save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file (an indirection the tests replace to kill an export half-way)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})  # what transformers checks


def read_full(step_dir: Path, key: str) -> Any:
    """The whole (unsharded) top-level ``key`` of the step, after `verify_step`."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    verify_step(step_dir)
    state: dict[str, Any] = {}
    with dcp_errors(step_dir, f"consolidation of {step_dir.name}", 0, LOAD_ADVICE):
        _load_state_dict(
            state,
            storage_reader=FileSystemReader(step_dir),
            planner=WeightsOnlyEmptyPlanner(keys=[key]),
            no_dist=True,
        )
    if key not in state:
        raise CheckpointError(step_dir, f"has no top-level key {key!r}; try 'model' or 'optim'")
    return state[key]


def clean_name(name: str) -> str:
    """``name`` without DDP's, FSDP1's, activation checkpointing's or compile's wrapper parts."""
    while name.startswith(WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def parse_size(text: str) -> int:
    """``"2GB"`` -> 2*10**9, ``"500MiB"`` -> 500*2**20, ``"1000"`` -> 1000 (as transformers)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"not a size: {text!r}; write e.g. 2GB, 500MB, 1GiB or a byte count")
    return int(float(match[1]) * _UNITS[(match[2] or "").upper()])


def split(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[list[str]]:
    """Names grouped into files in order: each file's tensor bytes at most ``max_bytes``
    (a tensor larger than that gets a file of its own, as transformers does)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_bytes is not None and groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def checkpoint_under(directory: Path) -> Path | None:
    """The first step directory (or a save's temporary of one), manifest or commit marker at
    or under ``directory``, links not followed; None when there is none."""
    if _STEP_LIKE.fullmatch(directory.name):
        return directory
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in sorted(dirnames) + sorted(filenames):
            if _STEP_LIKE.fullmatch(name) or name in (MANIFEST, COMMIT_MARKER):
                return Path(dirpath) / name
    return None


def export_target(step_dir: Path, out_dir: Path) -> Path:
    """Where `export_hf` may put ``out_dir``: itself, or the directory a symlink names (the
    link is kept). Raises ``ValueError`` when that is inside ``step_dir``, or is or holds a
    checkpoint: an export replaces its whole directory, so a step saved there meanwhile
    would be lost."""
    target, step = Path(os.path.realpath(out_dir)), Path(os.path.realpath(step_dir))
    if target.is_relative_to(step):
        raise ValueError(f"{out_dir} is inside the step {step_dir}: export somewhere else")
    if step.is_relative_to(target):
        raise ValueError(
            f"{out_dir} holds the step {step_dir} (it is its checkpoint directory, or above "
            "it): an export replaces its directory whole, so steps saved there meanwhile would "
            "be lost. Export to a directory of its own, outside the checkpoint directory"
        )
    found = checkpoint_under(target) if target.is_dir() or not target.exists() else None
    if found is not None:
        raise ValueError(
            f"{out_dir} is or holds a checkpoint ({found}): an export replaces its directory "
            "whole, so that checkpoint would be lost. Export to a directory of its own"
        )
    return target


def check_output_file(step_dir: Path, out_path: Path) -> None:
    """Raise ``ValueError`` when ``out_path`` (followed if a link) would be written inside
    ``step_dir`` or inside any other step directory: a committed step holds what its
    manifest lists, and nothing is written into one after its commit."""
    target = Path(os.path.realpath(out_path))
    if target.is_relative_to(Path(os.path.realpath(step_dir))):
        raise ValueError(f"{out_path} is inside the step {step_dir}: write it somewhere else")
    for parent in target.parents:
        if _STEP_LIKE.fullmatch(parent.name) or (parent / COMMIT_MARKER).exists():
            raise ValueError(
                f"{out_path} is inside the checkpoint step {parent}: write it somewhere else"
            )


def _is_export_file(name: str) -> bool:
    return name in (SINGLE, INDEX) or _SHARD_RE.fullmatch(name) is not None


def _carry_over(old: Path, new: Path) -> None:
    """Copy what the user put beside a previous export (config.json, a tokenizer) into
    ``new``; the previous export's own files are not copied (the new ones replace them)."""
    for entry in sorted(old.iterdir()):
        if _is_export_file(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True)
        else:
            shutil.copy2(entry, new / entry.name, follow_symlinks=False)


def write_export(
    tensors: dict[str, torch.Tensor], out_dir: Path, max_bytes: int | None
) -> list[Path]:
    """Write ``tensors`` as safetensors into ``out_dir``, atomically; return the files."""
    groups = split(tensors, max_bytes)
    n = len(groups)
    names = (
        [SINGLE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir} is a file: export_hf writes a directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # the sweep takes what a killed export left; an old export is swapped out atomically
    with staged_dir(out_dir, replace=True, sweep="target") as tmp:
        if out_dir.is_dir():
            _carry_over(out_dir, tmp)
        for file, group in zip(names, groups, strict=True):
            _save_file({k: tensors[k] for k in group}, tmp / file)
        if n > 1:  # the index last: without it the shards are not an export
            index = {
                "metadata": {
                    "total_size": sum(t.numel() * t.element_size() for t in tensors.values())
                },
                "weight_map": {
                    k: file for file, group in zip(names, groups, strict=True) for k in group
                },
            }
            (tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        found = checkpoint_under(out_dir) if out_dir.is_dir() else None
        if found is not None:  # saved there while we exported: swapping would lose it
            raise ValueError(f"{out_dir} now holds a checkpoint ({found}): export elsewhere")
    return [out_dir / f for f in names] + ([out_dir / INDEX] if n > 1 else [])


def export_hf(
    step_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = torch.bfloat16,
    max_shard_bytes: int | str | None = None,
    key: str = "model",
) -> list[Path]:
    """Write the ``model`` of a sharded step as Hugging Face-style safetensors in ``out_dir``.

    One process, no process group. The step is verified first (as `consolidate` does) and
    rebuilt whole; floating-point tensors are cast to ``dtype`` (None keeps the saved
    dtypes); names lose DDP/FSDP/compile wrapper parts (``module.``, ``_orig_mod.``,
    ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``); tensors that shared
    storage (tied weights) are written as separate copies, since safetensors refuses shared
    storage. Only the model: no optimizer, no ``state=``. Non-tensor items (a module's
    ``_extra_state``) cannot be stored in safetensors: they are skipped with a warning.

    Without ``max_shard_bytes`` (or when everything fits in one file) the export is one
    ``model.safetensors``. With it (bytes, or a string such as ``"2GB"`` or ``"500MiB"``)
    the tensors are split in order into ``model-00001-of-0000N.safetensors`` files of at
    most that many tensor bytes (a larger tensor gets a file alone) and
    ``model.safetensors.index.json`` maps every name to its file
    (``{"metadata": {"total_size": ...}, "weight_map": {...}}``). Every file loads with
    ``safetensors.torch.load_file``; the directory with ``transformers``'
    ``from_pretrained`` once its ``config.json`` is beside it.

    Atomic: the files are written into a hidden temporary directory next to ``out_dir``,
    fsynced and renamed to ``out_dir``; a kill mid-export leaves the previous ``out_dir``
    (or none) and a temporary that the next export removes. An existing ``out_dir`` is
    replaced by an atomic exchange; files in it that are not an export's (``config.json``,
    a tokenizer) are copied into the new one first. Returns the files written, index last.
    A symlink ``out_dir`` is followed: its target directory is replaced, the link kept.

    Raises ``ValueError`` when ``out_dir`` is inside the step, or is (or holds) a checkpoint
    directory or any step, the step's own checkpoint directory included (``"."`` in it):
    replacing it would lose every step saved there during the export.

    Example::

        export_hf("ckpt/step_00000200", "hf", max_shard_bytes="2GB")
        weights = {}
        for f in Path("hf").glob("*.safetensors"):
            weights |= safetensors.torch.load_file(f)
    """
    step_dir, out_dir = Path(step_dir), Path(out_dir)
    limit = parse_size(max_shard_bytes) if isinstance(max_shard_bytes, str) else max_shard_bytes
    if limit is not None and (type(limit) is not int or limit < 1):
        raise ValueError(f"max_shard_bytes must be >= 1 byte or None, got {max_shard_bytes!r}")
    target = export_target(step_dir, out_dir)
    value = read_full(step_dir, key)
    tensors: dict[str, torch.Tensor] = {}
    skipped = []
    for name in list(value):
        item = value.pop(name)  # drop each original as it is converted: one copy at a time
        new = clean_name(name)
        if not isinstance(item, torch.Tensor):
            skipped.append(name)
            continue
        if new in tensors:
            raise ValueError(f"{name!r} and another key both become {new!r} once unwrapped")
        tensors[new] = inference_tensor(item, dtype)
    if skipped:
        logger.warning(
            "export_hf: non-tensor item(s) %s not exported (safetensors holds tensors)", skipped
        )
    return [out_dir / f.relative_to(target) for f in write_export(tensors, target, limit)]
