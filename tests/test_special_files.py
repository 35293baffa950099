"""A FIFO, or a link to /dev/zero, in place of a checkpoint's small files must not block (or
fill memory) in any reader: load_sharded, load_latest, check_metadata and the CLI refuse it at
once, naming what they found. The CLI checks sharded steps as sharded steps and does not
count bytes outside a step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.sharded_models import trained

from refimpl.atomic import COMMIT_MARKER
from refimpl.checkpoint import MANIFEST, load_latest, save_checkpoint
from refimpl.sharded import ShardedCheckpointError, load_sharded, save_sharded
from refimpl.sharded._dcp_metadata import check_metadata


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _to_dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


SPECIAL: dict[str, tuple[Callable[[Path], None], str]] = {
    "fifo": (_fifo, "a FIFO (named pipe), not a regular file"),
    "dev_zero_link": (_to_dev_zero, "a symbolic link, not a regular file"),
}


def _cli(*args: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "refimpl.checkpoint", *args],
        capture_output=True,
        text=True,
        timeout=60,  # before the fix: blocked on the FIFO until this killed it
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", list(SPECIAL))
def test_sharded_manifest_fifo_or_device_link_is_skipped_at_once(tmp_path: Path, kind: str) -> None:
    make, found = SPECIAL[kind]
    model, opt = trained()
    save_sharded(tmp_path, model, opt, 1)
    step2 = save_sharded(tmp_path, model, opt, 2)
    make(step2 / MANIFEST)
    skipped: dict[str, str] = {}
    step = load_sharded(tmp_path, *trained(1), on_skip=lambda d, w: skipped.__setitem__(d.name, w))
    assert step == 1 and found in skipped["step_00000002"]
    code, out = _cli("verify", str(step2))
    assert code == 1 and found in out, out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", list(SPECIAL))
def test_file_manifest_fifo_or_device_link_is_skipped_at_once(tmp_path: Path, kind: str) -> None:
    make, found = SPECIAL[kind]
    save_checkpoint(tmp_path, {"model": {"w": torch.ones(2)}}, 1)
    step2 = save_checkpoint(tmp_path, {"model": {"w": torch.zeros(2)}}, 2)
    make(step2 / MANIFEST)
    skipped: list[str] = []
    found_step = load_latest(tmp_path, on_skip=lambda _d, why: skipped.append(why))
    assert found_step is not None and found_step[0] == 1
    assert found in skipped[0]
    code, out = _cli("list", str(tmp_path))
    assert code == 1 and found in out, out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", list(SPECIAL))
def test_metadata_and_marker_fifo_or_device_link_are_refused_at_once(
    tmp_path: Path, kind: str
) -> None:
    make, found = SPECIAL[kind]
    model, opt = trained()
    step1 = save_sharded(tmp_path, model, opt, 1)
    make(step1 / ".metadata")
    with pytest.raises(OSError, match=re.escape(found)):
        check_metadata(step1 / ".metadata")  # what every rank runs before DCP opens it
    step2 = save_sharded(tmp_path, model, opt, 2)
    make(step2 / COMMIT_MARKER)
    skipped: dict[str, str] = {}
    # Step 1 is committed but unloadable: an error, never a silent fresh start (issue 20).
    with pytest.raises(ShardedCheckpointError, match="no committed step can be loaded"):
        load_sharded(tmp_path, *trained(1), on_skip=lambda d, w: skipped.__setitem__(d.name, w))
    assert "no COMMITTED marker" in skipped["step_00000002"]
    assert "not a regular file" in skipped["step_00000001"]


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_cli_checks_sharded_steps_as_sharded_and_sizes_stay_inside(tmp_path: Path) -> None:
    model, opt = trained()
    for step in (1, 2):
        step_dir = save_sharded(tmp_path, model, opt, step)
    code, out = _cli("list", str(tmp_path))
    assert code == 0 and out.count("verified") == 2, out  # before: "BAD: ... format ..."
    size_line = out.splitlines()[1]
    code, out = _cli("verify", str(tmp_path))
    assert code == 0 and out.count("OK") == 2, out
    code, out = _cli("inspect", str(step_dir))
    assert code == 0 and "format refimpl.sharded/1" in out, out
    assert "model.0.weight: tensor (20, 12) float32" in out, out
    assert "optim.state.0.weight.exp_avg: tensor (20, 12) float32" in out, out

    big = tmp_path.parent / f"{tmp_path.name}_outside.bin"
    big.write_bytes(b"\0" * (8 << 20))
    (step_dir / "outside_link").symlink_to(big)  # a stray link: ignored, and not counted
    (step_dir / "outside_dir").symlink_to(tmp_path.parent, target_is_directory=True)
    code, out = _cli("list", str(tmp_path))
    assert code == 0 and out.splitlines()[1] == size_line, out  # before: 8.0 MiB more
    (step_dir / "__0_0.distcp").write_bytes(b"x")
    code, out = _cli("verify", str(step_dir))
    assert code == 1 and "size 1 bytes" in out, out
    big.unlink()
