"""refimpl.checkpoint: only complete, verified checkpoints are loaded; every corruption is
named; load_latest falls back and says why; nothing is ever unpickled unsafely."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from refimpl._publish import OWNER
from refimpl.atomic import COMMIT_MARKER, TEMP_TAG
from refimpl.checkpoint import (
    MANIFEST,
    PACK,
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    safe_load,
    save_checkpoint,
    step_dir_name,
    verify_checkpoint,
)
from refimpl.demos.faults import make_state
from refimpl.demos.io_faults import inject_io_error, trace_io

DEAD_PID = 2**22 + 7


def _steps(d: Path) -> list[int]:
    return [s for s, _ in list_checkpoints(d)]


def _same(a: dict, b: dict) -> bool:  # type: ignore[type-arg]
    return a["meta"] == b["meta"] and torch.equal(a["model"]["w"], b["model"]["w"])


def test_save_then_load_latest_round_trips(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state(7, 100), 7)
    assert path == tmp_path / "step_00000007"
    # One file holds every key (format 3): one creation and one fsync, however many keys.
    assert sorted(p.name for p in path.iterdir()) == [COMMIT_MARKER, MANIFEST, PACK]
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["step"] == 7 and sorted(manifest["files"]) == [PACK]
    assert sorted(manifest["keys"]) == ["meta", "model"]
    step, state = load_latest(tmp_path)  # type: ignore[misc]
    assert step == 7 and _same(state, make_state(7, 100))


def test_empty_or_missing_directory_loads_nothing(tmp_path: Path) -> None:
    assert load_latest(tmp_path / "nope") is None
    assert load_latest(tmp_path) is None


def test_keep_last_keeps_the_newest_n(tmp_path: Path) -> None:
    for step in range(1, 6):
        save_checkpoint(tmp_path, make_state(step, 10), step, keep_last=2)
    assert _steps(tmp_path) == [4, 5]
    save_checkpoint(tmp_path, make_state(6, 10), 6, keep_last=1)
    assert _steps(tmp_path) == [6]


def test_keep_last_never_deletes_newer_steps_than_the_one_saved(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, make_state(step, 10), step, keep_last=None)
    # A resumed run saves step 15: step 30 (newer, from the earlier run) is left alone.
    save_checkpoint(tmp_path, make_state(15, 10), 15, keep_last=1)
    assert _steps(tmp_path) == [15, 20, 30]
    assert load_latest(tmp_path)[0] == 30  # type: ignore[index]


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"meta": {"v": 1}}, 3)
    save_checkpoint(tmp_path, {"meta": {"v": 2}}, 3)
    assert load_latest(tmp_path) == (3, {"meta": {"v": 2}})
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000003"]


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-100])


def _flip_bit(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _wrong_manifest(step_dir: Path) -> None:
    m = json.loads((step_dir / MANIFEST).read_text())
    entry = m["files"][PACK]
    entry[next(k for k in entry if k != "bytes")] = "0" * 32
    (step_dir / MANIFEST).write_text(json.dumps(m))


CORRUPTIONS = {
    "truncated": (lambda d: _truncate(d / PACK), PACK, "manifest says"),
    "flipped bit": (lambda d: _flip_bit(d / PACK), PACK, "xxh3_128 mismatch"),
    "missing file": (lambda d: (d / PACK).unlink(), PACK, "missing"),
    "manifest mismatch": (_wrong_manifest, PACK, "xxh3_128 mismatch"),
    "no manifest": (lambda d: (d / MANIFEST).unlink(), MANIFEST, "manifest missing"),
    "no marker": (lambda d: (d / COMMIT_MARKER).unlink(), "step_00000002", "incomplete"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruption_is_named_and_load_latest_falls_back(tmp_path: Path, kind: str) -> None:
    corrupt, bad_name, why = CORRUPTIONS[kind]
    save_checkpoint(tmp_path, make_state(1, 1000), 1)
    newest = save_checkpoint(tmp_path, make_state(2, 1000), 2)
    corrupt(newest)
    with pytest.raises(CheckpointError, match=why) as info:
        verify_checkpoint(newest)
    assert info.value.path.name == bad_name
    skipped: list[tuple[str, str]] = []
    found = load_latest(tmp_path, on_skip=lambda d, r: skipped.append((d.name, r)))
    assert found is not None and found[0] == 1 and _same(found[1], make_state(1, 1000))
    assert len(skipped) == 1 and skipped[0][0] == "step_00000002"
    assert why in skipped[0][1] and (bad_name in skipped[0][1] or bad_name == "step_00000002")


def test_default_fallback_report_is_a_logged_warning(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    save_checkpoint(tmp_path, make_state(1, 10), 1)
    _flip_bit(save_checkpoint(tmp_path, make_state(2, 10), 2) / PACK)
    assert load_latest(tmp_path)[0] == 1  # type: ignore[index]
    assert "skipped step_00000002" in caplog.text and "xxh3_128 mismatch" in caplog.text


def test_every_checkpoint_corrupt_loads_nothing_and_says_so(tmp_path: Path) -> None:
    for step in (1, 2):
        _truncate(save_checkpoint(tmp_path, make_state(step, 100), step) / PACK)
    skipped: list[str] = []
    assert load_latest(tmp_path, on_skip=lambda d, r: skipped.append(d.name)) is None
    assert skipped == ["step_00000002", "step_00000001"]


def test_nothing_is_deserialised_before_it_verifies(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _flip_bit(save_checkpoint(tmp_path, make_state(1, 100), 1) / PACK)
    calls: list[object] = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(a))
    assert load_latest(tmp_path, on_skip=lambda d, r: None) is None
    assert calls == []


@pytest.mark.parametrize(("err", "on"), [(errno.ENOSPC, "write"), (errno.EIO, "fsync")])
def test_disk_errors_keep_the_previous_checkpoint(tmp_path: Path, err: int, on: str) -> None:
    save_checkpoint(tmp_path, make_state(1, 1000), 1)
    with inject_io_error(err, after_bytes=500, on=on), pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, make_state(2, 1000), 2)
    assert "step_00000002" in str(info.value) and os.strerror(err) in str(info.value)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # no temps left
    assert load_latest(tmp_path)[0] == 1  # type: ignore[index]


def test_a_failed_resave_restores_the_old_copy_of_that_step(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"meta": {"v": 1}}, 3)
    with inject_io_error(errno.ENOSPC), pytest.raises(CheckpointError):
        save_checkpoint(tmp_path, {"meta": {"v": 2}}, 3)
    assert load_latest(tmp_path) == (3, {"meta": {"v": 1}})


def test_stale_temps_are_cleaned_on_the_next_save(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, make_state(1, 10), 1)
    stale_dir = tmp_path / f".step_00000002{TEMP_TAG}{OWNER}-{DEAD_PID}-00000001"
    stale_dir.mkdir()
    (stale_dir / "model.pt").write_bytes(b"half")
    (tmp_path / f".MANIFEST.json{TEMP_TAG}{OWNER}-{DEAD_PID}-00000002").write_bytes(b"{")
    assert load_latest(tmp_path)[0] == 1  # type: ignore[index]  # temps are never candidates
    save_checkpoint(tmp_path, make_state(2, 10), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, {"a": 1}, 1, keep_last=0)
    with pytest.raises(ValueError, match="file-name-safe"):
        save_checkpoint(tmp_path, {"../evil": 1}, 1)
    with pytest.raises(ValueError, match="step must be"):
        step_dir_name(-1)


class _RunsACommand:
    """Unpickling this runs a shell command: the classic malicious checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def test_the_crafted_payload_is_live(tmp_path: Path) -> None:
    """Control: full unpickling really runs the command, so the next test proves something."""
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(_RunsACommand(marker)))
    assert marker.exists()


