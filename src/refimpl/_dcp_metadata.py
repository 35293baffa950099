"""Read DCP's ``.metadata`` without running anything a crafted file asks for.

``torch.distributed.checkpoint``'s `FileSystemReader.read_metadata` opens ``.metadata`` with
plain ``pickle.load`` (torch 2.13, ``filesystem.py``), so a crafted file runs any code it
names the moment ``dcp.load`` starts. `check_metadata` unpickles the file with an allowlist
of the classes a real DCP metadata file is made of (DCP's own metadata dataclasses, torch
dtypes and sizes, a path, an ordered dict) and refuses anything else, so `refimpl.sharded`
can reject a hostile file before DCP ever opens it.

It then checks what DCP would do with the result: every ``storage_data`` entry names the
file DCP will open for that item, joined to the checkpoint directory as it is. An entry such
as ``"../../etc/passwd"`` would make a plain ``dcp.load`` read outside the checkpoint, so
only the plain shard names of the checkpoint are accepted, with offsets inside the file.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

_ALLOWED_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
)
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name in a dict, no more
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}
MAX_METADATA_BYTES = 256 << 20  # a real one is KB to MB; refuse to unpickle more than this
SHARD_NAME_RE = re.compile(r"__[0-9]{1,9}_[0-9]{1,9}\.distcp", re.ASCII)
"""The names `FileSystemWriter` gives its data files: ``__RANK_N.distcp``."""


class UnsafeMetadata(ValueError):
    """``.metadata`` asks for something a DCP metadata file never contains."""


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _ALLOWED
        if module in _ALLOWED_MODULES:  # DCP's own classes (dataclasses, enums), nothing else
            obj = getattr(importlib.import_module(module), name, None)
            allowed = (
                isinstance(obj, type)
                and obj.__module__ == module
                and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
            )
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise UnsafeMetadata(
                f"refers to {module}.{name}, which a DCP metadata file never contains"
            )
        return super().find_class(module, name)


def _check_storage(metadata: Any, files: Mapping[str, int] | None) -> None:
    """Every item must point at a plain shard file of this checkpoint, inside its bytes."""
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadata(f"holds a {type(metadata).__name__}, not a DCP Metadata")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeMetadata("state_dict_metadata is not a dict")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise UnsafeMetadata(f"storage_data is a {type(storage).__name__}, not a dict")
    for index, info in storage.items():
        fqn = getattr(index, "fqn", index)
        if not isinstance(info, _StorageInfo):
            raise UnsafeMetadata(f"storage entry of {fqn!r} is a {type(info).__name__}")
        rel = info.relative_path
        if not (isinstance(rel, str) and SHARD_NAME_RE.fullmatch(rel)):
            raise UnsafeMetadata(
                f"points {fqn!r} at {rel!r}, not a shard file name: a plain dcp.load would "
                "open that path relative to the checkpoint directory"
            )
        if files is not None and rel not in files:
            raise UnsafeMetadata(f"points {fqn!r} at {rel}, which this checkpoint does not have")
        offset, length = info.offset, info.length
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise UnsafeMetadata(f"offset/length of {fqn!r} are {offset!r}/{length!r}")
        if files is not None and offset + length > files[rel]:
            raise UnsafeMetadata(
                f"{fqn!r} ends at byte {offset + length} of {rel}, which has {files[rel]}"
            )


def check_metadata(path: str | Path, files: Mapping[str, int] | None = None) -> Metadata:
    """Unpickle ``path`` (a DCP ``.metadata``) with the allowlist; return the Metadata.

    Raises `UnsafeMetadata` naming the first global outside the allowlist, without calling
    it. Then every item's storage entry must name a ``__R_N.distcp`` file (one of ``files``,
    a ``{name: size in bytes}`` map of the checkpoint's shard files, when given) and lie
    inside it: otherwise a plain ``dcp.load`` would open another path or read past the end.
    """
    raw = Path(path).read_bytes()
    if len(raw) > MAX_METADATA_BYTES:
        raise UnsafeMetadata(f"{len(raw)} bytes; a DCP metadata file is far smaller")
    try:
        metadata = _Restricted(io.BytesIO(raw)).load()
    except UnsafeMetadata:
        raise
    except Exception as exc:
        raise UnsafeMetadata(
            f"is not a readable DCP metadata file ({type(exc).__name__}: {exc})"
        ) from exc
    _check_storage(metadata, files)
    checked: Metadata = metadata
    return checked
