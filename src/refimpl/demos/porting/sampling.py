"""Chapter 12: what each way of drawing nanoGPT's training offsets costs at OpenWebText's size.

A permutation of every offset (`refimpl.data.ResumableSampler`, without replacement) is built
once per epoch and held: ``8 * n`` bytes of int64 for ``n`` offsets, and the time of
``torch.randperm(n)``. `refimpl.data.RandomOffsets` (with replacement, as nanoGPT's
``torch.randint`` draws) holds one batch and pays a small cost per batch. `sampling_costs`
measures both here at a size that fits, and scales them by arithmetic to ``n`` offsets (the
permutation's time grows linearly in ``n``, as its memory does; the offsets' cost per batch
does not depend on ``n``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from refimpl.data import RandomOffsets

__all__ = ["OPENWEBTEXT_TOKENS", "SamplingCosts", "sampling_costs"]

OPENWEBTEXT_TOKENS = 9_035_582_198
"""Tokens in nanoGPT's OpenWebText ``train.bin`` (its ``prepare.py`` reports 9,035,582,198;
the file is 17 GB of uint16): the offsets a permutation of it must hold, near enough."""


@dataclass(frozen=True)
class SamplingCosts:
    """Measured at ``measured_n`` offsets and scaled to ``n``: the permutation's bytes and
    seconds per epoch; `RandomOffsets`' bytes (one batch) and seconds per batch, and its
    seconds for as many offsets as one epoch of the permutation holds."""

    n: int
    measured_n: int
    batch_size: int
    permutation_bytes: int
    permutation_s: float
    offsets_bytes: int
    offsets_s_per_batch: float
    offsets_s_per_epoch: float


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def sampling_costs(
    n: int = OPENWEBTEXT_TOKENS,
    *,
    measured_n: int = 10_000_000,
    batch_size: int = 12,
    batches: int = 2_000,
    repeats: int = 3,
) -> SamplingCosts:
    """Time ``torch.randperm(measured_n)`` and ``batches`` draws of `RandomOffsets` (best of
    ``repeats``), here, and scale to ``n`` offsets. ``batch_size`` is nanoGPT's per-GPU
    default for OpenWebText (12). Raises `ValueError` unless ``0 < measured_n <= n`` and the
    other counts are positive."""
    if not 0 < measured_n <= n or min(batch_size, batches, repeats) < 1:
        raise ValueError(
            f"need 0 < measured_n <= n and positive counts, got n={n}, measured_n={measured_n}, "
            f"batch_size={batch_size}, batches={batches}, repeats={repeats}"
        )
    perm_s = _best(lambda: torch.randperm(measured_n), repeats) * n / measured_n

    def draw() -> None:
        offsets = RandomOffsets(n, batch_size, seed=1337, rank=0, world_size=1)
        for _ in range(batches):
            offsets.next()

    per_batch = _best(draw, repeats) / batches
    return SamplingCosts(
        n=n,
        measured_n=measured_n,
        batch_size=batch_size,
        permutation_bytes=8 * n,
        permutation_s=perm_s,
        offsets_bytes=8 * batch_size,
        offsets_s_per_batch=per_batch,
        offsets_s_per_epoch=per_batch * n / batch_size,
    )