@pytest.mark.parametrize("container", ["torch.save", "raw pickle"])
def test_safe_load_refuses_a_crafted_pickle_and_never_runs_it(
    tmp_path: Path, container: str, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    payload = {"model": {"w": torch.ones(2)}, "extra": _RunsACommand(marker)}
    if container == "torch.save":
        torch.save(payload, evil)
    else:
        evil.write_bytes(pickle.dumps(payload, protocol=2))
    real_load = torch.load
    calls: list[object] = []

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    with pytest.raises(CheckpointError, match="refused") as info:
        safe_load(evil)
    assert info.value.path == evil and "weights_only=False" in str(info.value)
    assert calls == [True]  # one attempt, weights-only, and no retry
    assert not marker.exists()


def test_safe_load_names_a_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    torch.save({"w": torch.ones(1000)}, path)
    _truncate(path)
    with pytest.raises(CheckpointError, match="cannot be read") as info:
        safe_load(path)
    assert info.value.path == path


def test_load_checkpoint_returns_every_key(tmp_path: Path) -> None:
    state = {"model": {"w": torch.ones(3)}, "optim": {"lr": 0.1}, "meta": {"step": 4}}
    loaded = load_checkpoint(save_checkpoint(tmp_path, state, 4))
    assert sorted(loaded) == ["meta", "model", "optim"] and loaded["optim"] == {"lr": 0.1}


def test_every_file_and_directory_is_fsynced_before_the_step_is_published(tmp_path: Path) -> None:
    with trace_io() as events:
        save_checkpoint(tmp_path, make_state(1, 10), 1)
    fsyncs = [e for e in events if e.startswith("fsync")]
    # state.pack, MANIFEST.json, COMMITTED; then the step directory; then, after the rename,
    # its parent.
    assert fsyncs == ["fsync file"] * 3 + ["fsync directory"] * 2


# --- Issue 14 / 13: a re-save never loses the committed copy ------------------------------


@pytest.mark.slow
def test_resave_killed_at_random_points_never_loses_the_step(tmp_path: Path) -> None:
    """SIGKILL a process that re-saves step 3 (8 MB) at random moments: step 3 always loads,
    as the old copy or the new one, never falls back to an older step or to nothing."""
    import multiprocessing as mp
    import random
    import time

    from workers.launch import resave_forever

    from refimpl.launch._spawn import _forkserver_preload

    # Each saver is forked from a server that has torch imported: ~10 ms to start instead of
    # the ~2 s of a fresh interpreter, so the kills land in saves, not in imports.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_forkserver_preload())
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, make_state(3, 1 << 21), 3)
    rng = random.Random(0)
    outcomes, torn = set(), 0
    for i in range(12):
        started = tmp_path / f"started{i}"
        child = ctx.Process(target=resave_forever, args=(str(ckpt), str(started)))
        child.start()
        deadline = time.monotonic() + 60
        while not started.exists() and child.is_alive():
            assert time.monotonic() < deadline, "the saver never started"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.6))  # an 8 MB save takes tens of ms here
        child.kill()  # SIGKILL
        child.join()
        assert child.exitcode == -9, child.exitcode
        torn += any(not p.name.startswith("step_") for p in ckpt.iterdir())
        found = load_latest(ckpt)
        assert found is not None and found[0] == 3, found
        outcomes.add(int(found[1]["meta"]["step"]))
    assert outcomes <= {3, 4}
    assert torn >= 3, f"only {torn} of 12 kills left a save unfinished: they missed the saves"
    save_checkpoint(ckpt, make_state(5, 10), 5)  # the next save reaps the dead temps
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000003", "step_00000005"]


