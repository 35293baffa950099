"""File checkpoints in the saving-overhead benchmark: `save_checkpoint` and `AsyncCheckpointer`
beside ``torch.save`` + fsync and the memcpy floor (chapters 5, 6 and 9).

- `nanogpt_state`: a nanoGPT-like training state, about 10 MB over 14 top-level keys (model,
  AdamW, scheduler, three RNGs, sampler, config, model args, counters, scaler): what a DDP
  reader's rank 0 saves every N steps; measured by `measure_small` with the file methods
  only (`FILE_METHODS`), round robin as `refimpl.bench._save_overhead` does;
- `start_file_save`: an ``AsyncCheckpointer`` save as a future, so that the training-step
  measurement (`refimpl.bench._save_inflight`) can run steps while it is in flight, with each
  writer setting of `FILE_WRITERS`.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from refimpl.bench import summarize
from refimpl.checkpoint import AsyncCheckpointer, save_checkpoint

__all__ = [
    "FILE_METHODS",
    "FILE_WRITERS",
    "FileSave",
    "file_methods",
    "measure_small",
    "nanogpt_state",
    "tensors_of",
]

FILE_METHODS = ("floor_memcpy", "torch_save_fsync", "save_checkpoint", "async_checkpoint")
FILE_WRITERS = {  # kind: (nice, CPU share), as AsyncCheckpointer(writer_nice=, writer_cpu_share=)
    "file_save": (0, None),
    "file_low_save": (19, None),
    "file_paced_save": (0, 0.05),
}
Timed = Callable[[Path], tuple[float, float]]


def timed_sync(fn: Callable[[Path], object]) -> Timed:
    """``fn`` as a method whose blocking time is its whole time (a synchronous save)."""

    def timed(path: Path) -> tuple[float, float]:
        start = time.perf_counter()
        fn(path)
        elapsed = time.perf_counter() - start
        return elapsed, elapsed

    return timed


def nanogpt_state(seed: int = 0) -> dict[str, Any]:
    """About 10 MB over 14 top-level keys, shaped like nanoGPT's checkpoint dict plus what an
    exact resume adds (a 3-layer, 128-wide GPT-like model after one AdamW step)."""
    gen = torch.Generator().manual_seed(seed)
    layers, width, vocab, block = 3, 128, 1024, 256
    model: dict[str, torch.Tensor] = {
        "transformer.wte.weight": torch.randn(vocab, width, generator=gen),
        "transformer.wpe.weight": torch.randn(block, width, generator=gen),
    }
    for i in range(layers):
        shapes = {
            "attn.c_attn": (3 * width, width),
            "attn.c_proj": (width, width),
            "mlp.c_fc": (4 * width, width),
            "mlp.c_proj": (width, 4 * width),
        }
        for name, shape in shapes.items():
            model[f"transformer.h.{i}.{name}.weight"] = torch.randn(*shape, generator=gen)
            model[f"transformer.h.{i}.{name}.bias"] = torch.zeros(shape[0])
        for norm in ("ln_1", "ln_2"):
            model[f"transformer.h.{i}.{norm}.weight"] = torch.ones(width)
    model["lm_head.weight"] = model["transformer.wte.weight"]  # tied, as in nanoGPT
    params = [v for k, v in model.items() if k != "lm_head.weight"]
    optim = {
        "state": {
            i: {
                "step": torch.tensor(2000.0),
                "exp_avg": torch.randn(p.shape, generator=gen),
                "exp_avg_sq": torch.rand(p.shape, generator=gen),
            }
            for i, p in enumerate(params)
        },
        "param_groups": [
            {
                "lr": 6e-4,
                "betas": (0.9, 0.95),
                "eps": 1e-8,
                "weight_decay": 0.1,
                "params": list(range(len(params))),
            }
        ],
    }
    rng = random.Random(seed)
    return {
        "model": model,
        "optimizer": optim,
        "scheduler": {"last_epoch": 2000, "base_lrs": [6e-4], "_step_count": 2001},
        "rng_torch": torch.get_rng_state(),
        "rng_python": [rng.getrandbits(32) for _ in range(625)],
        "rng_numpy": torch.randint(0, 2**31, (624,), generator=gen),
        "sampler": {"epoch": 1, "position": 1234, "seed": seed},
        "config": {
            "n_layer": layers,
            "n_embd": width,
            "vocab_size": vocab,
            "block_size": block,
            "dropout": 0.0,
            "bias": True,
            "dataset": "shakespeare_char",
        },
        "model_args": {"n_layer": layers, "n_head": 4, "n_embd": width},
        "iter_num": 2000,
        "best_val_loss": 1.4697,
        "epoch": 1,
        "tokens_seen": 123_456_789,
        "scaler": {
            "scale": 65536.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
            "_growth_tracker": 0,
        },
    }


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj`` (containers followed), each storage once."""
    found: dict[int, torch.Tensor] = {}
    todo = [obj]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            found.setdefault(item.untyped_storage().data_ptr(), item)
        elif isinstance(item, dict):
            todo += list(item.values())
        elif isinstance(item, list | tuple):
            todo += list(item)
    return list(found.values())


