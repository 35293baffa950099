"""Chapters 8-9's models, workers and the resharding demonstration.

Each ``*_demo(workdir)`` builds its own checkpoints under ``workdir`` and returns printable
lines (paths replaced by ``CKPT``), deterministic for a given torch: seeded models, results
from rank 0 or in rank order.

- `resharding_demo`: save an FSDP2 model + Adam at 4 ranks, load at 2 and at 3; compare with
  the unsharded state the 4 ranks had.
- `failing_writes`: make DCP's writer fail on one rank (the fault the other demos inject).

Plain DCP's failure modes (the torn overwrite, a crafted ``.metadata``) are in
`refimpl.demos.dcp_pitfalls`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from refimpl.atomic import atomic_save
from refimpl.checkpoint import safe_load
from refimpl.launch import spawn
from refimpl.sharded import load_sharded, save_sharded
from refimpl.train._sharded import shard_model

LIMITS: dict[str, Any] = {"timeout_s": 120.0, "pg_timeout_s": 20.0}
"""The demos' `spawn` limits: the job's and every collective's timeout, in seconds."""


def tiny_model(seed: int = 0) -> nn.Sequential:
    """A 12-20-6 MLP: 20 rows split 5/5/5/5 at 4 ranks, 10/10 at 2, 7/7/6 at 3."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 6))


def shard(model: nn.Sequential) -> nn.Sequential:
    """FSDP2 (``fully_shard``) per layer and at the root, on a CPU mesh of all ranks: the
    same wrapping as ``python -m refimpl.train --sharded``."""
    shard_model(model, torch.device("cpu"))
    return model


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    """A few Adam steps; each rank draws its own seeded batch of 8."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 6, generator=gen)
        loss = F.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole (unsharded) model and optimizer state, on rank 0 (empty on the others)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=options)
    return {"model": msd, "optim": osd}


def max_abs_diff(a: Any, b: Any, where: str = "state") -> float:
    """Largest absolute difference between two nested states; a structural mismatch raises."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            raise ValueError(f"{where}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
        return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            raise ValueError(f"{where}: keys differ: {sorted(set(a) ^ set(b), key=str)}")
        return max((max_abs_diff(a[k], b[k], f"{where}[{k!r}]") for k in a), default=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return max((max_abs_diff(x, y, f"{where}[{i}]") for i, (x, y) in pairs), default=0.0)
    if a != b:
        raise ValueError(f"{where}: {a!r} vs {b!r}")
    return 0.0


def _rows(model: nn.Sequential) -> int:
    """How many rows of the first weight this rank holds."""
    weight: Any = model[0].weight
    return int(weight.to_local().shape[0])


def save_worker(ckpt_dir: str, ref_path: str, steps: int) -> int:
    """Spawned: train an FSDP2 model ``steps`` steps, `save_sharded` the last, and write the
    unsharded reference to ``ref_path`` (rank 0). Returns this rank's rows of ``0.weight``."""
    model = shard(tiny_model(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, range(1, steps + 1))
    save_sharded(ckpt_dir, model, opt, steps)
    full = full_state(model, opt)
    if dist.get_rank() == 0:
        atomic_save(full, ref_path)
    return _rows(model)


def load_worker(ckpt_dir: str, ref_path: str) -> tuple[int | None, int, float, float]:
    """Spawned at any world size: `load_sharded` into a differently initialised FSDP2 model;
    returns ``(step, this rank's rows, max |diff| model, max |diff| optimizer)`` (diffs on
    rank 0, against the unsharded reference; 0.0 elsewhere)."""
    model = shard(tiny_model(99))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = load_sharded(ckpt_dir, model, opt)
    full = full_state(model, opt)
    rows = _rows(model)
    if dist.get_rank() != 0:
        return step, rows, 0.0, 0.0
    ref = safe_load(ref_path)
    model_diff = max_abs_diff(full["model"], ref["model"], "model")
    return step, rows, model_diff, max_abs_diff(full["optim"], ref["optim"], "optim")


def resharding_demo(
    workdir: str | os.PathLike[str], save_world: int = 4, load_worlds: tuple[int, ...] = (2, 3)
) -> list[str]:
    """Save at ``save_world`` ranks, load at each of ``load_worlds``; lines to print."""
    root = Path(workdir)
    ckpt, ref = str(root / "ckpt"), str(root / "unsharded.pt")
    rows = spawn(save_worker, save_world, ckpt, ref, 3, **LIMITS)
    lines = [f"saved step 3 at {save_world} ranks; rows of 0.weight per rank: {rows}"]
    for world in load_worlds:
        out = spawn(load_worker, world, ckpt, ref, **LIMITS)
        step, _r, dm, do = out[0]
        lines.append(
            f"loaded at {world} rank{'s' if world > 1 else ''}: step {step}, "
            f"rows per rank {[r[1] for r in out]}; max |diff|: model {dm:g}, optimizer {do:g}"
        )
    return lines


@contextlib.contextmanager
def failing_writes(rank: int, how: str = "raise") -> Iterator[None]:
    """On rank ``rank`` only, make DCP's `FileSystemWriter` fail as it starts writing data:
    ``"raise"`` an ENOSPC, or ``"exit"``: write half a shard and ``os._exit(1)`` (a kill)."""
    if (dist.get_rank() if dist.is_initialized() else 0) != rank:
        yield
        return

    def write_data(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        shard_file = Path(self.path) / f"__{rank}_0.distcp"
        if how == "exit":
            shard_file.write_bytes(b"\0" * 64)  # half a shard, then gone: no except, no finally
            os._exit(1)
        raise OSError(28, "No space left on device (simulated)", str(shard_file))

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del FileSystemWriter.write_data  # back to the inherited method
