"""refimpl.atomic: a crash or a failing disk leaves the old file or the new one, never a mix,
and never a temporary file behind."""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from refimpl._publish import OWNER
from refimpl.atomic import (
    COMMIT_MARKER,
    TEMP_TAG,
    atomic_dir,
    atomic_save,
    atomic_write,
    atomic_write_bytes,
    remove_stale_temps,
)
from refimpl.demos.io_faults import inject_io_error, trace_io

DEAD_PID = 2**22 + 7  # above Linux's largest pid_max: no process can have it


def _temps(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if TEMP_TAG in p.name)


def test_atomic_save_round_trips_and_leaves_no_temp(tmp_path: Path) -> None:
    state = {"w": torch.arange(10.0), "step": 3}
    out = atomic_save(state, tmp_path / "ckpt.pt")
    assert out == tmp_path / "ckpt.pt"
    loaded = torch.load(out, weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    assert _temps(tmp_path) == []


def test_the_durable_protocol_runs_in_order(tmp_path: Path) -> None:
    with trace_io() as events:
        atomic_write_bytes(b"new", tmp_path / "f.bin")
    assert events == [
        f"create .f.bin{TEMP_TAG}…",
        "fsync file",
        "os.replace -> f.bin",
        "fsync directory",
    ]


def test_durable_false_skips_only_the_fsyncs(tmp_path: Path) -> None:
    with trace_io() as events:
        atomic_write_bytes(b"x", tmp_path / "f.bin", durable=False)
    assert events == [f"create .f.bin{TEMP_TAG}…", "os.replace -> f.bin"]
    assert (tmp_path / "f.bin").read_bytes() == b"x"


def test_sha256_is_computed_while_writing(tmp_path: Path) -> None:
    import hashlib

    digest = atomic_write(tmp_path / "f.bin", lambda f: f.write(b"abc" * 1000), sha256=True)
    assert digest == hashlib.sha256(b"abc" * 1000).hexdigest()


def test_an_exception_in_the_writer_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def half_then_fail(f):  # type: ignore[no-untyped-def]
        f.write(b"half a new")
        raise ValueError("serialiser crashed")

    with pytest.raises(ValueError, match="serialiser crashed"):
        atomic_write(target, half_then_fail)
    assert target.read_bytes() == b"old"
    assert _temps(tmp_path) == []


@pytest.mark.parametrize(
    ("err", "on"), [(errno.ENOSPC, "write"), (errno.EIO, "write"), (errno.EIO, "fsync")]
)
def test_disk_errors_keep_the_old_file_and_remove_the_temp(
    tmp_path: Path, err: int, on: str
) -> None:
    target = tmp_path / "ckpt.pt"
    atomic_save({"step": 1}, target)
    with inject_io_error(err, after_bytes=100, on=on), pytest.raises(OSError) as info:
        atomic_save({"w": torch.zeros(10_000), "step": 2}, target)
    assert info.value.errno == err
    assert str(target) in str(info.value) and "untouched" in str(info.value)
    assert torch.load(target, weights_only=True) == {"step": 1}
    assert _temps(tmp_path) == []


def test_a_disk_full_message_gives_one_fact_per_line_that_fits_a_page(tmp_path: Path) -> None:
    """Chapter 5 prints it: the errno, the file, what was kept, what to do, each on a line of
    at most 100 columns once the directory is shortened (as the chapter shortens it)."""
    target = tmp_path / "ckpt.pt"
    atomic_save({"step": 1}, target)
    with inject_io_error(errno.ENOSPC, after_bytes=100), pytest.raises(OSError) as info:
        atomic_save({"w": torch.zeros(10_000)}, target)
    lines = str(info.value).replace(str(tmp_path), "WORK").splitlines()
    assert lines == [
        "[Errno 28] atomic write of WORK/ckpt.pt failed (No space left on device);",
        "the previous ckpt.pt is untouched and the temporary file was removed.",
        "Free some space (or raise the quota), then save again",
    ]
    assert max(map(len, lines)) <= 100


def test_atomic_dir_publishes_everything_with_the_marker_last(tmp_path: Path) -> None:
    final = tmp_path / "step_1"
    with atomic_dir(final) as tmp:
        assert tmp.parent == tmp_path and not final.exists()
        (tmp / "a.bin").write_bytes(b"a")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(b"b")
    assert sorted(p.name for p in final.rglob("*")) == [COMMIT_MARKER, "a.bin", "b.bin", "sub"]
    assert _temps(tmp_path) == []


def test_atomic_dir_publishes_nothing_if_the_block_fails(tmp_path: Path) -> None:
    final = tmp_path / "step_1"
    with pytest.raises(RuntimeError, match="mid-save"), atomic_dir(final) as tmp:
        (tmp / "a.bin").write_bytes(b"a")
        raise RuntimeError("mid-save")
    assert not final.exists()
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_refuses_an_existing_target(tmp_path: Path) -> None:
    (tmp_path / "step_1").mkdir()
    with pytest.raises(FileExistsError, match="already exists"), atomic_dir(tmp_path / "step_1"):
        pass


def _temp(directory: Path, target: str, pid: int, owner: str = OWNER) -> Path:
    return directory / f".{target}{TEMP_TAG}{owner}-{pid}-abcd1234"


def test_stale_temps_of_dead_writers_are_removed_live_ones_kept(tmp_path: Path) -> None:
    dead_file = _temp(tmp_path, "ckpt.pt", DEAD_PID)
    dead_dir = _temp(tmp_path, "step_00000001", DEAD_PID)
    live = _temp(tmp_path, "ckpt.pt", os.getpid())
    dead_file.write_bytes(b"torn")
    dead_dir.mkdir()
    (dead_dir / "model.pt").write_bytes(b"torn")
    live.write_bytes(b"in progress")
    (tmp_path / "ckpt.pt").write_bytes(b"keep")
    assert remove_stale_temps(tmp_path) == sorted([dead_file, dead_dir])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "ckpt.pt"])


