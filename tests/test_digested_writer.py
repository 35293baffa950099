"""refimpl.sharded._digested_writer: DCP's writer without torch.save's per-record CRC-32, in the
writing thread only, producing files that plain ``dcp.load`` reads."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from refimpl.sharded._digested_writer import DigestedWriter
from refimpl.sharded._low_priority import LowPriorityWriter


def _save_seeing_crc(
    monkeypatch: pytest.MonkeyPatch, writer: Any, elsewhere: list[bool] | None = None
) -> list[bool]:
    """dcp.save a small state with ``writer``; the CRC setting each torch.save call saw. With
    ``elsewhere``, each call also asks a thread started right then what it sees."""
    seen: list[bool] = []
    real_save = torch.save

    def spy(*args: Any, **kwargs: Any) -> None:
        seen.append(torch.serialization.get_crc32_options())
        if elsewhere is not None:
            other = threading.Thread(
                target=lambda: elsewhere.append(torch.serialization.get_crc32_options())
            )
            other.start()
            other.join(10)
        real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", spy)
    state = {"w": torch.arange(6.0), "b": torch.ones(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.save({"model": state}, storage_writer=writer, no_dist=True)
    return seen


@pytest.mark.parametrize("kind", ["digested", "low_priority"])
def test_refimpls_writers_skip_the_crc_only_while_they_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    writer = (DigestedWriter if kind == "digested" else LowPriorityWriter)(tmp_path / "ck")
    seen = _save_seeing_crc(monkeypatch, writer)
    assert seen and not any(seen), seen  # every tensor record written without its CRC-32
    assert torch.serialization.get_crc32_options()  # the caller's setting is back
    out = {"model": {"w": torch.zeros(6), "b": torch.zeros(3)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, checkpoint_id=tmp_path / "ck", no_dist=True)  # plain DCP reads them
    assert torch.equal(out["model"]["w"], torch.arange(6.0))
    assert torch.equal(out["model"]["b"], torch.ones(3))


def test_dcps_own_writer_keeps_the_crc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the spy does see the CRC on for DCP's writer as it comes."""
    seen = _save_seeing_crc(monkeypatch, FileSystemWriter(tmp_path / "ck"))
    assert seen and all(seen), seen


def test_another_threads_torch_save_keeps_its_crc_during_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The override is per thread: while the writer writes with the CRC off, another thread
    (a training thread's torch.save, say) still computes it."""
    elsewhere: list[bool] = []
    seen = _save_seeing_crc(monkeypatch, DigestedWriter(tmp_path / "ck"), elsewhere)
    assert seen and not any(seen), seen
    assert elsewhere and all(elsewhere) and len(elsewhere) == len(seen), elsewhere