@pytest.mark.parametrize(
    "bad_value",
    [lambda: 1, Path("/data/x"), __import__("numpy").float64(0.5), frozenset({1})],
    ids=["function", "pathlib.Path", "np.float64", "frozenset"],
)
def test_an_unloadable_state_is_refused_before_anything_is_written_or_pruned(
    tmp_path: Path, bad_value: object
) -> None:
    save_checkpoint(tmp_path, {"meta": {"v": 1}}, 3)
    before = sorted(p.name for p in tmp_path.iterdir())
    state = {"meta": {"v": 2, "extra": [1, {"bad": bad_value}]}}
    with pytest.raises(CheckpointError, match=r"state\['meta'\]\['extra'\]\[1\]\['bad'\]") as info:
        save_checkpoint(tmp_path, state, 3, keep_last=1)
    assert "weights_only" in str(info.value) and "Fix:" in str(info.value)
    with pytest.raises(CheckpointError):
        save_checkpoint(tmp_path, state, 4, keep_last=1)  # a new step: nothing pruned either
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert load_latest(tmp_path) == (3, {"meta": {"v": 1}})


def test_numpy_and_tensor_steps_are_accepted_floats_refused(tmp_path: Path) -> None:
    import numpy as np

    assert save_checkpoint(tmp_path, {"m": 1}, np.int64(3)).name == "step_00000003"  # type: ignore[arg-type]
    assert save_checkpoint(tmp_path, {"m": 2}, torch.tensor(3)).name == "step_00000003"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="integer"):
        save_checkpoint(tmp_path, {"m": 3}, 3.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, {"m": 3}, 4, keep_last=1.5)  # type: ignore[arg-type]
    assert load_latest(tmp_path) == (3, {"m": 2})
    assert _steps(tmp_path) == [3]


