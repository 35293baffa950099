"""Hostile sharded steps: crafted ``.metadata`` pickles and manifests, FIFOs and device links in
place of a checkpoint's files. Each is refused (and an older step loaded) without changing
anything in the process and without blocking."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import os
import pathlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from helpers.sharded_craft import bytes_item_in_place_of
from helpers.sharded_models import fresh, trained
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

import refimpl.sharded._api as sharded_module
from refimpl.checkpoint import MANIFEST, load_latest, save_checkpoint
from refimpl.demos.sharded import full_state, max_abs_diff, train
from refimpl.launch import spawn
from refimpl.sharded import (
    ShardedCheckpointError,
    consolidate,
    load_sharded,
    save_sharded,
    verify_sharded,
)
from refimpl.sharded._commit import digest_files, write_manifest
from refimpl.sharded._paths import Choice


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _str(text: str) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text.encode()


def _build_onto_class(module: str, name: str, attr: str) -> bytes:
    """A pickle that pushes the class ``module.name`` and BUILDs ``{attr: slice}`` onto it as
    slot state, i.e. ``setattr(cls, attr, slice)``: ``Path.is_file()`` would then return a
    (truthy) slice object."""
    state = b"N}" + _str(attr) + _global("builtins", "slice") + b"s\x86"  # (None, {attr: slice})
    return b"\x80\x04" + _global(module, name) + state + b"b."


def _stateless(module: str, name: str) -> bytes:
    """A pickle of ``cls.__new__(cls)`` with no BUILD: an object without its fields."""
    return b"\x80\x04" + _global(module, name) + b")\x81."


def _dcp_classes() -> list[type]:
    return [
        obj
        for module in (dcp_metadata, dcp_filesystem)
        for obj in vars(module).values()
        if isinstance(obj, type) and obj.__module__ == module.__name__
    ]


def _class_attributes() -> dict[type, dict[str, Any]]:
    classes = [pathlib.PosixPath, pathlib.Path, pathlib.PurePosixPath, pathlib.PurePath]
    classes += [torch.Size, collections.OrderedDict, *_dcp_classes()]
    return {cls: dict(vars(cls)) for cls in classes}


def _restore(before: dict[type, dict[str, Any]]) -> None:
    """Undo what a crafted file did to the classes, so a failure here poisons no other test."""
    for cls, attrs in before.items():
        for name in set(vars(cls)) - set(attrs):
            delattr(cls, name)
        for name, value in attrs.items():
            if vars(cls).get(name) is not value and name not in ("__dict__", "__weakref__"):
                setattr(cls, name, value)


def _forge(step_dir: Path, name: str, data: bytes) -> None:
    """Replace ``step_dir/name`` and re-forge the manifest so that every digest matches."""
    (step_dir / name).write_bytes(data)
    step = json.loads((step_dir / MANIFEST).read_bytes())["step"]
    names = sorted(p.name for p in step_dir.iterdir() if p.name not in (MANIFEST, "COMMITTED"))
    write_manifest(step_dir, step, digest_files(step_dir, names), 1)


def _two_steps(root: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, Path]:
    model, opt = trained()
    save_sharded(root, model, opt, 1)
    return model, opt, save_sharded(root, model, opt, 2)


def _load_collecting(root: Path) -> tuple[int | None, dict[str, str], float]:
    model, opt = trained()
    target, target_opt = fresh()
    skipped: dict[str, str] = {}
    step = load_sharded(
        root, target, target_opt, on_skip=lambda d, why: skipped.__setitem__(d.name, why)
    )
    return step, skipped, max_abs_diff(full_state(target, target_opt), full_state(model, opt))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("module", "name", "attr"),
    [
        ("pathlib", "PosixPath", "is_file"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo", "__getstate__"),
        ("torch.distributed.checkpoint.metadata", "Metadata", "__init__"),
    ],
)
def test_a_refused_metadata_leaves_every_class_untouched(
    tmp_path: Path, module: str, name: str, attr: str
) -> None:
    _model, _opt, step2 = _two_steps(tmp_path)
    _forge(step2, ".metadata", _build_onto_class(module, name, attr))
    before = _class_attributes()
    try:
        step, skipped, diff = _load_collecting(tmp_path)
        changed = {
            f"{cls.__qualname__}.{key}"
            for cls, attrs in before.items()
            for key in set(attrs) | set(vars(cls))
            if attrs.get(key) is not vars(cls).get(key) and key != "__dict__"
        }
        assert changed == set()  # before the fix: {'PosixPath.is_file'}, ...
        assert Path("/no/such/file").is_file() is False
        assert Path(__file__).is_file() is True
    finally:
        _restore(before)
    assert step == 1 and diff == 0.0
    assert "sets attributes on a class" in skipped["step_00000002"]
    save_sharded(tmp_path, *trained(), 3)  # later saves still work (_StorageInfo intact)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("crafted", "expect"),
    [
        (_stateless("torch.distributed.checkpoint.metadata", "Metadata"), "without its field"),
        ("stateless item", "without its field"),
    ],
)
def test_crafted_metadata_objects_are_skipped_not_crashed_on(
    tmp_path: Path, crafted: Any, expect: str
) -> None:
    _model, _opt, step2 = _two_steps(tmp_path)
    if crafted == "stateless item":  # a real Metadata with one item built without its fields
        meta = pickle.loads((step2 / ".metadata").read_bytes())
        key = next(iter(meta.state_dict_metadata))
        kind = dcp_metadata.TensorStorageMetadata
        meta.state_dict_metadata[key] = kind.__new__(kind)
        crafted = pickle.dumps(meta, protocol=4)
    _forge(step2, ".metadata", crafted)
    step, skipped, diff = _load_collecting(tmp_path)  # before: AttributeError out of the loader
    assert step == 1 and diff == 0.0
    assert expect in skipped["step_00000002"]


@pytest.mark.timeout(60)
def test_a_deeply_nested_manifest_is_skipped_with_a_reason(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    (tmp_path / "step_00000002" / MANIFEST).write_bytes(b"[" * 100_000 + b"]" * 100_000)
    step, skipped, diff = _load_collecting(tmp_path)  # before: RecursionError
    assert step == 1 and diff == 0.0
    assert "nested too deeply" in skipped["step_00000002"]


def test_build_is_refused_on_anything_but_dcp_dataclass_fields() -> None:
    from refimpl.sharded._dcp_metadata import UnsafeMetadata, parse_metadata

    field_names = {f.name for f in dataclasses.fields(dcp_filesystem._StorageInfo)}
    assert "__class__" not in field_names
    info = pickle.dumps(dcp_filesystem._StorageInfo("__0_0.distcp", 0, 1), protocol=4)
    # The same object with an extra key in its BUILD state: refused by name, not applied.
    forged = info.replace(_str("relative_path"), _str("__class__"), 1)
    with pytest.raises(UnsafeMetadata, match="a state it never has"):
        parse_metadata(forged)
    assert os.path.isfile(__file__)


@pytest.mark.timeout(60)
def test_a_stray_file_leaves_the_step_loadable_an_unlisted_shard_does_not(
    tmp_path: Path,
) -> None:
    _model, _opt, step2 = _two_steps(tmp_path)
    for stray in (".DS_Store", ".MANIFEST.json.swp", "notes.txt"):
        (step2 / stray).write_bytes(b"\0stray")
    step, skipped, diff = _load_collecting(tmp_path)  # before: step 1, "extra ['.DS_Store', ...]"
    assert (step, skipped, diff) == (2, {}, 0.0)
    (step2 / "model.pt").write_bytes(b"\0")  # a .pt a sharded load never opens
    step, skipped, diff = _load_collecting(tmp_path)
    assert (step, skipped, diff) == (2, {}, 0.0)  # before: step 1, "found ['model.pt']"
    (step2 / "__9_0.distcp").write_bytes(b"\0")  # a shard file the manifest does not list
    step, skipped, diff = _load_collecting(tmp_path)
    assert step == 1 and diff == 0.0
    assert "found ['__9_0.distcp'], which the manifest does not list" in skipped["step_00000002"]


@pytest.mark.timeout(60)
def test_consolidate_refuses_an_output_inside_a_step(tmp_path: Path) -> None:
    _model, _opt, step2 = _two_steps(tmp_path)
    (tmp_path / "link").symlink_to(step2, target_is_directory=True)
    for out in (step2 / "model.pt", tmp_path / "link" / "model.pt", step2 / "sub" / "m.pt"):
        with pytest.raises(ValueError, match="is inside the step"):
            consolidate(step2, out)  # before: wrote into the committed step
    with pytest.raises(ValueError, match="inside the checkpoint step"):
        consolidate(step2, tmp_path / "step_00000001" / "model.pt")  # another step
    assert sorted(p.name for p in tmp_path.rglob("*.pt")) == []
    assert consolidate(step2, tmp_path / "model.pt") == tmp_path / "model.pt"  # beside: fine


@pytest.mark.timeout(60)
def test_file_checkpoints_ignore_stray_files_too(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(3.0)}}
    step_dir = save_checkpoint(tmp_path, state, 5)
    (step_dir / ".DS_Store").write_bytes(b"\0")
    found = load_latest(tmp_path)  # before: None ("does not list ['.DS_Store']")
    assert (
        found is not None
        and found[0] == 5
        and torch.equal(found[1]["model"]["w"], state["model"]["w"])
    )
    (step_dir / "optim.pt").write_bytes(b"\0")
    skipped: list[str] = []
    assert load_latest(tmp_path, on_skip=lambda _d, why: skipped.append(why)) is None
    assert "does not list ['optim.pt'], found in the step" in skipped[0]


class _FullDisk:
    """A DCP output stream on a disk with ``room`` bytes left: writes what fits, then ENOSPC."""

    def __init__(self, stream: Any, room: int) -> None:
        self._stream, self._room = stream, room

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) > self._room:
            self._stream.write(view[: self._room])
            self._room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= len(view)
        return int(self._stream.write(view))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@pytest.mark.timeout(60)
def test_a_full_disk_during_a_sharded_save_is_named(tmp_path: Path) -> None:
    model = torch.nn.Linear(128, 128)  # a tensor larger than the stream's buffer
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    real = dcp_filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def full_disk(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with real(self, path, mode) as stream:
            yield _FullDisk(stream, 20_000) if mode == "wb" else stream

    patch = mock.patch.object(dcp_filesystem.FileSystem, "create_stream", full_disk)
    with patch, pytest.raises(ShardedCheckpointError) as info:
        save_sharded(tmp_path, model, opt, 1)
    text = str(info.value)  # before: "rank 0: RuntimeError: ... unexpected pos 704 vs 598)"
    assert "rank 0: OSError: [Errno 28] No space left on device; " in text, text
    assert "bytes free on the filesystem of" in text and "unexpected pos" in text
    assert "Free some space" in text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("racy_s", [None, 0.2], ids=["just-saved", "seen-by-rank-0"])
def test_each_rank_verifies_the_shards_it_reads(tmp_path: Path, racy_s: float | None) -> None:
    """Whether rank 1 hashes its file itself (just saved) or relies on rank 0's record of it
    (`refimpl.sharded._seen`), a byte changed after rank 0's check is caught on rank 1."""
    from workers.sharded import shard_changed_after_rank0_checked

    results = spawn(
        shard_changed_after_rank0_checked,
        2,
        str(tmp_path),
        racy_s,
        timeout_s=100,
        pg_timeout_s=30,
    )
    for rank, (step, diff, skipped) in enumerate(results):
        # before: step 2 loaded on both ranks, rank 1 with the changed bytes
        assert step == 1 and diff == 0.0, (rank, step, skipped)
        assert len(skipped) == 1 and skipped[0].startswith("step_00000002: "), skipped
        assert "rank 1: ShardMismatch: __1_0.distcp has" in skipped[0], skipped
        assert (
            "the manifest rank 0 verified says" in skipped[0] and "Nothing was loaded" in skipped[0]
        )


