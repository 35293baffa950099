"""Test-only workers for tests/test_ddp.py (workers must live in an importable module)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from refimpl.ddp import MiniDDP, NaiveDDP
from refimpl.demos.ddp import Branchy, make_mlp


def unused_parity(rank_that_skips: int | None) -> dict[str, object]:
    """DDP(find_unused_parameters=True) vs MiniDDP(find_unused_parameters=True) when one rank
    (or, with None, every rank) skips the branch."""
    base = Branchy(seed=dist.get_rank())
    ref = DDP(copy.deepcopy(base), find_unused_parameters=True)
    mine = MiniDDP(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=0.0005)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    use = rank_that_skips is not None and dist.get_rank() != rank_that_skips
    for model in (ref, mine):
        model(x, use_branch=use).sum().backward()
    grads = {}
    for (name, p), q in zip(ref.module.named_parameters(), mine.module.parameters(), strict=True):
        if p.grad is None or q.grad is None:
            grads[name] = (p.grad is None, q.grad is None)
        else:
            grads[name] = float((p.grad - q.grad).abs().max())
    return grads


def naive_matches_mini() -> float:
    """NaiveDDP and MiniDDP give the same averaged gradients."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    grads = []
    for wrap in (NaiveDDP, MiniDDP):
        model = wrap(make_mlp(seed=dist.get_rank()))
        model(x).pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    return max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))


def buffers_broadcast() -> bool:
    """Buffers (BatchNorm running stats) come from rank 0 too."""
    bn = torch.nn.BatchNorm1d(4)
    bn.running_mean.fill_(float(dist.get_rank()))
    MiniDDP(bn)
    return bool(torch.all(bn.running_mean == 0))
