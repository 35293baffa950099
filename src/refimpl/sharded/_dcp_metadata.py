"""Read DCP's ``.metadata`` without running anything a crafted file asks for.

``torch.distributed.checkpoint``'s `FileSystemReader.read_metadata` opens ``.metadata`` with
plain ``pickle.load`` (torch 2.13, ``filesystem.py``), so a crafted file runs any code it
names the moment ``dcp.load`` starts. `check_metadata` unpickles the file with an allowlist
of the classes a real DCP metadata file is made of (DCP's own metadata dataclasses, torch
dtypes and sizes, a path, an ordered dict) and refuses anything else, so `refimpl.sharded`
can reject a hostile file before DCP ever opens it.

Restricting ``find_class`` is not enough: pickle's ``BUILD`` opcode sets attributes on whatever
object is below it on the stack, and an allowlisted *class* is such an object, so a crafted
file could ``setattr(pathlib.PosixPath, "is_file", ...)`` for the whole process before being
refused. ``BUILD`` is therefore accepted only on instances of DCP's own dataclasses, with
exactly their field names (the pure-Python unpickler is used so that this opcode can be
replaced; a metadata file is small). Objects built without their state (``NEWOBJ`` with no
``BUILD``) are found before anything reads a missing attribute.

It then checks what DCP would do with the result: every ``storage_data`` entry names the
file DCP will open for that item, joined to the checkpoint directory as it is. An entry such
as ``"../../etc/passwd"`` would make a plain ``dcp.load`` read outside the checkpoint, so
only the plain shard names of the checkpoint are accepted, with offsets inside the file.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import importlib
import io
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import filesystem as _fs_module
from torch.distributed.checkpoint import metadata as _md_module
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from refimpl._regular_file import read_regular
from refimpl._step_dirs import DIGEST
from refimpl.atomic import DIGESTS

_ALLOWED_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
)
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name in a dict, no more
    ("collections", "OrderedDict"),
    # StorageMeta.checkpoint_id: FileSystemWriter stores the directory it wrote as a Path
    # (torch 2.13 pickles a PosixPath there; no other pathlib class appears).
    ("pathlib", "PosixPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}
MAX_METADATA_BYTES = 256 << 20  # a real one is KB to MB; refuse to unpickle more than this
SHARD_NAME_RE = re.compile(r"__[0-9]{1,9}_[0-9]{1,9}\.distcp", re.ASCII)
"""The names `FileSystemWriter` gives its data files: ``__RANK_N.distcp``."""


class UnsafeMetadata(ValueError):
    """``.metadata`` asks for something a DCP metadata file never contains."""


def _dcp_types(*modules: Any) -> frozenset[type]:
    return frozenset(
        obj
        for module in modules
        for obj in vars(module).values()
        if isinstance(obj, type)
        and obj.__module__ == module.__name__
        and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
    )


_DCP_TYPES = _dcp_types(_md_module, _fs_module)
_DATACLASSES = frozenset(t for t in _DCP_TYPES if dataclasses.is_dataclass(t))
_MAX_NODES = 10_000_000  # objects visited by the built-state check; a real file has far fewer


def allowed_types() -> frozenset[type]:
    """Every class `check_metadata` lets a ``.metadata`` name (the torch dtypes aside)."""
    plain = {getattr(importlib.import_module(m), n) for m, n in _ALLOWED}
    return _DCP_TYPES | frozenset(t for t in plain if isinstance(t, type))


def _load_build(self: Any) -> None:
    """pickle's BUILD, only onto an instance of DCP's dataclasses and only their fields."""
    state, inst = self.stack[-1], self.stack[-2]
    kind = type(inst)
    target = f"class {inst.__qualname__}" if isinstance(inst, type) else kind.__qualname__
    if isinstance(inst, type) or kind not in _DATACLASSES:
        raise UnsafeMetadata(
            f"sets attributes on a {target}; a DCP metadata file only sets the fields of "
            "DCP's own metadata objects"
        )
    if kind is TensorProperties:  # its __setstate__ takes a 5-tuple (torch 2.13 metadata.py)
        ok = type(state) is tuple and len(state) == 5
    else:
        fields = {f.name for f in dataclasses.fields(kind)}
        ok = type(state) is dict and all(type(k) is str and k in fields for k in state)
    if not ok:
        raise UnsafeMetadata(f"gives a {kind.__qualname__} a state it never has")
    pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]


class _Restricted(pickle._Unpickler):
    # The pure-Python unpickler, so that BUILD can be replaced (the C one cannot be changed).
    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = _load_build

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _ALLOWED
        if module in _ALLOWED_MODULES:  # DCP's own classes (dataclasses, enums), nothing else
            allowed = getattr(importlib.import_module(module), name, None) in _DCP_TYPES
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise UnsafeMetadata(
                f"refers to {module}.{name}, which a DCP metadata file never contains"
            )
        return super().find_class(module, name)


def _check_built(root: Any) -> None:
    """Every DCP object reachable from ``root`` has all its fields (none built stateless)."""
    todo, seen = [root], 0
    while todo:
        obj = todo.pop()
        seen += 1
        if seen > _MAX_NODES:
            raise UnsafeMetadata(f"holds more than {_MAX_NODES} objects")
        if type(obj) in _DATACLASSES:
            have = vars(obj)
            for f in dataclasses.fields(obj):
                if f.name not in have and f.default is dataclasses.MISSING:
                    raise UnsafeMetadata(
                        f"holds a {type(obj).__qualname__} without its field {f.name!r} "
                        "(built without its state)"
                    )
                todo.append(have.get(f.name))  # absent: the class's default stands
        elif type(obj) in (dict, collections.OrderedDict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif type(obj) in (list, tuple, set, frozenset):
            todo.extend(obj)


def _check_items(metadata: Metadata) -> None:
    """What DCP's planner reads of each item has the type it expects."""
    for fqn, item in metadata.state_dict_metadata.items():
        if type(fqn) is not str:
            raise UnsafeMetadata(f"has an item named by a {type(fqn).__name__}, not a str")
        if type(item) is BytesStorageMetadata:
            continue
        if type(item) is not TensorStorageMetadata:
            raise UnsafeMetadata(f"describes {fqn!r} with a {type(item).__name__}")
        props, size, chunks = item.properties, item.size, item.chunks
        ok = type(props) is TensorProperties and isinstance(props.dtype, torch.dtype)
        ok = ok and type(size) is torch.Size and type(chunks) is list
        ok = ok and all(
            type(c) is ChunkStorageMetadata
            and type(c.offsets) is torch.Size
            and type(c.sizes) is torch.Size
            and len(c.offsets) == len(c.sizes) == len(size)
            for c in chunks
        )
        if not ok:
            raise UnsafeMetadata(f"describes tensor {fqn!r} with malformed properties or chunks")