def test_ctrl_c_during_a_resave_keeps_the_old_copy(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    save_checkpoint(tmp_path, {"meta": {"v": 1}}, 3)
    import refimpl.checkpoint._files as ck

    def interrupted(f, state, on_key=None):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(ck, "write_pack", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, {"meta": {"v": 2}}, 3)
    monkeypatch.undo()
    assert load_latest(tmp_path) == (3, {"meta": {"v": 1}})
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000003"]


def test_two_writers_of_one_step_both_finish_and_the_step_loads(tmp_path: Path) -> None:
    import threading

    errors: list[BaseException] = []

    def writer(v: int) -> None:
        try:
            for _ in range(10):
                save_checkpoint(tmp_path, {"meta": {"v": v}}, 7)
        except BaseException as exc:  # pragma: no cover - the failure being tested for
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(v,)) for v in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    found = load_latest(tmp_path)
    assert found is not None and found[0] == 7 and found[1]["meta"]["v"] in (1, 2)


# --- load_latest falls back; it never crashes on a damaged newest step -------------------


def _edit_manifest(step_dir: Path, edit) -> None:  # type: ignore[no-untyped-def]
    m = json.loads((step_dir / MANIFEST).read_text())
    text = edit(m)
    (step_dir / MANIFEST).write_text(text if isinstance(text, str) else json.dumps(m))


HOSTILE_MANIFESTS = {
    "files is a list": lambda m: m.update(files=list(m["files"])),
    "bytes Infinity": lambda m: json.dumps(m).replace('"bytes": ', '"bytes": Infinity, "x": '),
    "deeply nested": lambda m: "[" * 100_000 + "]" * 100_000,
    "absolute path": lambda m: m["files"].update({"/etc/passwd": m["files"][PACK]}),
    "parent path": lambda m: m["files"].update({"../model.pt": m["files"][PACK]}),
    "omits a file": lambda m: m["files"].pop(PACK),
    "key points at another's bytes": lambda m: m["keys"]["meta"].update(m["keys"]["model"]),
    "key range past the end": lambda m: m["keys"]["meta"].update(bytes=10**9),
    "no table of keys": lambda m: m.pop("keys"),
    "future format": lambda m: m.update(format=99),
    "not an object": lambda m: "[1, 2]",
    "bytes negative": lambda m: m["files"][PACK].update(bytes=-1),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_MANIFESTS))
def test_a_hostile_manifest_is_skipped_with_a_reason(tmp_path: Path, kind: str) -> None:
    save_checkpoint(tmp_path, make_state(1, 100), 1)
    newest = save_checkpoint(tmp_path, make_state(2, 100), 2)
    _edit_manifest(newest, HOSTILE_MANIFESTS[kind])
    skipped: list[str] = []
    found = load_latest(tmp_path, on_skip=lambda d, why: skipped.append(f"{d.name}: {why}"))
    assert found is not None and found[0] == 1
    assert len(skipped) == 1 and skipped[0].startswith("step_00000002") and "manifest" in skipped[0]