def test_only_provably_ours_and_dead_is_deleted(tmp_path: Path) -> None:
    """A user's file that merely contains .tmp-, a temp from an older refimpl (no owner tag),
    and a dead-looking temp of a writer in another container (another owner tag, whose pid
    means nothing here) all survive."""
    keep = [
        tmp_path / ".notes.tmp-draft",
        tmp_path / f".ckpt.pt{TEMP_TAG}{DEAD_PID}-abcd",  # old format: owner unknown
        _temp(tmp_path, "ckpt.pt", DEAD_PID, owner="0badc0de"),  # another PID namespace
    ]
    for p in keep:
        p.write_bytes(b"not ours")
    assert remove_stale_temps(tmp_path) == []
    assert sorted(tmp_path.iterdir()) == sorted(keep)


def test_a_killed_writers_temp_is_reaped_by_the_next_write_of_that_file(tmp_path: Path) -> None:
    stale = _temp(tmp_path, "model.pt", DEAD_PID)
    stale.write_bytes(b"x" * 1000)
    other = _temp(tmp_path, "other.pt", DEAD_PID)
    other.write_bytes(b"y")
    atomic_save({"w": 1}, tmp_path / "model.pt")
    assert not stale.exists() and other.exists()  # only the same target's temps


def test_names_near_the_length_limit_work(tmp_path: Path) -> None:
    for length in (236, 250, 255):
        name = "m" * (length - 3) + ".pt"
        atomic_save({"n": length}, tmp_path / name)
        assert torch.load(tmp_path / name)["n"] == length
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_the_target_keeps_its_mode(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_bytes(b"old")
    secret.chmod(0o600)
    atomic_write_bytes(b"new", secret)
    assert secret.read_bytes() == b"new" and (secret.stat().st_mode & 0o777) == 0o600


def test_a_symlink_is_followed_and_kept(tmp_path: Path) -> None:
    real = tmp_path / "real.bin"
    real.write_bytes(b"old")
    link = tmp_path / "link.bin"
    link.symlink_to(real.name)
    atomic_write_bytes(b"new", link)
    assert link.is_symlink() and real.read_bytes() == b"new"


def test_ctrl_c_mid_write_is_a_keyboard_interrupt_and_leaves_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    atomic_save({"v": 1}, target)

    class _InterruptedFile:
        def __init__(self, f: Any) -> None:
            self.f, self.n = f, 0

        def write(self, data: Any) -> int:
            self.n += len(data)
            if self.n > 1 << 16:
                raise KeyboardInterrupt
            return int(self.f.write(data))

        def flush(self) -> None:
            self.f.flush()

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, lambda f: torch.save(torch.zeros(1 << 18), _InterruptedFile(f)))
    assert torch.load(target) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_ranks_saving_to_the_same_path_never_tear_it(tmp_path: Path) -> None:
    from workers import sync as sync_workers

    from refimpl.launch import spawn

    target = tmp_path / "shared.pt"
    assert spawn(sync_workers.hammer_one_file, 3, str(target), 30, timeout_s=60) == [30] * 3
    final = torch.load(target, weights_only=True)
    # The last rename overall is some rank's last save: a complete state, never a mix.
    assert final["i"] == 29 and final["rank"] in (0, 1, 2)
    assert torch.equal(final["w"], torch.full((50_000,), float(final["rank"])))
    assert _temps(tmp_path) == []


