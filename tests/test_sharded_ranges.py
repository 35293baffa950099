"""refimpl.sharded._ranges: a load that reads only the bytes each read item needs gives the
same tensors as DCP's own per-item path (torch.load of the whole chunk, then narrow), for
every layout DCP can write; anything it does not recognise is left to DCP's path."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from refimpl.sharded._ranges import Layout, _fill, locate, read_ranges

FILE = "__0_0.distcp"


class Planner:
    """The three calls `read_ranges` makes, recording what it was given."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.committed: list[str] = []
        self.loaded_bytes: dict[str, bytes] = {}

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        return self.targets[req.dest_index.fqn]

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        assert tensor.data_ptr() == self.targets[req.dest_index.fqn].data_ptr()
        self.committed.append(req.dest_index.fqn)

    def load_bytes(self, req: ReadItem, value: io.BytesIO) -> None:
        self.loaded_bytes[req.dest_index.fqn] = value.read()


def _write(path: Path, chunks: dict[str, Any]) -> dict[MetadataIndex, _StorageInfo]:
    """One file of back-to-back ``torch.save`` archives (tensors) and raw bytes, as
    ``FileSystemWriter`` writes them; returns its storage_data."""
    storage = {}
    with path.open("wb") as f:
        for name, value in chunks.items():
            offset = f.tell()
            if isinstance(value, bytes):
                f.write(value)
            else:
                torch.save(value, f)
            storage[MetadataIndex(name)] = _StorageInfo(FILE, offset, f.tell() - offset)
    return storage


def _item(name: str, starts: tuple[int, ...], lengths: tuple[int, ...]) -> ReadItem:
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(name),
        dest_offsets=torch.Size([0] * len(starts)),
        storage_index=MetadataIndex(name),
        storage_offsets=torch.Size(starts),
        lengths=torch.Size(lengths),
    )


def _narrow(t: torch.Tensor, starts: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    for dim, (a, n) in enumerate(zip(starts, lengths, strict=True)):
        t = t.narrow(dim, a, n)
    return t


def _chunks() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(12, 10, generator=gen)
    return {
        "rows": base,  # row ranges: one contiguous byte range, read into the target
        "cols": base.clone(),  # a column range: not contiguous, read through a buffer
        "transposed": base.t().contiguous().t(),  # stored column-major, as DCP may keep it
        "channels_last": torch.randn(2, 3, 4, 5, generator=gen).to(
            memory_format=torch.channels_last
        ),
        "bf16": base.to(torch.bfloat16),
        "bool": base > 0,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "bytes": pickle.dumps({"lr": 0.1}),
    }


CASES = [
    ("rows", (3, 0), (5, 10)),
    ("rows", (0, 0), (12, 10)),
    ("cols", (0, 2), (12, 5)),
    ("cols", (4, 3), (2, 4)),
    ("transposed", (2, 0), (4, 10)),
    ("transposed", (0, 1), (12, 3)),
    ("channels_last", (1, 0, 1, 0), (1, 3, 2, 5)),
    ("bf16", (6, 0), (6, 10)),
    ("bool", (1, 0), (3, 10)),
    ("scalar", (), ()),
    ("empty", (0, 0), (0, 4)),
]


@pytest.mark.parametrize("name,starts,lengths", CASES)
def test_each_layout_reads_the_same_values_as_dcp_and_only_the_needed_bytes(
    tmp_path: Path, name: str, starts: tuple[int, ...], lengths: tuple[int, ...]
) -> None:
    chunks = _chunks()
    storage = _write(tmp_path / FILE, chunks)
    expected = _narrow(chunks[name], starts, lengths)
    target = torch.full(lengths, 7, dtype=expected.dtype)
    planner = Planner({name: target})
    with (tmp_path / FILE).open("rb") as f:
        left = read_ranges(lambda _n: f, storage, [_item(name, starts, lengths)], planner)  # type: ignore[arg-type]
    assert left == [] and planner.committed == [name]
    assert torch.equal(target, expected)


def test_a_contiguous_range_is_read_straight_into_the_target(tmp_path: Path) -> None:
    """Rows 10-29 of a 100 x 1000 float tensor are 80,000 of its 400,000 bytes: of the
    storage record, the file is read for those and for the archive's last 4 KiB (where the
    zip reader looks for its directory) only."""
    chunks = {"rows": torch.arange(100_000, dtype=torch.float32).reshape(100, 1000)}
    storage = _write(tmp_path / FILE, chunks)
    with (tmp_path / FILE).open("rb") as f:
        layout = locate(f, storage[MetadataIndex("rows")])
    assert isinstance(layout, Layout)
    assert (layout.dtype, layout.numel, layout.size, layout.stride, layout.offset) == (
        torch.float32,
        100_000,
        (100, 1000),
        (1000, 1),
        0,
    )
    raw = (tmp_path / FILE).read_bytes()[layout.data_start : layout.data_start + 400_000]
    assert torch.equal(
        torch.frombuffer(bytearray(raw), dtype=torch.float32), chunks["rows"].flatten()
    )
    record = range(layout.data_start, layout.data_start + 400_000)

    class Counting(io.FileIO):
        """Counts the bytes of the storage record that any read returns."""

        data_read = 0

        def _count(self, start: int, got: int) -> None:
            hit = range(max(start, record.start), min(start + got, record.stop))
            Counting.data_read += len(hit)

        def readinto(self, b: Any) -> int:
            start = self.tell()
            got = super().readinto(b) or 0
            self._count(start, got)
            return got

        def read(self, size: int = -1) -> bytes:
            start = self.tell()
            data = super().read(size) or b""
            self._count(start, len(data))
            return data

    target = torch.empty(20, 1000)
    planner = Planner({"rows": target})
    with Counting(tmp_path / FILE) as f:
        left = read_ranges(lambda _n: f, storage, [_item("rows", (10, 0), (20, 1000))], planner)  # type: ignore[arg-type]
    assert left == [] and torch.equal(target, chunks["rows"][10:30])
    assert 80_000 <= Counting.data_read <= 80_000 + 4096, Counting.data_read


def test_non_tensor_items_are_handed_to_load_bytes_whole(tmp_path: Path) -> None:
    storage = _write(tmp_path / FILE, {"lr": pickle.dumps(0.1), "w": torch.ones(2)})
    item = ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex("lr"),
        dest_offsets=torch.Size([]),
        storage_index=MetadataIndex("lr"),
        storage_offsets=torch.Size([]),
        lengths=torch.Size([]),
    )
    planner = Planner({})
    with (tmp_path / FILE).open("rb") as f:
        assert read_ranges(lambda _n: f, storage, [item], planner) == []  # type: ignore[arg-type]
    assert pickle.loads(planner.loaded_bytes["lr"]) == 0.1


