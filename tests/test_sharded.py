"""refimpl.sharded: DCP checkpoints that commit atomically, verify before DCP reads them,
load at another world size, fail as Exceptions, and save in the background."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from _sharded_models import fresh, trained
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from refimpl._dcp_metadata import UnsafeMetadata, check_metadata
from refimpl.atomic import COMMIT_MARKER
from refimpl.checkpoint import MANIFEST, CheckpointError, safe_load, save_checkpoint
from refimpl.demos.sharded import (
    failing_writes,
    full_state,
    max_abs_diff,
    resharding_demo,
    tiny_model,
    train,
)
from refimpl.sharded import (
    AsyncSaver,
    ShardedCheckpointError,
    consolidate,
    load_sharded,
    save_sharded,
    verify_sharded,
)


@pytest.mark.timeout(60)
def test_round_trip_layout_pruning_and_plain_dcp_reads_it(tmp_path: Path) -> None:
    model, opt = trained()
    for step in (1, 2, 3, 4):
        last = save_sharded(tmp_path, model, opt, step, keep_last=2)
    assert last == tmp_path / "step_00000004"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    assert sorted(p.name for p in last.iterdir()) == [
        ".metadata",
        COMMIT_MARKER,
        MANIFEST,
        "__0_0.distcp",
    ]
    manifest = verify_sharded(last)
    assert manifest["step"] == 4 and set(manifest["files"]) == {".metadata", "__0_0.distcp"}

    target, target_opt = fresh()
    assert load_sharded(tmp_path, target, target_opt) == 4
    assert max_abs_diff(full_state(target, target_opt), full_state(model, opt)) == 0.0

    # Plain DCP reads the same directory: the top-level keys are "model" and "optim".
    plain = {"model": tiny_model(7).state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load(plain, checkpoint_id=last)
    assert max_abs_diff(plain["model"], model.state_dict()) == 0.0

    # Re-saving a step swaps the new copy in whole; nothing is written into the old one.
    old_inode = (last / "__0_0.distcp").stat().st_ino
    train(model, opt, range(3, 4))
    assert save_sharded(tmp_path, model, opt, 4, keep_last=2) == last
    assert (last / "__0_0.distcp").stat().st_ino != old_inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    assert load_sharded(tmp_path, target, target_opt) == 4
    assert max_abs_diff(full_state(target, target_opt), full_state(model, opt)) == 0.0


@pytest.mark.timeout(60)
def test_checkpoint_exception_is_a_base_exception_and_becomes_an_exception(tmp_path: Path) -> None:
    # torch 2.13, torch/distributed/checkpoint/api.py: class CheckpointException(BaseException)
    assert issubclass(CheckpointException, BaseException)
    assert not issubclass(CheckpointException, Exception)
    model, opt = trained()
    save_sharded(tmp_path, model, opt, 1)
    with failing_writes(0), pytest.raises(Exception) as info:  # a trainer's `except Exception`
        save_sharded(tmp_path, model, opt, 2)
    err = info.value
    assert isinstance(err, ShardedCheckpointError) and isinstance(err, CheckpointError)
    assert isinstance(err.__cause__, CheckpointException)
    assert err.rank == 0 and list(err.failures) == [0]
    assert "No space left on device" in str(err) and "step_00000002" in str(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # no temp left
    with pytest.raises(RuntimeError, match="initialised process group"):
        AsyncSaver()  # background saves need ranks to talk to

    def interrupted(self: FileSystemWriter, plan: object, planner: object) -> None:
        raise KeyboardInterrupt

    FileSystemWriter.write_data = interrupted  # type: ignore[method-assign,assignment]
    try:
        with pytest.raises(KeyboardInterrupt):  # DCP wraps Ctrl-C too; it stays Ctrl-C
            save_sharded(tmp_path, model, opt, 3)
    finally:
        del FileSystemWriter.write_data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]


@pytest.mark.timeout(60)
def test_load_falls_back_past_damaged_steps_and_says_why(tmp_path: Path) -> None:
    model, opt = trained()
    for step in (1, 2, 3, 4, 5):
        save_sharded(tmp_path, model, opt, step, keep_last=None)
    (tmp_path / "step_00000005" / COMMIT_MARKER).unlink()
    shard4 = tmp_path / "step_00000004" / "__0_0.distcp"
    data = bytearray(shard4.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard4.write_bytes(bytes(data))
    meta3 = tmp_path / "step_00000003" / ".metadata"
    meta3.write_bytes(meta3.read_bytes()[:-10])
    (tmp_path / "step_00000002" / "__1_0.distcp").write_bytes(b"x")  # a shard nobody listed
    save_checkpoint(tmp_path / "other", {"model": model.state_dict()}, 9)  # the single-file kind
    os.rename(tmp_path / "other" / "step_00000009", tmp_path / "step_00000009")

    skipped: list[tuple[str, str]] = []
    target, target_opt = fresh()
    step = load_sharded(
        tmp_path, target, target_opt, on_skip=lambda d, why: skipped.append((d.name, why))
    )
    assert step == 1
    reasons = dict(skipped)
    assert list(reasons) == [f"step_0000000{n}" for n in (9, 5, 4, 3, 2)]
    assert "not a sharded step" in reasons["step_00000009"]
    assert "no COMMITTED marker" in reasons["step_00000005"]
    assert "__0_0.distcp" in reasons["step_00000004"] and "xxh3_128" in reasons["step_00000004"]
    assert ".metadata" in reasons["step_00000003"] and "size" in reasons["step_00000003"]
    assert "found ['__1_0.distcp'], which the manifest does not list" in reasons["step_00000002"]
    assert max_abs_diff(target.state_dict(), model.state_dict()) == 0.0

    # A step directory named explicitly is loaded or refused, never swapped for another.
    with pytest.raises(ShardedCheckpointError, match="xxh3_128"):
        load_sharded(tmp_path / "step_00000004", target, target_opt)
    assert load_sharded(tmp_path / "step_00000001", target) == 1  # model only
    assert load_sharded(tmp_path / "nothing_here", target) is None
    wrong = torch.nn.Sequential(torch.nn.Linear(12, 21))  # not the model that was saved
    with pytest.raises(ShardedCheckpointError, match="built as they were") as info:
        load_sharded(tmp_path, wrong)
    assert not info.value.unsafe  # a mismatch is an error, not a reason to fall back
    with pytest.raises(ShardedCheckpointError, match="not a directory"):
        load_sharded(tmp_path / "step_00000001" / MANIFEST, target)


@pytest.mark.timeout(60)
def test_check_metadata_refuses_paths_outside_the_checkpoint(tmp_path: Path) -> None:
    model, opt = trained()
    step_dir = save_sharded(tmp_path, model, opt, 1)
    sizes = {"__0_0.distcp": (step_dir / "__0_0.distcp").stat().st_size}
    meta = check_metadata(step_dir / ".metadata", sizes)
    info = next(iter(meta.storage_data.values()))
    cases = [("../../etc/passwd", "not a shard file name"), ("__7_0.distcp", "does not have")]
    for bad, expect in cases:
        info.relative_path = bad
        forged = tmp_path / f"forged{len(bad)}"
        forged.write_bytes(pickle.dumps(meta))
        with pytest.raises(UnsafeMetadata, match=expect):
            check_metadata(forged, sizes)
    info.relative_path, info.length = "__0_0.distcp", sizes["__0_0.distcp"] + 1
    forged.write_bytes(pickle.dumps(meta))
    with pytest.raises(UnsafeMetadata, match="ends at byte"):
        check_metadata(forged, sizes)


@pytest.mark.timeout(60)
def test_consolidate_writes_one_full_weights_only_file(tmp_path: Path) -> None:
    model, opt = trained()
    step_dir = save_sharded(tmp_path / "ckpt", model, opt, 2)
    out = consolidate(step_dir, tmp_path / "model.pt")
    weights = safe_load(out)
    assert max_abs_diff(weights, model.state_dict()) == 0.0
    tiny_model(9).load_state_dict(weights)  # loads into an unwrapped model
    half = safe_load(consolidate(step_dir, tmp_path / "model_bf16.pt", dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    optim = safe_load(consolidate(step_dir, tmp_path / "optim.pt", key="optim"))
    assert set(optim) == {"state", "param_groups"}
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ckpt", "model.pt", "model_bf16.pt", "optim.pt"]  # and no temporaries
    (step_dir / COMMIT_MARKER).unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        consolidate(step_dir, tmp_path / "never.pt")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_resharding_4_to_2_and_3_equals_the_unsharded_reference(tmp_path: Path) -> None:
    lines = resharding_demo(tmp_path)
    assert lines == [
        "saved step 3 at 4 ranks; rows of 0.weight per rank: [5, 5, 5, 5]",
        "loaded at 2 ranks: step 3, rows per rank [10, 10], max |diff| vs unsharded: "
        "model 0, optimizer 0",
        "loaded at 3 ranks: step 3, rows per rank [7, 7, 6], max |diff| vs unsharded: "
        "model 0, optimizer 0",
    ]
    # The 4-rank FSDP2 checkpoint, read in this process without any process group:
    reference = safe_load(tmp_path / "unsharded.pt")
    step_dir = tmp_path / "ckpt" / "step_00000003"
    assert sorted(verify_sharded(step_dir)["files"]) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp",
    ]  # fmt: skip
    weights = safe_load(consolidate(step_dir, tmp_path / "model.pt"))
    assert max_abs_diff(weights, reference["model"]) == 0.0
    plain = {"model": tiny_model(7).state_dict()}  # plain dcp.load, unsharded target
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load(plain, checkpoint_id=step_dir)
    assert max_abs_diff(plain["model"], reference["model"]) == 0.0


def test_extra_tensors_round_trip_and_must_be_plain(tmp_path: Path) -> None:
    model, opt = trained()
    position = torch.tensor([7, 1, 40])
    save_sharded(tmp_path, model, opt, 7, extra={"trainer": position})
    back = {"trainer": torch.zeros(3, dtype=torch.int64)}
    assert load_sharded(tmp_path, *trained(seed=1), extra=back) == 7
    assert torch.equal(back["trainer"], position)  # filled in place
    with pytest.raises(ShardedCheckpointError, match="Missing key"):
        load_sharded(tmp_path / "step_00000007", *trained(seed=1), extra={"x": torch.zeros(1)})
    with pytest.raises(TypeError, match=r"plain torch\.Tensor"):
        save_sharded(
            tmp_path, model, opt, 8, extra={"trainer": torch.nn.Parameter(position.float())}
        )
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("step_")] == ["step_00000007"]
