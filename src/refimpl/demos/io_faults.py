"""Chapter 5's damage: I/O errors injected into refimpl's writers, traced syscalls, one
flipped bit inside a ``torch.save`` file, and a directory "renamed" the way object stores do.

- `inject_io_error`: make `refimpl.atomic`'s writes or fsyncs fail with ENOSPC or EIO (after
  some bytes, optionally), through the indirections kept for this (``atomic._open_temp``,
  ``atomic._replace``, and ``refimpl._system.disk.fsync``, which every fsync goes through);
- `trace_io`: record the writes, fsyncs and renames a save performs, in order;
- `flip_bit_in_record`: flip one bit of one tensor record inside a ``torch.save`` zip;
- `rename_like_an_object_store`: copy a directory object by object in listing order, as
  ``mv`` does on an object-store mount, so a reader can see a marker before the data.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import shutil
import stat
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from refimpl import atomic
from refimpl._system import disk

__all__ = [
    "flip_bit_in_record",
    "inject_io_error",
    "rename_like_an_object_store",
    "trace_io",
]


class _FailingFile:
    """A file that accepts ``after_bytes`` bytes, then fails like a full or broken disk."""

    def __init__(self, f: IO[bytes], err: int, after_bytes: int) -> None:
        self._f, self._err, self._left = f, err, after_bytes

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) > self._left:
            self._f.write(view[: self._left])  # a real ENOSPC also writes what fits first
            self._left = 0
            raise OSError(self._err, os.strerror(self._err))
        self._left -= len(view)
        return self._f.write(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _FailingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


@contextlib.contextmanager
def inject_io_error(
    err: int = errno_mod.ENOSPC, *, after_bytes: int = 0, on: str = "write"
) -> Iterator[None]:
    """Make refimpl's writers fail with ``err`` (ENOSPC, EIO, ...) inside the block.

    ``on="write"``: every temporary file accepts ``after_bytes`` bytes and then its next
    write raises; ``on="fsync"``: every fsync raises (how a dying disk usually reports).
    """
    real_open, real_fsync = atomic._open_temp, disk.fsync

    def failing_open(path: Path) -> tuple[IO[bytes], Path]:
        f, tmp = real_open(path)
        return _FailingFile(f, err, after_bytes), tmp  # type: ignore[return-value]

    def failing_fsync(fd: int) -> None:
        raise OSError(err, os.strerror(err))

    if on == "write":
        atomic._open_temp = failing_open
    elif on == "fsync":
        disk.fsync = failing_fsync
    else:
        raise ValueError(f"on must be 'write' or 'fsync', got {on!r}")
    try:
        yield
    finally:
        atomic._open_temp, disk.fsync = real_open, real_fsync


@contextlib.contextmanager
def trace_io() -> Iterator[list[str]]:
    """Record the durable-write steps refimpl.atomic takes (for the chapter's evidence)."""
    events: list[str] = []
    real_open, real_fsync, real_replace = atomic._open_temp, disk.fsync, atomic._replace

    def open_(path: Path) -> tuple[IO[bytes], Path]:
        f, tmp = real_open(path)
        events.append(f"create {tmp.name.split(atomic.TEMP_TAG)[0]}{atomic.TEMP_TAG}…")
        return f, tmp

    def fsync_(fd: int) -> None:
        kind = "directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append(f"fsync {kind}")
        real_fsync(fd)

    def replace_(src: Any, dst: Any) -> None:
        events.append(f"os.replace -> {Path(dst).name}")
        real_replace(src, dst)

    atomic._open_temp, disk.fsync, atomic._replace = open_, fsync_, replace_
    try:
        yield events
    finally:
        atomic._open_temp, disk.fsync, atomic._replace = real_open, real_fsync, real_replace


def flip_bit_in_record(path: str | os.PathLike[str], record: str, offset: int, bit: int = 0) -> str:
    """Flip one bit of byte ``offset`` in the zip record ``record`` (say ``"data/0"``, the first
    tensor's bytes) of the ``torch.save`` file ``path``; return the record's full name.

    The zip index and the record's stored CRC-32 are left alone, as a failing disk would.
    """
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/" + record))
    if info.compress_type != zipfile.ZIP_STORED or not 0 <= offset < info.file_size:
        raise ValueError(f"{info.filename}: not stored uncompressed, or offset out of range")
    data = bytearray(Path(path).read_bytes())
    head = info.header_offset
    name_len, extra_len = struct.unpack("<HH", data[head + 26 : head + 30])
    data[head + 30 + name_len + extra_len + offset] ^= 1 << bit  # past the local header
    Path(path).write_bytes(bytes(data))
    return info.filename


def rename_like_an_object_store(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, crash_after: int | None = None
) -> list[str]:
    """ "Rename" directory ``src`` to ``dst`` as an object store must: it has no rename, so
    every object is copied, in listing order (sorted by name), and the sources are deleted
    after. ``crash_after=k`` stops after ``k`` copies, as a crash would. Returns the names
    copied."""
    names = sorted(p.relative_to(src).as_posix() for p in Path(src).rglob("*") if p.is_file())
    copied: list[str] = []
    for name in names:
        if crash_after is not None and len(copied) >= crash_after:
            return copied
        Path(dst, name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(src, name), Path(dst, name))
        copied.append(name)
    shutil.rmtree(src)
    return copied