def test_an_io_error_while_hashing_falls_back(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import refimpl.checkpoint._files as ck

    save_checkpoint(tmp_path, make_state(1, 100), 1)
    save_checkpoint(tmp_path, make_state(2, 100), 2)
    real = ck._digest_file

    def failing(path: Path, algorithm: str) -> str:
        if "step_00000002" in str(path):
            raise OSError(errno.EUCLEAN, "Structure needs cleaning", str(path))
        return real(path, algorithm)

    monkeypatch.setattr(ck, "_digest_file", failing)
    skipped: list[str] = []
    assert load_latest(tmp_path, on_skip=lambda d, why: skipped.append(why))[0] == 1  # type: ignore[index]
    assert "Structure needs cleaning" in skipped[0]


@pytest.mark.parametrize("exc", [IndexError, TypeError, KeyError, AttributeError, OverflowError])
def test_whatever_a_crafted_file_makes_torch_raise_is_a_checkpoint_error(
    tmp_path: Path,
    monkeypatch,
    exc: type,  # type: ignore[no-untyped-def]
) -> None:
    path = tmp_path / "x.pt"
    torch.save({"a": 1}, path)

    def crafted(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise exc("index out of range in a crafted record")

    monkeypatch.setattr(torch, "load", crafted)
    with pytest.raises(CheckpointError, match="cannot be read"):
        safe_load(path)


def test_hash_consistent_garbage_falls_back(tmp_path: Path) -> None:
    import hashlib

    save_checkpoint(tmp_path, make_state(1, 100), 1)
    newest = save_checkpoint(tmp_path, make_state(2, 100), 2)
    garbage = b"PK\x03\x04" + os.urandom(2000)
    (newest / PACK).write_bytes(garbage)

    def fix(m):  # type: ignore[no-untyped-def]
        m["files"][PACK] = {"sha256": hashlib.sha256(garbage).hexdigest(), "bytes": 2004}
        m["keys"] = {"model": {"file": PACK, "offset": 0, "bytes": 2004}}

    _edit_manifest(newest, fix)
    assert load_latest(tmp_path, on_skip=lambda d, why: None)[0] == 1  # type: ignore[index]


def test_unicode_digits_are_not_step_numbers(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"m": 1}, 1)
    (tmp_path / "step_\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0669").mkdir()
    assert _steps(tmp_path) == [1]


def test_what_is_not_ours_is_never_deleted(tmp_path: Path) -> None:
    users_step = tmp_path / "step_00000050"  # no commit marker: not written by save_checkpoint
    users_step.mkdir(parents=True)
    (users_step / "notes.txt").write_text("mine")
    draft = tmp_path / ".notes.tmp-draft"
    draft.write_text("mine too")
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, {"m": step}, step, keep_last=1)
    assert users_step.exists() and draft.exists()
    assert _steps(tmp_path) == [3, 50]
    assert load_latest(tmp_path, on_skip=lambda d, why: None) == (3, {"m": 3})


# --- Issue 13: clear messages, versions, subsets, map_location ---------------------------


def test_safe_load_keeps_the_line_naming_the_type_and_no_ansi(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"p": Path("/data")}, path)
    with pytest.raises(CheckpointError) as info:
        safe_load(path)
    text = str(info.value).replace(str(tmp_path), "TMP")
    assert "PosixPath" in text and "safe_globals" in text and "\x1b[" not in text


def test_load_latest_says_what_it_looked_at(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    with caplog.at_level(logging.INFO, logger="refimpl.checkpoint"):
        assert load_latest(tmp_path / "nope") is None
    assert "does not exist" in caplog.text
    ckpt = tmp_path / "run1" / "ckpt"
    step_dir = save_checkpoint(ckpt, {"m": 1}, 1)
    with pytest.raises(CheckpointError, match="one step, not a checkpoint directory"):
        load_latest(step_dir)
    with pytest.raises(CheckpointError, match="did you mean"):
        load_latest(tmp_path / "run1")


def test_manifest_records_format_and_versions(tmp_path: Path) -> None:
    import refimpl

    step_dir = save_checkpoint(tmp_path, {"m": 1}, 1)
    manifest = verify_checkpoint(step_dir)
    assert manifest["format"] == 3 and manifest["torch"] == torch.__version__
    assert manifest["refimpl"] == refimpl.__version__


def test_load_a_subset_of_keys_with_map_location(tmp_path: Path) -> None:
    step_dir = save_checkpoint(tmp_path, {"model": {"w": torch.ones(2)}, "optim": {"s": 1}}, 1)
    assert list(load_checkpoint(step_dir, keys=["model"])) == ["model"]
    loaded = load_checkpoint(step_dir, keys=["model"], map_location=torch.device("cpu"))
    assert torch.equal(loaded["model"]["w"], torch.ones(2))
    with pytest.raises(CheckpointError, match="no key"):
        load_checkpoint(step_dir, keys=["scaler"])


def test_a_format_1_checkpoint_with_sha256_digests_still_loads(tmp_path: Path) -> None:
    import hashlib

    step_dir = save_checkpoint(tmp_path, {"meta": {"v": 1}}, 1)
    # A pack of one key is that key's torch.save archive, the whole file: format 1's meta.pt.
    (step_dir / PACK).rename(step_dir / "meta.pt")

    def to_format_1(m):  # type: ignore[no-untyped-def]
        del m["keys"]
        data = (step_dir / "meta.pt").read_bytes()
        m.update(
            format=1,
            files={"meta.pt": {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}},
        )

    _edit_manifest(step_dir, to_format_1)
    assert load_latest(tmp_path) == (1, {"meta": {"v": 1}})


# --- python -m refimpl.checkpoint ---------------------------------------------------------


def _cli(*args: str) -> tuple[int, str]:
    """``python -m refimpl.checkpoint ARGS`` in this process: its exit status and output."""
    import contextlib
    import io

    from refimpl._checkpoint_cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(args))
    return code, out.getvalue()


