"""refimpl.sharded: DCP checkpoints that commit atomically, verify before DCP reads them,
load at another world size, fail as Exceptions, and save in the background."""

from __future__ import annotations

import logging
import os
import pickle
import re
import threading
import warnings
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch
from helpers.sharded_models import fresh, trained
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from workers.sharded import (
    RngState,
    state_load_fails_on_one_rank,
    state_round_trip,
    training_state,
)

from refimpl._checkpoint_cli import main as cli_main
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
from refimpl.launch import spawn
from refimpl.sharded import (
    AsyncSaver,
    PerRank,
    ShardedCheckpointError,
    consolidate,
    inspect_sharded,
    load_sharded,
    save_sharded,
    verify_sharded,
)
from refimpl.sharded._dcp_metadata import UnsafeMetadata, check_metadata


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
    if not torch.cuda.is_available():  # page-locking is a CUDA call: refused, not ignored
        with pytest.raises(ValueError, match="pinned_memory=True needs CUDA"):
            AsyncSaver(pinned_memory=True)

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
    with pytest.raises(ShardedCheckpointError, match="Pass the checkpoint directory") as info:
        load_sharded(tmp_path / "step_00000002", target, target_opt)
    assert str(info.value).count("step_00000002") == 1, str(info.value)  # named once
    assert load_sharded(tmp_path / "step_00000001", target) == 1  # model only
    with pytest.raises(ShardedCheckpointError, match="does not exist"):
        load_sharded(tmp_path / "nothing_here", target)
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
        "loaded at 2 ranks: step 3, rows per rank [10, 10]; max |diff|: model 0, optimizer 0",
        "loaded at 3 ranks: step 3, rows per rank [7, 7, 6]; max |diff|: model 0, optimizer 0",
    ]
    # The 4-rank FSDP2 checkpoint, read in this process without any process group:
    reference = safe_load(tmp_path / "unsharded.pt")
    step_dir = tmp_path / "ckpt" / "step_00000003"
    assert sorted(verify_sharded(step_dir)["files"]) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
        "__3_0.distcp",
    ]
    weights = safe_load(consolidate(step_dir, tmp_path / "model.pt"))
    assert max_abs_diff(weights, reference["model"]) == 0.0
    plain = {"model": tiny_model(7).state_dict()}  # plain dcp.load, unsharded target
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load(plain, checkpoint_id=step_dir)
    assert max_abs_diff(plain["model"], reference["model"]) == 0.0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_state_round_trips_sync_and_async_at_the_same_and_another_world_size(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Scheduler, sampler, per-rank RNG, a step counter and metadata: saved at 2 ranks by
    save_sharded and by AsyncSaver (whose copy is taken at the call), loaded at 2 ranks
    (everything back, each rank its own RNG) and at 1 (per-rank RNG left alone, said so)."""
    results = spawn(state_round_trip, 2, str(tmp_path), timeout_s=100, pg_timeout_s=30)
    rngs = []
    for r in results:
        for kind, step in (("sync", 3), ("async", 5)):
            saved, loaded = r["saved"][kind], r["loaded"][kind]
            assert loaded.pop("loaded_step") == step and loaded.pop("restored") is True
            assert loaded == saved  # sched, sampler, this rank's RNG, step, meta
        assert r["saved"]["async"]["step"] == 5 and r["saved"]["async_path"].endswith(
            "step_00000005"
        )
        assert r["saved"]["pinned"] is torch.cuda.is_available()  # pinned only with CUDA
        assert "state entries ['seen'] differ between ranks" in r["loaded"]["differ"]
        assert "PerRank" in r["loaded"]["differ"] and r["loaded"]["never"] is False
        rngs.append(r["saved"]["sync"]["rng"])
    assert rngs[0] != rngs[1]  # the RNG really was per rank

    info = inspect_sharded(tmp_path / "async" / "step_00000005")
    assert (info["step"], info["world_size"], info["files"]) == (5, 2, 3)
    assert info["state"] == ["meta", "sampler", "sched", "step"]
    assert info["per_rank_state"] == ["rng"]
    assert {"state_rank0.rng", "state_rank1.rng", "state.sched"} <= set(info["keys"])
    assert info["keys"]["model.0.weight"] == {"shape": [20, 12], "dtype": "float32", "chunks": 2}

    # At 1 rank (no process group): shared entries restored, the per-rank RNG left alone.
    saved = results[0]["saved"]["sync"]
    model = tiny_model(9)
    run = training_state(model, 0, 1)
    torch.manual_seed(1234)
    before = torch.get_rng_state().tolist()
    with caplog.at_level(logging.WARNING, logger="refimpl.sharded"):
        assert load_sharded(tmp_path / "sync", model, run["opt"], state=run["state"]) == 3
    state = run["state"]
    assert state["rng"].restored is False and torch.get_rng_state().tolist() == before
    assert "saved at 2 ranks and is loaded at 1: per-rank state ['rng'] not restored" in caplog.text
    assert state["sched"].state_dict() == saved["sched"]
    assert state["sampler"].state_dict() == saved["sampler"]  # the global position
    assert (state["step"], state["meta"]) == (3, {"run": "r1", "lrs": [0.1, 0.2]})


@pytest.mark.timeout(150)
def test_a_state_entry_that_fails_on_one_rank_fails_the_load_on_every_rank(
    tmp_path: Path,
) -> None:
    """``b.load_state_dict`` raises on rank 1 only: every rank raises the same error naming
    rank 1 and the entry, the model and optimizer are untouched and every state= entry holds
    what it held before the load. set_state_dict failing on rank 1 fails every rank too."""
    results = spawn(state_load_fails_on_one_rank, 2, str(tmp_path), timeout_s=120, pg_timeout_s=30)
    first = results[0]["load_state_dict"]
    # before: rank 0 "loaded step 1", rank 1 a bare "ValueError: rank 1 cannot take n=7",
    # the model loaded on both ranks and entries a=5 (rank 1: b=-1) left set
    assert [r["load_state_dict"]["outcome"] for r in results] == [first["outcome"]] * 2
    assert first["outcome"].startswith("ShardedCheckpointError: "), first
    assert (
        "state= could not be restored (rank 1: state['b'].load_state_dict raised ValueError: "
        "rank 1 cannot take n=7). Nothing was loaded" in first["outcome"]
    )
    for r in results:
        assert r["load_state_dict"]["moved"] == 0.0  # the model and optimizer untouched
        assert r["load_state_dict"]["entries"] == (0, 0, None)  # every entry put back
    second = [r["set_state_dict"] for r in results]
    assert second[0]["outcome"] == second[1]["outcome"], second  # before: rank 0 loaded
    assert "RuntimeError: set_state_dict fails on rank 1" in second[0]["outcome"]
    assert "may hold part of step_00000001 on every rank" in second[0]["outcome"]
    assert all(r["entries"] == (0, 0, None) for r in second)  # state= put back


class _Uncopyable:
    """A Stateful entry whose current state cannot be deep-copied (it holds a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "lock": self.lock}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


@pytest.mark.timeout(60)
def test_an_entry_that_cannot_be_put_back_refuses_the_load_before_anything_is_set(
    tmp_path: Path,
) -> None:
    model, opt = trained()
    save_sharded(tmp_path, model, opt, 1, state={"step": 1, "obj": {"n": 5}})
    target, target_opt = fresh()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    state: dict[str, Any] = {"step": None, "obj": _Uncopyable()}
    with pytest.raises(ShardedCheckpointError, match=r"state\['obj'\]: its current state could"):
        load_sharded(tmp_path, target, target_opt, state=state)
    assert state["step"] is None and state["obj"].n == 0  # "step" (set first) was put back
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


@pytest.mark.timeout(60)
def test_state_entries_are_checked_on_save_and_on_load(tmp_path: Path) -> None:
    model, opt = trained()
    with pytest.raises(
        TypeError, match=r"state\['cfg'\] cannot be saved so that it loads weights-only"
    ):
        save_sharded(tmp_path, model, opt, 1, state={"cfg": Path("x")})
    assert not tmp_path.joinpath("step_00000001").exists()  # refused before the disk
    save_sharded(tmp_path, model, opt, 2, state={"step": 2, "rng": PerRank(RngState())})
    target, target_opt = fresh()
    with pytest.raises(ShardedCheckpointError, match=r"no entry 'epoch' \(the step has shared"):
        load_sharded(tmp_path, target, target_opt, state={"epoch": 0})
    with pytest.raises(ShardedCheckpointError, match="saved as the other kind"):
        load_sharded(tmp_path, target, target_opt, state={"step": PerRank(0)})
    with pytest.raises(TypeError, match="must be a dict"):
        load_sharded(tmp_path, target, target_opt, state=MappingProxyType({"step": 0}))
    subset = {"step": None}  # a subset of what was saved: the rest is left alone
    assert load_sharded(tmp_path, target, target_opt, state=subset) == 2 and subset["step"] == 2
    plain = PerRank(None)  # a plain per-rank value comes back into the wrapper
    save_sharded(tmp_path, model, opt, 3, state={"mine": PerRank([1, 2])})
    assert load_sharded(tmp_path, target, state={"mine": plain}) == 3
    assert (plain.obj, plain.restored) == ([1, 2], True)


@pytest.mark.timeout(60)
def test_inspect_cli_reports_a_sharded_step_without_a_process_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, opt = trained()
    step_dir = save_sharded(tmp_path, model, opt, 4, state={"step": 4, "rng": PerRank(RngState())})
    assert cli_main(["inspect", str(step_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    size = sum(
        p.stat().st_size for p in step_dir.iterdir() if p.name in verify_sharded(step_dir)["files"]
    )
    assert out[0].startswith(f"{step_dir}: step 4, format refimpl.sharded/1, saved by 1 rank(s), ")
    assert (
        f"{size / 1024:.1f} KiB in 2 files" in out[0] and inspect_sharded(step_dir)["bytes"] == size
    )
    assert out[1] == "  state: step; per rank: rng"
    assert "  model.0.weight: tensor (20, 12) float32" in out
    assert "  state_rank0.rng: object (read weights-only on load)" in out
    (step_dir / "__0_0.distcp").write_bytes(b"x")
    assert cli_main(["inspect", str(step_dir)]) == 1
    assert "size 1 bytes" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_a_wrong_path_is_an_error_and_an_empty_root_a_fresh_start(tmp_path: Path) -> None:
    model, opt = trained()
    root = tmp_path / "ckpt"
    cases = {
        tmp_path / "missing": "does not exist. Pass the checkpoint directory",
        save_checkpoint(tmp_path / "files", {"w": 1}, 4).parent: (
            "holds refimpl.checkpoint file steps (1), not sharded ones: load them with "
            "refimpl.checkpoint.load_latest"
        ),
    }
    save_sharded(root, model, opt, 1)
    cases[tmp_path] = f"holds no step_N directories, but {root} does: pass that one"
    cases[root / "step_00000001" / MANIFEST] = "is a file, not a directory"
    for path, message in cases.items():
        with pytest.raises(ShardedCheckpointError, match=re.escape(message)) as info:
            load_sharded(path, *fresh())
        assert info.value.path == path
    # One step directory is that step, loaded or refused; never another one.
    assert load_sharded(root / "step_00000001", *fresh()) == 1
    # An existing root with no step yet (only strays and temporaries) is a fresh start.
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "notes.txt").write_text("run 2")
    (tmp_path / "new" / ".step_00000001.tmp-x").mkdir()
    assert load_sharded(tmp_path / "new", *fresh()) is None
    # Committed steps none of which loads: an error with every reason, never a fresh start.
    (root / "step_00000001" / "__0_0.distcp").write_bytes(b"damaged")
    skipped: list[str] = []
    with pytest.raises(ShardedCheckpointError, match="no committed step can be loaded"):
        load_sharded(root, *fresh(), on_skip=lambda d, why: skipped.append(f"{d.name}: {why}"))
    assert len(skipped) == 1 and "step_00000001: " in skipped[0] and "size" in skipped[0]
