"""Chapters 8-9's multi-rank runs: a rank killed in the middle of a sharded save, and async
saves that run while training goes on. Spawned through `refimpl.launch.spawn`; each returns
what the chapter prints (and `tests/test_sharded.py` asserts).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from refimpl.atomic import atomic_save, atomic_write_bytes
from refimpl.checkpoint import safe_load
from refimpl.demos.sharded import failing_writes, full_state, max_abs_diff, shard, tiny_model, train
from refimpl.launch import WorkerError, spawn
from refimpl.sharded import (
    AsyncSaver,
    ShardedCheckpointError,
    async_save_sharded,
    load_sharded,
    save_sharded,
)

__all__ = ["async_worker", "kill_mid_save_demo", "kill_worker"]


def async_worker(ckpt_dir: str, ref_path: str) -> dict[str, Any]:
    """Two async saves with training in between and after; a third that fails on rank 1.

    Rank 0 writes the unsharded state at the moment of the second call to ``ref_path``.
    """
    model = shard(tiny_model(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    saver = AsyncSaver()
    backend: Any = saver._pg._get_backend(torch.device("cpu"))
    saver_timeout_s = backend.options._timeout.total_seconds()
    train(model, opt, range(1, 2))
    first = saver.save(ckpt_dir, model, opt, 1)
    addresses_first = saver.staging_addresses
    train(model, opt, range(2, 3))  # while step 1 may still be writing
    second = saver.save(ckpt_dir, model, opt, 2)  # waits for step 1 first
    first_done_when_second_started = first.done()
    at_call = full_state(model, opt)
    if dist.get_rank() == 0:
        atomic_save(at_call, ref_path)
    train(model, opt, range(3, 6))  # training goes on while step 2 is written
    second_path = second.result(timeout=60)
    moved = max_abs_diff(full_state(model, opt)["model"], at_call["model"]) if at_call else 0.0
    local = [cast(Any, p).to_local() for p in model.parameters()]  # DTensor shards
    param_bytes = sum(t.untyped_storage().nbytes() for t in local)
    with failing_writes(1):  # stays patched until the background write has run
        third = saver.save(ckpt_dir, model, opt, 3)
        try:
            third.result(timeout=60)
            third_error = "no error"
        except ShardedCheckpointError as exc:
            third_error = f"ShardedCheckpointError ranks {sorted(exc.failures)}"
    saver.close()
    default = async_save_sharded(ckpt_dir, model, opt, 6)  # the per-process default saver
    default_path = default.result(timeout=60)
    return {
        "first": first.result().name,
        "second": second_path.name,
        "default": default_path.name,
        "first_done_when_second_started": first_done_when_second_started,
        "buffers_reused": addresses_first == saver.staging_addresses,
        "staged_bytes": second.staged_bytes,
        "param_bytes": param_bytes,
        "n_params": len(local),
        "moved_after_call": moved,
        "third": third_error,
        "saver_timeout_s": saver_timeout_s,
    }


def kill_worker(ckpt_dir: str, ref_path: str, report_path: str, killed: int) -> None:
    """Spawned at 2 ranks: commit step 1 (its unsharded state to ``ref_path``), train on, then
    save step 2 while rank ``killed`` dies half-way through its shard. The other rank writes
    what it got, and how many seconds after the save began, to ``report_path``; re-raises."""
    model = shard(tiny_model(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, range(1, 3))
    save_sharded(ckpt_dir, model, opt, 1)
    full = full_state(model, opt)
    if dist.get_rank() == 0:
        atomic_save(full, ref_path)
    train(model, opt, range(3, 5))
    start = time.monotonic()
    try:
        with failing_writes(killed, "exit"):
            save_sharded(ckpt_dir, model, opt, 2)
    except Exception as exc:
        report = {
            "type": type(exc).__name__,
            "rank": getattr(exc, "rank", None),
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
        atomic_write_bytes(json.dumps(report).encode(), report_path, durable=False)  # be quick
        raise


def kill_mid_save_demo(
    workdir: str | os.PathLike[str], killed: int, pg_timeout_s: float
) -> list[str]:
    """Kill rank ``killed`` in the middle of saving step 2; then look at the directory and
    load it (in this process, as a world of one)."""
    root = Path(workdir)
    ckpt, ref, report_path = root / "ckpt", root / "step1.pt", root / "survivor.json"
    lines = []
    try:
        paths = (str(ckpt), str(ref), str(report_path))
        spawn(kill_worker, 2, *paths, killed, timeout_s=80, pg_timeout_s=pg_timeout_s)
    except WorkerError as err:
        lines.append(f"launcher: {str(err).splitlines()[0]}")
    if report_path.exists():
        got = json.loads(report_path.read_text())
        within = got["seconds"] < pg_timeout_s
        lines.append(f"survivor got {got['type']} within {pg_timeout_s:g} s: {within}")
    names = sorted(re.sub(r"\.tmp-.*", ".tmp-…", p.name) for p in ckpt.iterdir())
    lines.append(f"checkpoint directory: {names}")
    model = tiny_model(5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = load_sharded(ckpt, model, opt)
    diff = max_abs_diff(full_state(model, opt), safe_load(ref))
    lines.append(f"load_sharded: step {step}; max |diff| vs step 1's state: {diff:g}")
    return lines