def test_cli_list_verify_inspect_on_good_and_corrupted_checkpoints(tmp_path: Path) -> None:
    import subprocess
    import sys

    for step in (100, 200):
        save_checkpoint(tmp_path, {"model": {"w": torch.ones(64, 32)}, "optim": {"s": step}}, step)
    # Once as a reader types it; the other calls run the same main() in this process.
    done = subprocess.run(
        [sys.executable, "-m", "refimpl.checkpoint", "list", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout + done.stderr) == _cli("list", str(tmp_path))
    code, out = _cli("list", str(tmp_path))
    assert code == 0 and out.count("verified") == 2, out
    code, out = _cli("inspect", str(tmp_path / "step_00000200"))
    assert code == 0 and "model.w: tensor (64, 32) float32" in out and "torch 2." in out, out
    code, out = _cli("verify", str(tmp_path / "step_00000200"))
    assert code == 0 and out.startswith("OK"), out

    _flip_bit(tmp_path / "step_00000200" / PACK)
    code, out = _cli("verify", str(tmp_path))
    assert code == 1 and "BAD" in out and f"step_00000200/{PACK}" in out, out
    assert "OK" in out and "step_00000100" in out  # the good step is still reported good
    code, out = _cli("list", str(tmp_path))
    assert code == 1 and "BAD: xxh3_128 mismatch" in out, out
    code, out = _cli("inspect", str(tmp_path / "step_00000200"))
    assert code == 1 and "mismatch" in out, out
    code, out = _cli("verify", str(tmp_path / "empty"))
    assert code == 1 and "nothing to verify" in out, out


@pytest.mark.parametrize(
    "value",
    [{1, 2}, frozenset({1}), bytearray(b"x"), 1 + 2j, __import__("collections").Counter(a=1)],
    ids=["set", "frozenset", "bytearray", "complex", "Counter"],
)
def test_the_pre_save_check_agrees_with_torch_load_itself(tmp_path: Path, value: object) -> None:
    """find_unloadable must refuse exactly what torch.load(weights_only=True) refuses: a value
    it accepts but torch cannot rebuild is a checkpoint that is counted, prunes older steps,
    and never loads."""
    from refimpl._manifest import find_unloadable

    path = tmp_path / "probe.pt"
    torch.save({"v": value}, path)
    try:
        torch.load(path, weights_only=True)
        torch_loads = True
    except Exception:
        torch_loads = False
    assert (find_unloadable({"v": value}) is None) == torch_loads


# --- Issue 19 #3: the non-atomic publish fallback loses no step ---------------------------

_KILLED_MID_FALLBACK = """
import os, sys
from refimpl import _publish
from refimpl.checkpoint import save_checkpoint
_publish._exchange = lambda a, b: False  # NFS, CIFS, many FUSE filesystems: no RENAME_EXCHANGE
real_rename, calls = os.rename, []
def rename(src, dst, *args, **kwargs):
    calls.append(dst)
    if len(calls) == int(sys.argv[2]):  # 2: the old copy is aside, the new one not yet in
        os._exit(9)
    real_rename(src, dst, *args, **kwargs)
os.rename = rename
save_checkpoint(sys.argv[1], {"meta": {"v": 2}}, 8)
"""


@pytest.mark.parametrize(("kill_at", "survivor"), [(2, 1), (3, 2)], ids=["aside", "published"])
def test_a_writer_killed_between_the_fallbacks_two_renames_loses_no_step(
    tmp_path: Path, kill_at: int, survivor: int
) -> None:
    """Where ``renameat2`` cannot exchange, a re-save moves the committed step aside and then
    renames the new copy in. A kill between the two must not hide the step from `load_latest`
    nor let the next save's stale-temp sweep delete it: the aside copy is put back. A kill
    just after the new copy is in leaves the old copy aside: it is removed, the new one kept."""
    import subprocess
    import sys

    save_checkpoint(tmp_path, {"meta": {"v": 1}}, 4)
    save_checkpoint(tmp_path, {"meta": {"v": 1}}, 8)
    cmd = [sys.executable, "-c", _KILLED_MID_FALLBACK, str(tmp_path), str(kill_at)]
    assert subprocess.run(cmd, timeout=60).returncode == 9  # it really died there
    assert load_latest(tmp_path) == (8, {"meta": {"v": survivor}})
    save_checkpoint(tmp_path, {"meta": {"v": 3}}, 9, keep_last=None)  # reaps the dead temps
    assert _steps(tmp_path) == [4, 8, 9]
    assert load_checkpoint(tmp_path / "step_00000008") == {"meta": {"v": survivor}}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000004",
        "step_00000008",
        "step_00000009",
    ]


