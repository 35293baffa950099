"""refimpl.demos.io_faults: a flipped bit inside a torch.save file loads silently (torch.load
ignores the zip CRC that zipfile.testzip checks), and an object-store "rename" copies the
commit marker before the data. The injected ENOSPC / EIO are exercised in test_atomic.py and
test_checkpoint.py, where the writers they break are."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from refimpl.checkpoint import load_latest, save_checkpoint
from refimpl.demos.faults import make_state
from refimpl.demos.io_faults import flip_bit_in_record, rename_like_an_object_store


def test_torch_load_ignores_the_crc_that_zipfile_checks(tmp_path: Path) -> None:
    """The chapter's claim: torch.save writes a CRC-32 per record, torch.load never checks it."""
    path = tmp_path / "w.pt"
    w = torch.arange(1000, dtype=torch.float32)
    torch.save({"w": w}, path)
    record = flip_bit_in_record(path, "data/0", offset=4 * 500 + 3)  # exponent byte of w[500]
    loaded = torch.load(path, weights_only=True)["w"]  # no error ...
    assert (loaded != w).nonzero().flatten().tolist() == [500] and loaded[500] == 125.0
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() == record == "w/data/0"  # ... but the CRC names the record
    with pytest.raises(ValueError, match="out of range"):
        flip_bit_in_record(path, "data/0", offset=4000)


def test_an_object_store_rename_copies_the_marker_first(tmp_path: Path) -> None:
    for step in (1, 2):
        save_checkpoint(tmp_path / "ckpt", make_state(step, 100), step)
    step_dir = tmp_path / "ckpt" / "step_00000002"
    staged = step_dir.rename(tmp_path / "staged")
    copied = rename_like_an_object_store(staged, step_dir, crash_after=2)
    assert copied == ["COMMITTED", "MANIFEST.json"] and staged.exists()
    skipped: list[str] = []
    found = load_latest(tmp_path / "ckpt", on_skip=lambda d, why: skipped.append(why))
    assert found is not None and found[0] == 1 and "missing" in skipped[0]
    rename_like_an_object_store(staged, step_dir)  # finishing the copy deletes the source
    assert not staged.exists() and load_latest(tmp_path / "ckpt") is not None
