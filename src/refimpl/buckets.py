"""Chapters 2–3: how DDP groups gradients into buckets, and a picture of the grouping.

One all-reduce per parameter pays the per-call latency hundreds of times; one all-reduce for
the whole model cannot start until the last gradient exists. DDP cuts the difference: it walks
the parameters in the order their gradients are expected to become ready (reverse definition
order, because backward runs the layers last-to-first) and closes a bucket as soon as its bytes
reach the cap. The first bucket gets a smaller cap so that communication starts early.

`assign_buckets` reproduces the rule of PyTorch's ``compute_bucket_assignment_by_size``
(``torch/csrc/distributed/c10d/reducer.cpp``) exactly; ``tests/test_ddp.py`` checks it against
``torch.distributed._compute_bucket_assignment_by_size`` and against a live
``DistributedDataParallel``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "DEFAULT_FIRST_BUCKET_MB",
    "MB",
    "assign_buckets",
    "bucket_bytes",
    "draw_buckets",
    "draw_timeline",
]

MB = 1024 * 1024
"""PyTorch's "MB" in ``bucket_cap_mb`` is a mebibyte."""
DEFAULT_FIRST_BUCKET_MB = 1.0
"""``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` in MB: DDP's first bucket when you leave
``bucket_cap_mb`` at its default."""


def assign_buckets(
    params: Sequence[torch.Tensor],
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float | None = DEFAULT_FIRST_BUCKET_MB,
    order: Sequence[int] | None = None,
) -> list[list[int]]:
    """Group parameter indices into gradient buckets with PyTorch's partition rule.

    Parameters are visited in ``order`` (default: reverse definition order, the order backward
    is expected to produce their gradients). Each (dtype, device) pair fills its own open
    bucket; a bucket is closed the moment its bytes reach its cap. The first bucket closed for
    a (dtype, device) uses ``first_bucket_mb`` (``None``: same as ``bucket_cap_mb``), every
    later one ``bucket_cap_mb``. Returns the buckets in the order they were opened, each a
    list of indices into ``params`` in visiting order: bucket 0 is the first one whose
    gradients are complete, so its all-reduce is the first to start.

    Example: ``assign_buckets(list(model.parameters()), bucket_cap_mb=5)``.
    """
    if bucket_cap_mb <= 0 or (first_bucket_mb is not None and first_bucket_mb <= 0):
        raise ValueError(
            f"bucket sizes must be positive, got bucket_cap_mb={bucket_cap_mb}, "
            f"first_bucket_mb={first_bucket_mb}"
        )
    visit = list(reversed(range(len(params)))) if order is None else list(order)
    if sorted(visit) != list(range(len(params))):
        raise ValueError(
            f"order must be a permutation of 0..{len(params) - 1}; got {len(visit)} entries"
        )
    first = bucket_cap_mb if first_bucket_mb is None else first_bucket_mb
    # Same arithmetic as PyTorch: caps are whole bytes, compared with ">=".
    limits = [int(first * MB), int(bucket_cap_mb * MB)]
    closed: list[list[int]] = []
    opened: list[list[int]] = []  # closed and still-open buckets, in the order they opened
    open_bucket: dict[tuple[torch.dtype, torch.device], tuple[list[int], list[int]]] = {}
    for i in visit:
        p = params[i]
        key = (p.dtype, p.device)
        if key not in open_bucket:
            # [indices], [bytes so far, how many buckets this key has closed]
            open_bucket[key] = ([], [0, 0])
            opened.append(open_bucket[key][0])
        indices, state = open_bucket[key]
        indices.append(i)
        state[0] += p.numel() * p.element_size()
        if state[0] >= limits[min(state[1], len(limits) - 1)]:
            closed.append(indices)
            del open_bucket[key]
            # The next bucket of this key uses the next cap (and then stays on the last one).
            open_bucket[key] = ([], [0, state[1] + 1])
            opened.append(open_bucket[key][0])
    # PyTorch emits closed buckets first, then the still-open ones; with one dtype that is
    # the opening order. Keep its order exactly, and drop buckets left empty.
    leftovers = [b for b in opened if b and not any(b is c for c in closed)]
    return [b for b in closed + leftovers if b]


def bucket_bytes(params: Sequence[torch.Tensor], buckets: Sequence[Sequence[int]]) -> list[int]:
    """Bytes of gradient each bucket carries (what one all-reduce of that bucket moves)."""
    return [sum(params[i].numel() * params[i].element_size() for i in b) for b in buckets]


def draw_buckets(
    params: Sequence[torch.Tensor],
    buckets: Sequence[Sequence[int]],
    names: Sequence[str] | None = None,
    ax: Any = None,
    title: str = "",
) -> Any:
    """Draw parameters (in gradient-ready order) as bars coloured by bucket; returns the axes.

    Bar width is the parameter's size in MB, so a bucket's width is the bytes one all-reduce
    moves. Needs matplotlib (the ``plot`` extra).
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 1.8))
    colors = plt.get_cmap("tab10")
    sizes = [p.numel() * p.element_size() / MB for p in params]
    total = sum(sizes[i] for bucket in buckets for i in bucket)
    left = 0.0
    for b, bucket in enumerate(buckets):
        start = left
        for i in bucket:
            ax.barh(0, sizes[i], left=left, color=colors(b % 10), edgecolor="white", lw=0.5)
            if names is not None and sizes[i] > 0.08 * total:  # only where the name fits
                ax.text(left + sizes[i] / 2, -0.2, names[i], ha="center", va="center", size=9)
            left += sizes[i]
        ax.axvline(left, color="black", linewidth=1)
        if left - start > 0.04 * total:
            ax.text((start + left) / 2, 0.2, f"b{b}", ha="center", va="center", size=10)
    ax.set_yticks([])
    ax.set_xlim(0, left)
    ax.set_xlabel("gradient bytes in ready order (MB); colour = bucket")
    ax.set_title(title or f"{len(buckets)} bucket(s)")
    return ax


def draw_timeline(trace: dict[str, Any], ax: Any = None, title: str = "") -> Any:
    """Draw one traced backward (`refimpl.demos.buckets.timeline`): a tick per gradient, a bar
    per all-reduce from launch to completion, coloured by bucket; returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 2.2))
    colors = plt.get_cmap("tab10")
    bucket_of = {i: b for b, bucket in enumerate(trace["buckets"]) for i in bucket}
    launched: dict[int, float] = {}
    for t, kind, i in trace["events"]:
        ms = 1e3 * t
        if kind == "grad":
            ax.plot([ms, ms], [1.6, 2.4], color=colors(bucket_of[i] % 10), linewidth=2)
        elif kind == "launch":
            launched[i] = ms
        elif kind == "done" and i in launched:
            color = colors(i % 10) if len(trace["buckets"]) < 100 else "grey"
            ax.barh(1 - 0.5 * (i % 2), ms - launched[i], left=launched[i], height=0.4, color=color)
    ax.axvline(1e3 * trace["backward_returned"], color="black", linestyle="--", linewidth=1)
    ax.set_yticks([0.75, 2], ["all-reduce", "gradient\nready"])
    ax.set_xlabel("ms since loss.backward() was called (dashed: backward() returned)")
    ax.set_title(title)
    return ax