# --- Issue 19 #4: a tensor subclass is judged as torch.load(weights_only=True) judges it ------


class _TaggedTensor(torch.Tensor):
    """A Python tensor subclass: pickled through ``_rebuild_from_type_v2`` with its class."""


def _tensor_with_path_attribute() -> torch.Tensor:
    t = torch.ones(2)
    t.origin = Path("/data/x")  # type: ignore[attr-defined]  # pickled as the tensor's state
    return t


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda: torch.ones(2).as_subclass(_TaggedTensor), "_TaggedTensor"),
        (_tensor_with_path_attribute, "PosixPath"),
    ],
    ids=["subclass", "attribute"],
)
def test_a_tensor_weights_only_load_refuses_is_refused_before_anything_is_pruned(
    tmp_path: Path, make: object, kind: str
) -> None:
    value = make()  # type: ignore[operator]
    torch.save(value, tmp_path / "probe.pt")
    with pytest.raises(pickle.UnpicklingError):  # torch itself refuses it: the premise
        torch.load(tmp_path / "probe.pt", weights_only=True)
    (tmp_path / "probe.pt").unlink()
    save_checkpoint(tmp_path, {"w": torch.zeros(2)}, 3)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CheckpointError, match=kind) as info:
        save_checkpoint(tmp_path, {"w": {"layer": value}}, 4, keep_last=1)
    assert "state['w']['layer']" in str(info.value) and "refused before writing" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert load_latest(tmp_path)[0] == 3  # type: ignore[index]


def test_parameters_and_allowlisted_tensor_subclasses_are_accepted_and_load(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.ones(2))
    tagged = torch.ones(2).as_subclass(_TaggedTensor)
    with torch.serialization.safe_globals([_TaggedTensor]):
        save_checkpoint(tmp_path, {"p": param, "t": tagged}, 1)
        state = load_latest(tmp_path)[1]  # type: ignore[index]
    assert type(state["p"]) is torch.nn.Parameter and type(state["t"]) is _TaggedTensor


# --- Issue 19: a manifest that disagrees with its directory; messages without temp names ---


def test_a_step_whose_manifest_names_another_step_is_skipped_with_the_reason(
    tmp_path: Path,
) -> None:
    """``cp -r step_00000004 step_00000009``: every digest verifies, but it is not step 9."""
    import shutil

    save_checkpoint(tmp_path, {"meta": {"v": 4}}, 4)
    save_checkpoint(tmp_path, {"meta": {"v": 8}}, 8)
    shutil.copytree(tmp_path / "step_00000004", tmp_path / "step_00000009")
    skipped: list[tuple[str, str]] = []
    found = load_latest(tmp_path, on_skip=lambda d, why: skipped.append((d.name, why)))
    assert found == (8, {"meta": {"v": 8}})
    assert skipped and skipped[0][0] == "step_00000009"
    assert "says step 4" in skipped[0][1] and "step_00000009" in skipped[0][1], skipped


def test_a_failed_save_names_the_step_and_the_key_not_a_temporary_file(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"model": torch.zeros(2)}, 1)
    with inject_io_error(errno.EACCES), pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, {"model": torch.ones(2)}, 2)
    text = str(info.value).replace(str(tmp_path), "TMP")
    assert TEMP_TAG not in text and f"previous {PACK}" not in text, text
    assert "step_00000002" in text and "key 'model'" in text and "permissions" in text, text
    assert "disk" not in text, text