class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("payload ran",))


@pytest.mark.parametrize(
    "what",
    ["a pickle that names another global", "a big-endian archive", "a transform", "a cast"],
)
def test_what_it_does_not_recognise_is_left_to_dcp(tmp_path: Path, what: str, capsys: Any) -> None:
    value: Any = torch.ones(4, 3)
    if what == "a pickle that names another global":
        value = {"t": torch.ones(4, 3), "p": _Payload()}
    storage = _write(tmp_path / FILE, {"x": value})
    info = storage[MetadataIndex("x")]
    if what == "a big-endian archive":
        raw = bytearray((tmp_path / FILE).read_bytes())
        at = raw.index(b"little", info.offset)
        raw[at : at + 6] = b"bigxyz"  # same length: the archive still parses; the mark differs
        (tmp_path / FILE).write_bytes(bytes(raw))
    if what == "a transform":
        storage[MetadataIndex("x")] = _StorageInfo(FILE, info.offset, info.length, ["zstd"])
    target = torch.zeros(2, 3, dtype=torch.float64 if what == "a cast" else torch.float32)
    planner = Planner({"x": target})
    req = _item("x", (1, 0), (2, 3))
    with (tmp_path / FILE).open("rb") as f:
        left = read_ranges(lambda _n: f, storage, [req], planner)  # type: ignore[arg-type]
    if what == "a cast":  # recognised: read through a buffer and cast like DCP's copy_
        assert left == [] and torch.equal(target, torch.ones(2, 3, dtype=torch.float64))
    else:
        assert left == [req] and planner.committed == [] and torch.equal(target, torch.zeros(2, 3))
    assert "payload ran" not in capsys.readouterr().out  # nothing a crafted pickle names runs


def test_a_file_shorter_than_its_metadata_is_an_error_not_a_partial_load(tmp_path: Path) -> None:
    storage = _write(tmp_path / FILE, {"w": torch.ones(64, 64)})
    with (tmp_path / FILE).open("rb") as f:
        layout = locate(f, storage[MetadataIndex("w")])
    assert layout is not None
    short = io.BytesIO((tmp_path / FILE).read_bytes()[: layout.data_start + 100])
    with pytest.raises(OSError, match="bytes short of what its metadata says"):
        _fill(short, layout, _item("w", (0, 0), (64, 64)), torch.empty(64, 64))