def _check_storage(metadata: Any, files: Mapping[str, int] | None) -> None:
    """Every item must point at a plain shard file of this checkpoint, inside its bytes."""
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadata(f"holds a {type(metadata).__name__}, not a DCP Metadata")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeMetadata("state_dict_metadata is not a dict")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise UnsafeMetadata(f"storage_data is a {type(storage).__name__}, not a dict")
    _check_items(metadata)
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(index.fqn) is not str:
            raise UnsafeMetadata(f"indexes its storage with a {type(index).__name__}")
        fqn = index.fqn
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


def parse_metadata(raw: bytes, files: Mapping[str, int] | None = None) -> Metadata:
    """`check_metadata` on bytes already read (and, by the caller, already verified)."""
    if len(raw) > MAX_METADATA_BYTES:
        raise UnsafeMetadata(f"{len(raw)} bytes; a DCP metadata file is far smaller")
    try:
        metadata = _Restricted(io.BytesIO(raw)).load()
        _check_built(metadata)
        _check_storage(metadata, files)
    except UnsafeMetadata:
        raise
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except Exception as exc:  # whatever a crafted file provokes (RecursionError, ...): refused
        raise UnsafeMetadata(
            f"is not a readable DCP metadata file ({type(exc).__name__}: {str(exc)[:200]})"
        ) from exc
    checked: Metadata = metadata
    return checked


def check_metadata(
    path: str | Path,
    files: Mapping[str, int] | None = None,
    *,
    expect: tuple[int, str] | None = None,
) -> Metadata:
    """Unpickle ``path`` (a DCP ``.metadata``) with the allowlist; return the Metadata.

    Raises `UnsafeMetadata` naming the first global outside the allowlist, without calling
    it, or the first attribute set on anything but a field of DCP's metadata objects. Then
    every item's storage entry must name a ``__R_N.distcp`` file (one of ``files``, a ``{name:
    size in bytes}`` map of the checkpoint's shard files, when given) and lie inside it:
    otherwise a plain ``dcp.load`` would open another path or read past the end. The file
    must be a regular file (a FIFO or a link to a device is refused without blocking:
    `refimpl._regular_file.NotRegularFile`, an ``OSError``). ``expect``: the manifest's
    ``(bytes, xxh3_128 digest)``; the bytes read must match it, so what is unpickled is what
    was verified.
    """
    raw = read_regular(path, MAX_METADATA_BYTES)
    if expect is not None:
        size, digest = expect
        hasher = DIGESTS[DIGEST]()
        hasher.update(raw)
        got = hasher.hexdigest()
        if len(raw) != size or got != digest:
            raise UnsafeMetadata(
                f"has {len(raw)} bytes with {DIGEST} {got}; the manifest says {size} bytes, "
                f"{digest} (changed after it was verified?)"
            )
    return parse_metadata(raw, files)