def test_save_benchmark_writes_json_and_png(tmp_path: Path) -> None:
    import json

    from refimpl.bench.save import main

    assert main(["--out", str(tmp_path), "--mb", "1", "--repeats", "5", "--quiet"]) == 0
    data = json.loads((tmp_path / "save.json").read_text())
    assert {"memcpy", "write+fsync", "torch.save+fsync", "atomic_save"} <= set(data["seconds"])
    assert all(
        s["n"] == 5 and s["min"] <= s["median"] <= s["max"] for s in data["seconds"].values()
    )
    assert data["ratios"]["atomic_save / torch.save+fsync"] > 0
    assert (tmp_path / "save.png").stat().st_size > 0
    assert not (tmp_path / "_scratch").exists()


def test_a_failed_directory_fsync_is_not_reported_as_an_untouched_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the directory sync failed: the new file is in place, and the error must say so."""
    import refimpl.atomic as atomic

    def failing_dir_sync(path: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(atomic, "fsync_dir", failing_dir_sync)
    target = tmp_path / "f.bin"
    with pytest.raises(OSError, match="may not survive a power cut") as info:
        atomic_write_bytes(b"new", target)
    assert info.value.errno == errno.EIO
    assert target.read_bytes() == b"new" and _temps(tmp_path) == []


def test_xxh3_is_computed_while_writing(tmp_path: Path) -> None:
    import xxhash

    digest = atomic_write(tmp_path / "f.bin", lambda f: f.write(b"abc" * 1000), digest="xxh3_128")
    assert digest == xxhash.xxh3_128(b"abc" * 1000).hexdigest()


# --- Issue 19: hard links, and messages that say what really failed -----------------------


def test_replacing_a_hard_linked_file_warns_and_keeps_both_versions(tmp_path: Path) -> None:
    """A rename gives the name a new inode, so the link is split: the other name keeps the old
    bytes (no work lost either way), and the caller is told, not left to find out."""
    target, other = tmp_path / "w.pt", tmp_path / "w-link.pt"
    atomic_save({"v": 1}, target)
    os.link(target, other)
    with pytest.warns(RuntimeWarning, match=r"2 hard links.*w-link|other 1 name"):
        atomic_save({"v": 2}, target)
    assert torch.load(target) == {"v": 2} and torch.load(other) == {"v": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one name again: no warning
        atomic_save({"v": 3}, target)


def test_a_missing_directory_is_named_not_the_temporary_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        atomic_save({"v": 1}, tmp_path / "nodir" / "w.pt")
    text = str(info.value).replace(str(tmp_path), "TMP")
    assert TEMP_TAG not in text and "TMP/nodir does not exist" in text, text


class _SecretStore:
    """Pickling it raises an OSError that has nothing to do with the disk."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        raise PermissionError(13, "no access to the secret store")


def test_a_serialisation_error_is_not_reported_as_a_disk_or_permission_problem(
    tmp_path: Path,
) -> None:
    target = tmp_path / "w.pt"
    atomic_save({"v": 1}, target)
    with pytest.raises(PermissionError) as info:
        atomic_save({"s": _SecretStore()}, target)
    text = str(info.value).replace(str(tmp_path), "TMP")
    assert "no access to the secret store" in text, text
    assert "atomic write" not in text and "permissions" not in text and "disk" not in text, text
    assert torch.load(target) == {"v": 1} and [p.name for p in tmp_path.iterdir()] == ["w.pt"]


def test_a_non_disk_error_does_not_say_check_the_disk(tmp_path: Path) -> None:
    (tmp_path / "adir").mkdir()
    with pytest.raises(IsADirectoryError) as info:
        atomic_save({"v": 1}, tmp_path / "adir")
    text = str(info.value).replace(str(tmp_path), "TMP")
    assert "disk" not in text and "is a directory" in text and TEMP_TAG not in text, text


def test_a_failed_parent_fsync_after_atomic_dir_published_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """atomic_dir publishes through the same layer as both checkpoint formats: when only the
    parent's fsync fails, the directory is in place and the error says it may not survive."""
    from refimpl._system import disk

    real = disk.fsync_dir

    def failing_parent_sync(path: str | os.PathLike[str]) -> None:
        if Path(path) == tmp_path:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(path)

    monkeypatch.setattr(disk, "fsync_dir", failing_parent_sync)
    with (
        pytest.raises(OSError, match="may not survive a power cut") as info,
        atomic_dir(tmp_path / "d") as tmp,
    ):
        (tmp / "x").write_bytes(b"x")
    assert info.value.errno == errno.EIO
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [COMMIT_MARKER, "x"]
    assert _temps(tmp_path) == []