class FileSave:
    """One `AsyncCheckpointer` save, as the future the step-time loop polls."""

    def __init__(self, saver: AsyncCheckpointer, state: dict[str, Any], step: int) -> None:
        self._saver = saver
        self.path = saver.save(state, step)

    def done(self) -> bool:
        """Whether the save has committed (or failed)."""
        return self._saver.done()

    def result(self) -> Path | None:
        """Wait for the commit; raise the save's error."""
        return self._saver.wait()


def file_methods(
    state: dict[str, Any], scratch: Path, saver: AsyncCheckpointer
) -> dict[str, Timed]:
    """The file methods as ``path -> (blocking s, total s)``; ``saver`` writes into
    ``scratch/async`` (one step per call, deleted after it is timed)."""
    tensors = tensors_of(state)
    buffers = [torch.empty_like(t) for t in tensors]
    counter = iter(range(1, 1 << 30))

    def memcpy(path: Path) -> None:
        for buf, t in zip(buffers, tensors, strict=True):
            buf.copy_(t)

    def torch_save_fsync(path: Path) -> None:
        torch.save(state, path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())

    def async_checkpoint(path: Path) -> tuple[float, float]:
        start = time.perf_counter()
        step_dir = saver.save(state, next(counter))
        blocking = time.perf_counter() - start
        saver.wait()
        total = time.perf_counter() - start
        shutil.rmtree(step_dir)
        return blocking, total

    return {
        "floor_memcpy": timed_sync(memcpy),
        "torch_save_fsync": timed_sync(torch_save_fsync),
        "save_checkpoint": timed_sync(lambda p: save_checkpoint(p, state, 1, keep_last=None)),
        "async_checkpoint": async_checkpoint,
    }


def _clean(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def measure_small(state: dict[str, Any], scratch: Path, repeats: int) -> list[dict[str, Any]]:
    """One row per `FILE_METHODS` method for ``state``, round robin, the order rotating each
    round, one cold round apart (``cold_*``)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of(state))
    saver = AsyncCheckpointer(scratch / "async", keep_last=None, wait_on_sigterm=False)
    try:
        todo = file_methods(state, scratch, saver)
        blocking: dict[str, list[float]] = {m: [] for m in todo}
        total: dict[str, list[float]] = {m: [] for m in todo}
        cold: dict[str, tuple[float, float]] = {}
        names = list(todo)
        for rnd in range(repeats + 1):
            shift = (rnd - 1) % len(names) if rnd else 0
            for name in names[shift:] + names[:shift]:
                path = scratch / f"small_{name}_{rnd}"
                blocked_s, total_s = todo[name](path)
                _clean(path)
                if rnd == 0:
                    cold[name] = (blocked_s, total_s)
                else:
                    blocking[name].append(blocked_s)
                    total[name].append(total_s)
    finally:
        saver.close()
    rows = []
    for name in todo:
        row: dict[str, Any] = {"method": name, "state": "nanogpt", "bytes": nbytes}
        row["keys"] = len(state)
        for kind, samples in (("blocking", blocking[name]), ("total", total[name])):
            summary = summarize(samples)
            for stat in ("median", "min", "max"):
                row[f"{kind}_s_{stat}"] = summary[stat]
        row.update(repeats=repeats, cold_blocking_s=cold[name][0], cold_total_s=cold[name][1])
        rows.append(row)
    return rows
