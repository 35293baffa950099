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

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from refimpl.device import rank_device

__all__ = ["MAX_COUNT", "MAX_KEYS", "MAX_KEY_BYTES", "MetricTotal", "sync_metrics"]

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


MAX_COUNT = 2**53 - 1
"""Largest count one rank may pass. float64, what the sum travels as, counts exactly to 2**53."""
_REASON_BYTES = 1024  # the bad rank's reason travels to every rank in a block of this size


class _BadInput(Exception):
    """This rank's input is unusable: ``kind`` is the exception to raise, ``reason`` why."""

    def __init__(self, kind: type[Exception], reason: str) -> None:
        super().__init__(reason)
        self.kind, self.reason = kind, reason


def _number(key: str, what: str, v: Any) -> float | int:
    """``v`` as a Python number, refusing anything that would only convert by accident."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.dtype != torch.bool:
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise _BadInput(
            TypeError, f"holds {key!r} whose {what} is a {type(v).__name__} ({v!r}), not a number"
        )
    return int(v) if isinstance(v, numbers.Integral) else float(v)


def _entry(key: Any, value: Any) -> tuple[bytes, float, int]:
    """One checked ``key: (sum, count)`` as (UTF-8 name, sum, count), or `_BadInput`."""
    if not isinstance(key, str):
        raise _BadInput(TypeError, f"holds the metric name {key!r}; metric names must be str")
    try:
        raw = key.encode()
    except UnicodeEncodeError as exc:
        raise _BadInput(
            ValueError,
            f"holds the metric name {key!r}, which is not valid text "
            f"({exc.reason}: a lone surrogate); decode names with errors="
            "'replace'",
        ) from None
    if not raw or b"\0" in raw:
        raise _BadInput(ValueError, f"holds the metric name {key!r}, empty or with a NUL byte")
    if not (isinstance(value, tuple | list) and len(value) == 2):
        raise _BadInput(
            TypeError, f"holds {key!r} mapped to {value!r}; it must map to (sum, count)"
        )
    total, count = _number(key, "sum", value[0]), _number(key, "count", value[1])
    if not math.isfinite(total):
        raise _BadInput(ValueError, f"holds {key!r} whose sum is {total!r}, not a finite number")
    if isinstance(count, float) and not (math.isfinite(count) and count.is_integer()):
        raise _BadInput(ValueError, f"holds {key!r} whose count is {count!r}, not a whole number")
    if not 0 <= count <= MAX_COUNT:
        raise _BadInput(
            ValueError,
            f"holds {key!r} whose count is {int(count)}, outside 0.."
            f"{MAX_COUNT} (2**53 - 1, the most float64 counts exactly)",
        )
    return raw, float(total), int(count)


def _check_local(local: Mapping[str, tuple[float, int]]) -> dict[bytes, tuple[float, int]]:
    """Every entry checked and converted, before any collective; `_BadInput` if one is bad."""
    try:
        items = list(local.items())
    except AttributeError:
        raise _BadInput(TypeError, f"passed a {type(local).__name__}, not a dict") from None
    entries = {}
    for key, value in items:
        raw, total, count = _entry(key, value)
        entries[raw] = (total, count)
    if len(entries) > MAX_KEYS or max(map(len, entries), default=0) > MAX_KEY_BYTES:
        raise _BadInput(
            ValueError,
            f"holds more than {MAX_KEYS} metric names or one longer "
            f"than {MAX_KEY_BYTES} bytes; aggregate the names (fewer, shorter)",
        )
    return dict(sorted(entries.items()))


def _reason_of(bad: int, mine: _BadInput | None, device: torch.device, group: Any) -> str:
    """The bad rank's reason, on every rank: one broadcast, made only on this error path,
    which every rank takes alike (they all saw the same MAX)."""
    block = torch.zeros(_REASON_BYTES, dtype=torch.uint8)
    if mine is not None and dist.get_rank(group) == bad:
        raw = mine.reason.encode(errors="backslashreplace")[:_REASON_BYTES]
        block[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    block = block.to(device)
    dist.broadcast(block, group_src=bad, group=group)
    return bytes(block.cpu().tolist()).rstrip(b"\0").decode(errors="replace")


def _check_totals(names: list[bytes], counts: list[float]) -> None:
    # A float64 sum of whole numbers is exact below 2**53; at or above, it may be rounded.
    for raw, c in zip(names, counts, strict=True):
        if c > MAX_COUNT:
            raise ValueError(
                f"sync_metrics: the total count of {raw.decode()!r} reached {int(c)} >= 2**53 "
                f"({2**53}), beyond what float64 counts exactly; sync (and reset) the counts "
                "more often."
            )


def sync_metrics(
    local: Mapping[str, tuple[float, int]], *, group: Any = None
) -> dict[str, MetricTotal]:
    """Every rank's ``{name: (sum, count)}`` in, the same ``{name: MetricTotal}`` out everywhere.

    The result holds the union of all ranks' names, in sorted order; a rank that saw no data
    passes ``{}`` and still gets the full result. All ranks of ``group`` must call it (it makes
    three collectives, the same three whatever the keys). Without a process group it returns
    the local metrics as totals. Every name and value is checked before the first collective:
    when one rank's input is bad (more than `MAX_KEYS` names, one longer than `MAX_KEY_BYTES`
    bytes or not valid text, a sum that is not a finite number, a count that is not a whole
    number in 0..`MAX_COUNT`), every rank raises the same `ValueError` naming that rank and
    key (without a group: `TypeError` for a wrong type). A total count of 2**53 or more, which
    float64 would round, is a `ValueError` on every rank too.

    Example::

        totals = sync_metrics({"seg/iou": (iou_sum, n)})
        print(totals["seg/iou"].mean)
    """
    try:
        entries, problem = _check_local(local), None
    except _BadInput as exc:
        entries, problem = {}, exc
    if not (dist.is_available() and dist.is_initialized()):
        if problem is not None:
            raise problem.kind(f"sync_metrics: {problem.reason}.")
        _check_totals(list(entries), [c for _, c in entries.values()])
        return {k.decode(): MetricTotal(s, c) for k, (s, c) in entries.items()}
    device = rank_device()
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    keys = list(entries)
    longest = max((len(k) for k in keys), default=0)
    # 1. agree on the shape of the key exchange, and on who (if anyone) holds bad input: the
    #    caps and every value were checked above, so one rank's bad input stops every rank here
    bad = 0 if problem is None else me + 1
    sizes = torch.tensor([len(keys), longest, bad], dtype=torch.int64, device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    n_max, len_max, bad = (int(v) for v in sizes.tolist())
    if bad:
        reason = _reason_of(bad - 1, problem, device, group)
        raise ValueError(
            f"sync_metrics: rank {bad - 1} (at least) {reason} (this is rank {me}). No rank "
            "synced anything; fix that rank's metrics before syncing."
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
    for i, raw in enumerate(names):
        if raw in entries:
            values[i, 0], values[i, 1] = entries[raw]
    values = values.to(device)
    dist.all_reduce(values, group=group)
    out = values.cpu().tolist()
    _check_totals(names, [c for _, c in out])  # the same totals, so the same verdict, everywhere
    return {raw.decode(): MetricTotal(s, int(c)) for raw, (s, c) in zip(names, out, strict=True)}