@pytest.mark.timeout(60)
def test_what_is_loaded_is_what_was_verified_in_one_process(tmp_path: Path) -> None:
    model, opt = trained()
    save_sharded(tmp_path, model, opt, 1)
    train(model, opt, range(3, 5))
    step2 = save_sharded(tmp_path, model, opt, 2)
    verified = dict(verify_sharded(step2)["files"])
    shard_file = step2 / "__0_0.distcp"
    data = bytearray(shard_file.read_bytes())
    data[len(data) // 2] ^= 0x10  # after the check: a plain re-read would load this silently
    real = sharded_module.choose_step

    def verify_then_change(path: Path, below: int | None = None) -> Choice:
        chosen = real(path, below)
        if chosen.step_dir == str(step2):
            shard_file.write_bytes(bytes(data))
        return chosen

    target, target_opt = fresh()
    skipped: dict[str, str] = {}
    with mock.patch.object(sharded_module, "choose_step", verify_then_change):
        step = load_sharded(
            tmp_path, target, target_opt, on_skip=lambda d, w: skipped.__setitem__(d.name, w)
        )
    assert step == 1, skipped
    assert "ShardMismatch: __0_0.distcp" in skipped["step_00000002"]
    assert verified["__0_0.distcp"]["xxh3_128"] in skipped["step_00000002"]
    reference, reference_opt = trained()
    assert max_abs_diff(full_state(target, target_opt), full_state(reference, reference_opt)) == 0


@pytest.mark.timeout(60)
def test_a_model_with_a_layer_removed_or_added_is_refused(tmp_path: Path) -> None:
    model, opt = trained()
    save_sharded(tmp_path, model, opt, 1)
    fewer = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Tanh())
    before = {k: v.clone() for k, v in fewer.state_dict().items()}
    with pytest.raises(ShardedCheckpointError) as info:
        load_sharded(tmp_path, fewer)  # before: returned 1, dropping layer 2 silently
    assert "unexpected key(s) in the checkpoint ['model.2.bias', 'model.2.weight']" in str(
        info.value
    )
    assert not info.value.unsafe  # the model is wrong, not the step: no fallback
    assert all(torch.equal(v, before[k]) for k, v in fewer.state_dict().items())
    more = torch.nn.Sequential(*trained()[0], torch.nn.Linear(6, 6))
    with pytest.raises(
        ShardedCheckpointError, match=r"missing from the checkpoint \['model.3.bias'"
    ):
        load_sharded(tmp_path, more)