def test_on_load_gets_the_returned_steps_verified_manifest_only(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"model": {"w": torch.zeros(3)}}, 1)
    newest = save_checkpoint(tmp_path, {"model": {"w": torch.ones(3)}}, 2)
    (newest / PACK).write_bytes(b"torn")  # the newest is skipped
    loaded: list[tuple[str, dict]] = []  # type: ignore[type-arg]
    skipped: list[str] = []
    found = load_latest(
        tmp_path,
        on_skip=lambda d, why: skipped.append(d.name),
        on_load=lambda d, m: loaded.append((d.name, m)),
    )
    assert found is not None and found[0] == 1
    assert skipped == ["step_00000002"]
    assert [name for name, _ in loaded] == ["step_00000001"]
    manifest = json.loads((tmp_path / "step_00000001" / MANIFEST).read_text())
    assert loaded[0][1] == manifest and loaded[0][1]["step"] == 1


# --- format 3 (one pack file) reads every older step ---------------------------------------

FORMAT_2_STEP = Path(__file__).parent / "fixtures" / "format2" / "step_00000007"
"""A step written by refimpl at commit c63ba7b (format 2: one KEY.pt per key), committed as is."""


def test_a_format_2_step_written_by_the_old_code_still_loads(tmp_path: Path) -> None:
    shutil.copytree(FORMAT_2_STEP, tmp_path / FORMAT_2_STEP.name)
    assert verify_checkpoint(tmp_path / FORMAT_2_STEP.name)["format"] == 2
    step, state = load_latest(tmp_path)  # type: ignore[misc]
    assert step == 7 and state["meta"] == {"step": 7, "note": "written by refimpl at c63ba7b"}
    assert torch.equal(state["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert list(load_checkpoint(tmp_path / FORMAT_2_STEP.name, keys=["meta"])) == ["meta"]
    # a new save beside it: both load, and pruning counts the old step like any other
    save_checkpoint(tmp_path, {"meta": {"step": 8}}, 8, keep_last=2)
    assert load_latest(tmp_path) == (8, {"meta": {"step": 8}})
    assert load_checkpoint(tmp_path / FORMAT_2_STEP.name)["meta"]["step"] == 7
    save_checkpoint(tmp_path, {"meta": {"step": 9}}, 9, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [8, 9]


def test_load_of_some_keys_unpickles_only_their_ranges(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import refimpl.checkpoint._files as ck

    state = {"model": {"w": torch.ones(1000)}, "optim": {"s": torch.zeros(2000)}, "meta": {"v": 3}}
    step_dir = save_checkpoint(tmp_path, state, 1)
    ranges = verify_checkpoint(step_dir)["keys"]
    read: list[tuple[int, int]] = []
    real = ck._weights_only

    def spy(source, path, map_location):  # type: ignore[no-untyped-def]
        read.append((source._offset, source._length))
        return real(source, path, map_location)

    monkeypatch.setattr(ck, "_weights_only", spy)
    loaded = load_checkpoint(step_dir, keys=["meta", "model"])
    assert loaded == {"meta": {"v": 3}, "model": loaded["model"]}
    assert torch.equal(loaded["model"]["w"], torch.ones(1000))
    assert read == [(ranges[k]["offset"], ranges[k]["bytes"]) for k in ("meta", "model")]


def test_load_latest_keys_reads_the_config_before_the_model_is_built(
    tmp_path: Path,
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    """``load_latest(keys=["config"])``: the newest step's config, and only its range of the
    pack unpickled. A newest step without the key raises naming the keys it has, rather than
    falling back to an older step that has one."""
    import refimpl.checkpoint._files as ck

    save_checkpoint(tmp_path, {"config": {"n_layer": 2}, "model": {"w": torch.ones(9)}}, 1)
    step_dir = save_checkpoint(
        tmp_path, {"config": {"n_layer": 4}, "model": {"w": torch.ones(9)}}, 2
    )
    read: list[int] = []
    real = ck._weights_only

    def spy(source, path, map_location):  # type: ignore[no-untyped-def]
        read.append(source._offset)
        return real(source, path, map_location)

    monkeypatch.setattr(ck, "_weights_only", spy)
    assert load_latest(tmp_path, keys=["config"]) == (2, {"config": {"n_layer": 4}})
    assert read == [verify_checkpoint(step_dir)["keys"]["config"]["offset"]]
    save_checkpoint(tmp_path, {"model": {"w": torch.ones(9)}}, 3)
    with pytest.raises(
        CheckpointError, match=r"step_00000003: no key\(s\) \['config'\]; it has \['model'\]"
    ):
        load_latest(tmp_path, keys=["config"])
