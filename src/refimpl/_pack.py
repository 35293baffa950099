"""One file holding every top-level key of a file checkpoint: ``torch.save`` archives, one
per key, back to back; the manifest says where each begins and how long it is.

Why one file: a step of 14 small keys written as 14 files cost 14 creations and 14 fsyncs,
several times one ``torch.save`` of the same state. Why not one ``torch.save`` of the whole
dict: ``load_checkpoint(keys=["model"])`` would then unpickle the optimizer too. Each key
here is a complete archive of its own, so reading one key opens the file, seeks to its
range and ``torch.load``\\ s that range alone (through `KeyWindow`, never copying it).
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

import torch

from refimpl._pacer import PIECE_BYTES

PACK = "state.pack"
"""The name of the file that holds every key (manifest format 3)."""


@dataclass(frozen=True)
class KeyRange:
    """Where a top-level key lives in a step: ``file``, and, inside it, ``offset`` and
    ``length`` in bytes (``length`` None: the whole file, as formats 1 and 2 wrote)."""

    file: str
    offset: int = 0
    length: int | None = None


_IN_MEMORY_BYTES = 1 << 20
_pacing = threading.local()


@contextlib.contextmanager
def paced(pace: Callable[[], None] | None) -> Iterator[None]:
    """Inside the block, `write_pack` in this thread hands its file `PIECE_BYTES` at a time
    and calls ``pace()`` after each piece (a background writer's pacer); None: unpaced."""
    previous = getattr(_pacing, "pace", None)
    _pacing.pace = pace
    try:
        yield
    finally:
        _pacing.pace = previous


def _tensor_bytes(value: Any, limit: int, depth: int = 0) -> int:
    """The bytes of the tensors in ``value`` (containers followed), counted up to ``limit``."""
    if isinstance(value, torch.Tensor):
        return int(value.numel() * value.element_size())
    if depth > 50:
        return limit
    items = value.values() if isinstance(value, Mapping) else value
    if not isinstance(value, (Mapping, list, tuple)):
        return 0
    total = 0
    for item in items:
        total += _tensor_bytes(item, limit - total, depth + 1)
        if total >= limit:
            break
    return total


def write_pack(
    f: IO[bytes], state: Mapping[str, Any], on_key: Callable[[str], None] | None = None
) -> dict[str, KeyRange]:
    """``torch.save`` each value of ``state`` into ``f`` in turn; return each key's range.

    ``f`` only needs ``write``: torch's zip writer never seeks, and the offsets inside each
    archive are relative to its own start. A value with under 1 MiB of tensors is built in
    memory and written in one call (torch's zip writer issues several small writes per
    tensor, each a Python call down the stack of file wrappers); a larger one streams.
    ``on_key(key)`` is called as each key starts (so a failure can name it).
    """
    ranges = {}
    written = 0
    pace = getattr(_pacing, "pace", None)
    sink: Any = f if pace is None else _Pieces(f, pace)
    for key, value in state.items():
        if on_key is not None:
            on_key(key)
        if _tensor_bytes(value, _IN_MEMORY_BYTES) < _IN_MEMORY_BYTES:
            buf = io.BytesIO()
            torch.save(value, buf)
            with buf.getbuffer() as view:
                sink.write(view)
                length = view.nbytes
            del buf
        else:
            out = _Counting(sink)
            torch.save(value, out)  # type: ignore[arg-type]  # a writable file-like is enough
            length = out.written
        ranges[key] = KeyRange(PACK, written, length)
        written += length
    return ranges


class _Pieces:
    """Hands ``f`` at most `PIECE_BYTES` per write, calling ``pace()`` after each piece."""

    def __init__(self, f: IO[bytes], pace: Callable[[], None]) -> None:
        self._f, self._pace = f, pace

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), PIECE_BYTES):
            self._f.write(view[start : start + PIECE_BYTES])
            self._pace()
        return len(view)

    def flush(self) -> None:
        self._f.flush()


class _Counting:
    """Passes writes through and counts their bytes."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.written = 0

    def write(self, data: Any) -> int:
        n: int = self._f.write(data)
        self.written += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self._f.flush()


class KeyWindow(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of ``f`` from ``offset``: what
    ``torch.load`` reads one key's archive through (it seeks, tells and reads, nothing else).
    """

    def __init__(self, f: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self._f, self._offset, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        if base + offset < 0:
            raise OSError(22, "negative seek position")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._offset + self._pos)
        got = self._f.readinto(view[:n])  # type: ignore[attr-defined]  # a raw or buffered file
        self._pos += got or 0
        return got or 0
