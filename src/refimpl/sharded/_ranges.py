"""Reading what a load needs from a DCP shard file: each needed byte range once, in place.

DCP's ``FileSystemReader.read_data`` (torch 2.13, ``filesystem.py:861-919``) handles each read
item on its own: it ``torch.load``\\ s the *whole* saved chunk the item points into (a
``torch.save`` archive inside the ``.distcp`` file), narrows it to the part this rank needs
(``narrow_tensor_by_index``), and copies that part into the target tensor. At the saving world
size an item is a whole chunk and nothing is wasted. Resharded, a rank's rows straddle two or
more saved chunks, and it deserialises all of each: at 3 ranks from a save at 2, the middle
rank reads and allocates every byte of the model to keep a third of it, then copies again.

`read_ranges` does the same job with the bytes it needs only. For each tensor item it locates
the chunk's storage record in the archive (``PyTorchFileReader``: the record's offset, and
``data.pkl`` read by `_LayoutUnpickler`, which records the tensor's dtype, offset, size and
stride and builds nothing), computes the byte range of the rows the item asks for, and reads
exactly that range, in file order, straight into the target tensor when the target is
contiguous (one ``readinto``, no temporary) or into a buffer of that range otherwise. Anything
it does not recognise (a transform, another pickle, a big-endian archive, a range that is not
inside the record) is left to DCP's own per-item path, which then reads it as before: the files
are plain DCP files, and plain ``dcp.load`` reads them.
"""

from __future__ import annotations

import io
import math
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem
from torch.distributed.checkpoint.utils import _create_file_view

_STORAGE_DTYPES = {
    name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()
}
_PLAIN_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex128,
    torch.complex64,
}


class _NotPlain(Exception):
    """The archive holds something other than one plain dense CPU tensor."""


@dataclass(frozen=True)
class Layout:
    """Where a saved chunk's elements are: ``data_start`` is the file offset of its storage
    record, which holds ``numel`` elements of ``dtype``; the chunk is the strided view
    (``offset``, ``size``, ``stride``, in elements) of that storage."""

    dtype: torch.dtype
    data_start: int
    numel: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype
    key: str
    numel: int


def _storage_type(name: str) -> Callable[[], None]:
    def never_called() -> None:  # the class is only compared, as torch.load does
        raise _NotPlain(name)

    never_called.dtype = _STORAGE_DTYPES[name]  # type: ignore[attr-defined]
    return never_called


def _rebuild(
    storage: Any, offset: Any, size: Any, stride: Any, *_flags: Any
) -> tuple[_Storage, int, tuple[int, ...], tuple[int, ...]]:
    if not isinstance(storage, _Storage) or type(offset) is not int:
        raise _NotPlain("unexpected _rebuild_tensor_v2 arguments")
    dims = (tuple(size), tuple(stride))
    if len(dims[0]) != len(dims[1]) or any(type(x) is not int or x < 0 for d in dims for x in d):
        raise _NotPlain("unexpected size or stride")
    return storage, offset, dims[0], dims[1]


