"""Spawned workers of tests/test_sharded*.py (spawn imports them by module name)."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import refimpl.sharded
import refimpl.sharded._api
import refimpl.sharded._load
import refimpl.sharded._seen
from refimpl.data import ResumableSampler
from refimpl.demos.sharded import full_state, max_abs_diff, shard, tiny_model, train
from refimpl.sharded import AsyncSaver, PerRank, load_sharded, save_sharded
from refimpl.sharded._paths import Choice


def shard_changed_after_rank0_checked(
    ckpt_dir: str, racy_s: float | None = None
) -> tuple[int | None, float, list[str]]:
    """Save steps 1 and 2 of an FSDP2 model at 2 ranks; then rank 0 verifies step 2 and, right
    after, one byte of rank 1's shard file changes (what rank 1 would see if its node had
    another copy). Returns ``(step loaded, max |diff| vs step 1 on rank 0, skip reasons)``.
    ``racy_s``: `refimpl.sharded._seen.RACY_S` for this load, after waiting twice as long, so
    that rank 0 records what it saw of each file (else every rank hashes a just-saved file)."""
    if racy_s is not None:
        refimpl.sharded._seen.RACY_S = racy_s
    model = shard(tiny_model(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, range(1, 3))
    save_sharded(ckpt_dir, model, opt, 1)
    step1 = copy.deepcopy(full_state(model, opt))  # Adam's step tensor is shared, not copied
    train(model, opt, range(3, 5))
    save_sharded(ckpt_dir, model, opt, 2)
    if racy_s is not None:
        time.sleep(2 * racy_s)

    real = refimpl.sharded._api.choose_step

    def verify_then_change(path: Path, below: int | None = None) -> Choice:
        chosen = real(path, below)
        if chosen.step_dir is not None and chosen.step_dir.endswith("step_00000002"):
            shard_file = Path(chosen.step_dir) / "__1_0.distcp"
            data = bytearray(shard_file.read_bytes())
            data[len(data) // 2] ^= 0x10
            shard_file.write_bytes(bytes(data))
        return chosen

    if dist.get_rank() == 0:
        refimpl.sharded._api.choose_step = verify_then_change  # type: ignore[assignment]
    target = shard(tiny_model(99))
    target_opt = torch.optim.Adam(target.parameters(), lr=1e-2)
    skipped: list[str] = []
    try:
        step = load_sharded(
            ckpt_dir, target, target_opt, on_skip=lambda d, why: skipped.append(f"{d.name}: {why}")
        )
    finally:
        refimpl.sharded._api.choose_step = real
    loaded = full_state(target, target_opt)
    diff = max_abs_diff(loaded, step1) if dist.get_rank() == 0 else 0.0
    return step, diff, skipped


class RngState:
    """This process's CPU RNG stream as a Stateful object (a PerRank entry of ``state=``)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])


def training_state(model: torch.nn.Module, rank: int, world: int) -> dict[str, Any]:
    """A scheduler, a sampler, a per-rank RNG, a step counter and metadata, as a trainer has."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    sampler = ResumableSampler(64, batch_size=4, rank=rank, world_size=world, seed=3)
    return {
        "opt": opt,
        "state": {
            "sched": sched,
            "sampler": sampler,
            "rng": PerRank(RngState()),
            "step": None,
            "meta": None,
        },
    }


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "sched": state["sched"].state_dict(),
        "sampler": state["sampler"].state_dict(),
        "rng": torch.get_rng_state().tolist(),
        "step": state["step"],
        "meta": state["meta"],
    }


def state_round_trip(ckpt_dir: str) -> dict[str, Any]:
    """At 2 ranks: a sync save (step 3) to ``ckpt_dir/sync`` and an async one (step 5) to
    ``ckpt_dir/async`` with everything changed right after the call; then both loaded into
    fresh objects at the same world size. Returns what was saved and what came back."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard(tiny_model(0))
    run = training_state(model, rank, world)
    opt, state = run["opt"], run["state"]
    torch.manual_seed(100 + rank)  # a per-rank stream, as dropout would have
    saved = {}
    for step, kind in ((3, "sync"), (5, "async")):
        train(model, opt, range(step - 1, step))
        state["sched"].step()
        state["sampler"].load_state_dict({"seed": 3, "epoch": 1, "position": 8 * step})
        state["step"], state["meta"] = step, {"run": "r1", "lrs": [0.1, 0.2]}
        torch.rand(3)
        saved[kind] = _snapshot(state)
        if kind == "sync":
            save_sharded(Path(ckpt_dir) / kind, model, opt, step, state=state)
        else:
            saver = AsyncSaver()
            handle = saver.save(Path(ckpt_dir) / kind, model, opt, step, state=state)
            state["sched"].step()  # after the call: not in the checkpoint
            state["step"] = 99
            torch.rand(5)
            saved["async_path"] = str(handle.result(timeout=60))
            saved["pinned"] = saver.pinned_memory
            saver.close()
    try:
        save_sharded(Path(ckpt_dir) / "never", model, opt, 1, state={"seen": rank})
        differ = "saved"
    except ValueError as exc:  # on every rank, before anything is written
        differ = str(exc)
    loaded: dict[str, Any] = {"differ": differ, "never": (Path(ckpt_dir) / "never").exists()}
    for kind in ("sync", "async"):
        torch.manual_seed(7)  # another stream: the load must bring the saved one back
        target = shard(tiny_model(9))
        fresh_run = training_state(target, rank, world)
        fresh_state = fresh_run["state"]
        step = load_sharded(Path(ckpt_dir) / kind, target, fresh_run["opt"], state=fresh_state)
        loaded[kind] = {
            **_snapshot(fresh_state),
            "loaded_step": step,
            "restored": fresh_state["rng"].restored,
        }
    return {"saved": saved, "loaded": loaded}