@pytest.mark.timeout(60)
def test_only_the_file_rank_0_hashed_unchanged_on_this_machine_is_not_hashed_again(
    tmp_path: Path,
) -> None:
    """The reader of a step rank 0 verified skips its own hash only for an unchanged file
    rank 0 looked at more than RACY_S after its last change; otherwise it hashes (and a
    change is caught)."""
    import time

    import refimpl.sharded._load as load_module
    import refimpl.sharded._seen as seen_module
    from refimpl.sharded._read import VerifyingReader

    readers: list[VerifyingReader] = []

    class Recording(VerifyingReader):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            readers.append(self)

    model, opt = trained()
    step_dir = save_sharded(tmp_path, model, opt, 1)
    with mock.patch.object(load_module, "VerifyingReader", Recording):
        load_sharded(tmp_path, *fresh())  # just saved: racy, hashed
        time.sleep(0.3)
        with mock.patch.object(seen_module, "RACY_S", 0.2):
            target, target_opt = fresh()
            assert load_sharded(tmp_path, target, target_opt) == 1  # rank 0's record holds
            reference = full_state(model, opt)
            assert max_abs_diff(full_state(target, target_opt), reference) == 0.0
            shard_file = step_dir / "__0_0.distcp"
            shard_file.write_bytes(shard_file.read_bytes())  # same bytes, a new ctime
            assert load_sharded(tmp_path, *fresh()) == 1
    assert [r.hashed for r in readers] == [["__0_0.distcp"], [], ["__0_0.distcp"]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", ["model.0.weight", "optim.state.0.weight.exp_avg"])
def test_a_non_tensor_item_in_place_of_a_tensor_is_skipped_with_a_reason(
    tmp_path: Path, key: str
) -> None:
    _model, _opt, step2 = _two_steps(tmp_path)
    bytes_item_in_place_of(step2, key, "not a weight")
    target, target_opt = fresh()
    before = full_state(target, target_opt)
    step, skipped, diff = _load_collecting(tmp_path)  # before: raised, no fallback
    assert step == 1 and diff == 0.0
    assert f"{key!r} is a non-tensor item in the step, a Tensor here" in skipped["step_00000002"]
    with pytest.raises(ShardedCheckpointError, match="non-tensor item in the step") as info:
        load_sharded(step2, target, target_opt)  # that one step: refused, nothing loaded
    assert info.value.unsafe
    assert max_abs_diff(full_state(target, target_opt), before) == 0.0


@pytest.mark.timeout(60)
def test_a_float_learning_rate_still_loads_into_a_tensor_one(tmp_path: Path) -> None:
    """The kind check leaves the optimizer's hyper-parameters to DCP and torch: a rate saved
    as a float loads where the optimizer holds a tensor rate, as it did before the check."""
    model, opt = trained()
    save_sharded(tmp_path, model, opt, 1)
    target = fresh()[0]
    target_opt = torch.optim.Adam(target.parameters(), lr=torch.tensor(0.5))
    assert load_sharded(tmp_path, target, target_opt) == 1
    assert target_opt.param_groups[0]["lr"] == 1e-2
