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


def buffer_parity() -> dict[str, bool]:
    """BatchNorm buffers of MiniDDP(forward_sync_buffers=True) equal DDP's after a sequence of
    training forwards, a no_sync micro-step and an evaluation forward under no_grad (DDP's rule:
    a forward re-broadcasts only if the previous one was a synchronising training forward);
    plain MiniDDP lets the ranks drift apart."""
    rank = dist.get_rank()
    results = {}
    states = []
    for wrap in (
        lambda m: DDP(m),
        lambda m: MiniDDP(m, forward_sync_buffers=True),
        lambda m: MiniDDP(m),
    ):
        torch.manual_seed(0)
        bn = torch.nn.BatchNorm1d(4)
        model = wrap(torch.nn.Sequential(bn, torch.nn.Linear(4, 1)))
        for step in range(4):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank)) + rank
            if step == 1:
                with model.no_sync():
                    model(x).sum().backward()
            elif step == 2:
                with torch.no_grad():
                    model(x)
            else:
                model(x).sum().backward()
        states.append(torch.cat([bn.running_mean.clone(), bn.running_var.clone()]))
    gathered = [torch.empty_like(states[2]) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, states[2])
    results["sync equals DDP"] = torch.equal(states[0], states[1])
    results["plain MiniDDP differs across ranks"] = not torch.equal(gathered[0], gathered[1])
    return results