class Counter:
    """A Stateful entry of ``state=`` holding one number."""

    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


class RefusesOnRank1(Counter):
    """A Counter whose load of the saved value 7 sets a wrong value and raises, on rank 1."""

    def load_state_dict(self, state: dict[str, int]) -> None:
        if dist.get_rank() == 1 and state["n"] == 7:
            self.n = -1  # half-way through, as a real load_state_dict may be
            raise ValueError("rank 1 cannot take n=7")
        super().load_state_dict(state)


def _outcome(ckpt_dir: str, model: Any, opt: Any, state: dict[str, Any]) -> str:
    try:
        return f"loaded step {load_sharded(ckpt_dir, model, opt, state=state)}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def state_load_fails_on_one_rank(ckpt_dir: str) -> dict[str, Any]:
    """At 2 ranks: save step 1 with ``state={"a": 5, "b": 7, "step": 1}``; then load it into a
    fresh FSDP2 model whose entry ``b`` raises on rank 1, and again with set_state_dict failing
    on rank 1. Returns each attempt's outcome, how far the model moved, and the entries."""
    model = shard(tiny_model(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, range(1, 3))
    save_sharded(ckpt_dir, model, opt, 1, state={"a": Counter(5), "b": Counter(7), "step": 1})
    target = shard(tiny_model(99))
    target_opt = torch.optim.Adam(target.parameters(), lr=1e-2)
    before = copy.deepcopy(full_state(target, target_opt))  # on rank 0; {} on rank 1
    mine = [p.to_local().detach().clone() for p in target.parameters()]  # this rank's shards
    out: dict[str, Any] = {}
    real = refimpl.sharded._load.set_state_dict

    def fails_on_rank1(*args: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == 1:
            raise RuntimeError("set_state_dict fails on rank 1")
        return real(*args, **kwargs)

    for attempt in ("load_state_dict", "set_state_dict"):
        b = RefusesOnRank1(0) if attempt == "load_state_dict" else Counter(0)
        state: dict[str, Any] = {"a": Counter(0), "b": b, "step": None}
        if attempt == "set_state_dict":
            refimpl.sharded._load.set_state_dict = fails_on_rank1  # type: ignore[assignment]
        try:
            outcome = _outcome(ckpt_dir, target, target_opt, state)
        finally:
            refimpl.sharded._load.set_state_dict = real  # type: ignore[assignment]
        local = zip(target.parameters(), mine, strict=True)
        moved = max(
            max_abs_diff(full_state(target, target_opt), before),
            *(float((p.to_local() - m).abs().max()) for p, m in local),
        )
        out[attempt] = {
            "outcome": outcome,
            "moved": moved,
            "entries": (state["a"].n, state["b"].n, state["step"]),
        }
    return out


def async_save_never_waited(ckpt_dir: str) -> int:
    """Train an FSDP2 model, start an async save of step 5 and return without waiting for it
    (tests/test_sharded_async_exit.py: the rank must still say what became of the save)."""
    model = shard(tiny_model(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, range(1, 3))
    refimpl.sharded.async_save_sharded(ckpt_dir, model, opt, 5)
    return dist.get_rank()