class _LayoutUnpickler(pickle.Unpickler):
    """Reads a one-tensor ``data.pkl`` into ``(storage, offset, size, stride)``: the only
    globals it resolves are ``_rebuild_tensor_v2`` (to `_rebuild`, which records its
    arguments), the typed storage classes (to markers) and ``OrderedDict``; anything else
    raises `_NotPlain`, so nothing a crafted archive names is ever called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _storage_type(name)
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _NotPlain("unexpected persistent id")
        _kind, storage_type, key, _location, numel = pid
        dtype = getattr(storage_type, "dtype", None)
        if dtype not in _PLAIN_DTYPES or type(key) is not str or type(numel) is not int:
            raise _NotPlain("unexpected storage")
        return _Storage(dtype, key, numel)


def locate(stream: IO[bytes], info: _StorageInfo) -> Layout | None:
    """The `Layout` of the one tensor saved at ``info`` in ``stream``, or None if the item is
    not a plain little-endian dense tensor archive whose storage lies inside the item."""
    if info.transform_descriptors or sys.byteorder != "little":
        return None
    try:
        view = _create_file_view(cast(io.IOBase, stream), info.offset, info.length)
        archive = torch._C.PyTorchFileReader(cast(IO[bytes], view))
        if archive.get_record("byteorder") != b"little":
            return None
        found = _LayoutUnpickler(io.BytesIO(archive.get_record("data.pkl"))).load()
        if not (type(found) is tuple and len(found) == 4 and isinstance(found[0], _Storage)):
            return None
        storage, offset, size, stride = found
        name = f"data/{storage.key}"
        start = archive.get_record_offset(name)  # type: ignore[attr-defined]
        recorded = archive.get_record_size(name)
    except (_NotPlain, RuntimeError, pickle.UnpicklingError, ValueError, TypeError, EOFError):
        return None
    nbytes = storage.numel * storage.dtype.itemsize
    span = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1
    inside = recorded == nbytes and start >= 0 and start + nbytes <= info.length
    if not inside or (math.prod(size) > 0 and span > storage.numel):
        return None
    return Layout(storage.dtype, info.offset + start, storage.numel, offset, size, stride)


def _needed(layout: Layout, starts: Sequence[int], lengths: Sequence[int]) -> tuple[int, int, bool]:
    """``(first byte, byte count, contiguous)`` of the view the read item wants; ``byte count``
    covers the view from its first to its last element (all of it when ``contiguous``)."""
    itemsize = layout.dtype.itemsize
    first = layout.offset + sum(a * s for a, s in zip(starts, layout.stride, strict=True))
    if math.prod(lengths) == 0:
        return layout.data_start + first * itemsize, 0, True
    last = first + sum((n - 1) * s for n, s in zip(lengths, layout.stride, strict=True))
    expected, contiguous = 1, True
    for n, s in reversed(list(zip(lengths, layout.stride, strict=True))):
        if n != 1 and s != expected:
            contiguous = False
        expected *= n
    return layout.data_start + first * itemsize, (last - first + 1) * itemsize, contiguous


def _read_exactly(stream: IO[bytes], start: int, view: memoryview) -> None:
    stream.seek(start)
    done = 0
    while done < len(view):
        got = stream.readinto(view[done:])  # type: ignore[attr-defined]
        if not got:
            raise OSError(f"file ends {len(view) - done} bytes short of what its metadata says")
        done += got


def _fill(stream: IO[bytes], layout: Layout, req: ReadItem, target: torch.Tensor) -> bool:
    """Read ``req``'s part of the chunk at ``layout`` into ``target``; False if it cannot."""
    lengths, starts = tuple(req.lengths), tuple(req.storage_offsets)
    if len(lengths) != len(layout.size) or any(
        a < 0 or a + n > size for a, n, size in zip(starts, lengths, layout.size, strict=True)
    ):
        return False
    if tuple(target.shape) != lengths or target.device.type != "cpu":
        return False
    start, nbytes, contiguous = _needed(layout, starts, lengths)
    if nbytes == 0:
        return True
    if contiguous and target.dtype == layout.dtype and target.is_contiguous():
        _read_exactly(stream, start, target.reshape(-1).view(torch.uint8).numpy().data)
        return True
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    _read_exactly(stream, start, buffer.numpy().data)
    stride = layout.stride
    target.copy_(torch.as_strided(buffer.view(layout.dtype), lengths, stride))
    return True


def read_ranges(
    open_file: Callable[[str], IO[bytes]],
    storage_data: dict[Any, _StorageInfo],
    items: Sequence[ReadItem],
    planner: LoadPlanner,
) -> list[ReadItem]:
    """Load ``items`` as ``FileSystemReader.read_data`` would, reading only the bytes each
    tensor item needs; return the items left to DCP's own per-item path.

    ``open_file(name)`` gives the open file to read ``name`` from. Files are read one after
    another, each item's range in file order; non-tensor items are read whole and handed to
    ``planner.load_bytes`` as DCP does.
    """
    left: list[ReadItem] = []
    per_file: dict[str, list[ReadItem]] = {}
    for req in items:
        per_file.setdefault(storage_data[req.storage_index].relative_path, []).append(req)
    for name, reqs in per_file.items():
        stream = open_file(name)
        located = []
        for req in reqs:
            info = storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                if info.transform_descriptors:
                    left.append(req)
                    continue
                stream.seek(info.offset)
                planner.load_bytes(req, io.BytesIO(stream.read(info.length)))
                continue
            layout = locate(stream, info)
            if layout is None:
                left.append(req)
            else:
                located.append((_needed(layout, req.storage_offsets, req.lengths)[0], layout, req))
        for _start, layout, req in sorted(located, key=lambda x: x[0]):
            target = planner.resolve_tensor(req).detach()
            if _fill(stream, layout, req, target):
                planner.commit_tensor(req, target)
            else:
                left.append(req)
    return left
