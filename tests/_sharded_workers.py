"""Spawned workers of tests/test_sharded_hostile.py (spawn imports them by module name)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import refimpl.sharded
from refimpl.demos.sharded import full_state, max_abs_diff, shard, tiny_model, train
from refimpl.sharded import load_sharded, save_sharded


def shard_changed_after_rank0_checked(ckpt_dir: str) -> tuple[int | None, float, list[str]]:
    """Save steps 1 and 2 of an FSDP2 model at 2 ranks; then rank 0 verifies step 2 and, right
    after, one byte of rank 1's shard file changes (what rank 1 would see if its node had
    another copy). Returns ``(step loaded, max |diff| vs step 1 on rank 0, skip reasons)``."""
    model = shard(tiny_model(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, range(1, 3))
    save_sharded(ckpt_dir, model, opt, 1)
    step1 = copy.deepcopy(full_state(model, opt))  # Adam's step tensor is shared, not copied
    train(model, opt, range(3, 5))
    save_sharded(ckpt_dir, model, opt, 2)

    real = refimpl.sharded.choose_step

    def verify_then_change(path: Path, below: int | None = None) -> Any:
        chosen = real(path, below)
        if chosen[1] is not None and chosen[1].endswith("step_00000002"):
            shard_file = Path(chosen[1]) / "__1_0.distcp"
            data = bytearray(shard_file.read_bytes())
            data[len(data) // 2] ^= 0x10
            shard_file.write_bytes(bytes(data))
        return chosen

    if dist.get_rank() == 0:
        refimpl.sharded.choose_step = verify_then_change  # type: ignore[assignment]
    target = shard(tiny_model(99))
    target_opt = torch.optim.Adam(target.parameters(), lr=1e-2)
    skipped: list[str] = []
    try:
        step = load_sharded(
            ckpt_dir, target, target_opt, on_skip=lambda d, why: skipped.append(f"{d.name}: {why}")
        )
    finally:
        refimpl.sharded.choose_step = real
    loaded = full_state(target, target_opt)
    diff = max_abs_diff(loaded, step1) if dist.get_rank() == 0 else 0.0
    return step, diff, skipped
