"""Chapter 7: reduce metrics across ranks when each rank saw different metrics.

In multi-dataset, multi-task training a rank only has the metrics of the datasets and tasks
it drew: rank 0 may hold ``{"seg/loss", "seg/iou"}`` while rank 1 holds ``{"cls/acc"}``.
Reducing one collective per metric, in each rank's own order, pairs unrelated metrics (wrong
numbers) or leaves a rank waiting for a call that never comes (a hang). `sync_metrics` makes
the number and order of collectives independent of the data:

1. one all-reduce (MAX) of two integers agrees on how many keys the biggest rank has and
   how long its longest key is; both are checked against fixed caps *before* anything is
   allocated, on every rank alike, so a bad value is one clear error everywhere, not an
   exabyte allocation on one rank and a hang on the others;
2. one all-gather of the keys, encoded as a ``uint8`` tensor of exactly that agreed shape,
   gives every rank the union of keys, which it sorts;
3. one all-reduce (SUM) of a ``[len(union), 2]`` float64 tensor of (sum, count), zeros where a
   rank lacks a key, gives every rank the same totals.

Three collectives whatever the keys, no pickles: ``dist.all_gather_object`` would pickle, pad
to the largest pickle and trust every rank's size (see chapter 7 for what that costs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from refimpl.device import rank_device

__all__ = ["MAX_KEYS", "MAX_KEY_BYTES", "MetricTotal", "sync_metrics"]

MAX_KEYS = 4096
"""Most distinct metric names one rank may hold."""
MAX_KEY_BYTES = 256
"""Longest metric name, in UTF-8 bytes."""


@dataclass(frozen=True)
class MetricTotal:
    """A metric summed over every rank: ``sum`` of values, ``count`` of samples."""

    sum: float
    count: int

    @property
    def mean(self) -> float:
        """``sum / count``; NaN when no rank counted anything."""
        return self.sum / self.count if self.count else float("nan")


def _check_local(local: Mapping[str, tuple[float, int]]) -> list[bytes]:
    keys = []
    for key, value in local.items():
        if not isinstance(key, str):
            raise TypeError(f"sync_metrics: metric names must be str, got {key!r}")
        raw = key.encode()
        if not raw or b"\0" in raw:
            raise ValueError(f"sync_metrics: metric name {key!r} is empty or holds a NUL byte")
        if not (isinstance(value, tuple | list) and len(value) == 2):
            raise TypeError(f"sync_metrics: {key!r} must map to (sum, count), got {value!r}")
        keys.append(raw)
    return sorted(keys)


def sync_metrics(
    local: Mapping[str, tuple[float, int]], *, group: Any = None
) -> dict[str, MetricTotal]:
    """Every rank's ``{name: (sum, count)}`` in, the same ``{name: MetricTotal}`` out everywhere.

    The result holds the union of all ranks' names, in sorted order; a rank that saw no data
    passes ``{}`` and still gets the full result. All ranks of ``group`` must call it (it makes
    three collectives, the same three whatever the keys). Without a process group it returns
    the local metrics as totals. Raises `ValueError` on every rank, naming the rank, when a
    rank has more than `MAX_KEYS` names or one longer than `MAX_KEY_BYTES` bytes.

    Example::

        totals = sync_metrics({"seg/iou": (iou_sum, n)})
        print(totals["seg/iou"].mean)
    """
    keys = _check_local(local)
    if not (dist.is_available() and dist.is_initialized()):
        return {
            k.decode(): MetricTotal(float(local[k.decode()][0]), int(local[k.decode()][1]))
            for k in keys
        }
    device = rank_device()
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    longest = max((len(k) for k in keys), default=0)
    # 1. agree on the shape of the key exchange (and who, if anyone, is over the caps)
    over = int(len(keys) > MAX_KEYS or longest > MAX_KEY_BYTES)
    sizes = torch.tensor([len(keys), longest, over * (me + 1)], dtype=torch.int64, device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    n_max, len_max, bad = (int(v) for v in sizes.tolist())
    if bad:
        raise ValueError(
            f"sync_metrics: rank {bad - 1} (at least) holds more than {MAX_KEYS} metric names or "
            f"one longer than {MAX_KEY_BYTES} bytes; this is rank {me}. Aggregate the names "
            "(fewer, shorter) before syncing."
        )
    if n_max == 0:
        return {}
    # 2. every rank's names, as a fixed [n_max, len_max] uint8 block each
    block = torch.zeros(n_max, len_max, dtype=torch.uint8)
    for i, raw in enumerate(keys):
        block[i, : len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    blocks = [torch.empty_like(block, device=device) for _ in range(world)]
    dist.all_gather(blocks, block.to(device), group=group)
    union: set[bytes] = set()
    for other in blocks:
        for row in other.cpu().numpy():
            raw = row.tobytes().rstrip(b"\0")
            if raw:
                union.add(raw)
    names = sorted(union)
    # 3. one sum over (sum, count) in the same sorted order on every rank
    values = torch.zeros(len(names), 2, dtype=torch.float64)
    mine = set(keys)
    for i, raw in enumerate(names):
        if raw in mine:
            total, count = local[raw.decode()]
            values[i, 0], values[i, 1] = float(total), float(count)
    values = values.to(device)
    dist.all_reduce(values, group=group)
    out = values.cpu().tolist()
    return {raw.decode(): MetricTotal(s, round(c)) for raw, (s, c) in zip(names, out, strict=True)}
