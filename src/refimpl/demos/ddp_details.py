"""Chapter 2's second half: the DDP details that bite, each as a worker to spawn.

Buffers at construction and their drift without a re-sync, where ``no_sync`` must sit,
gradient accumulation against the global batch, uneven inputs and ``Join``, the error DDP
raises for a parameter without a gradient, the bucket rebuild that follows rank 0, and why
a different bucket layout changes the last bits of a sum.
Like `refimpl.demos.ddp`, each returns plain data so the notebook prints one deterministic
result per rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from refimpl.buckets import assign_buckets
from refimpl.ddp import MiniDDP
from refimpl.demos.ddp import Branchy, _batch, _max_diff, _same, contextlib_null, make_mlp

__all__ = [
    "RankOrdered",
    "accumulation_matches_global_batch",
    "buffer_drift",
    "buffers_at_construction",
    "checkpoint_twice",
    "ddp_unused_parameter",
    "join_uneven_inputs",
    "no_sync_placement",
    "rebuild_follows_rank0",
    "sum_order_by_layout",
    "trim_ddp_error",
]


def _rank_data(n: int, dim: int, step: int) -> torch.Tensor:
    """Rank r's inputs have mean r: the ranks see differently distributed data."""
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(n, dim, generator=g) + float(dist.get_rank())


def buffers_at_construction() -> dict[str, str]:
    """BatchNorm buffers start rank-dependent; which DDP arguments sync them at construction,
    and which warn (``broadcast_buffers`` is deprecated in favour of ``forward_sync_buffers``)."""
    import warnings

    out = {}
    settings: list[dict[str, Any]] = [{}, {"broadcast_buffers": False}]
    settings.append({"forward_sync_buffers": False})
    for kwargs in settings:
        bn = nn.BatchNorm1d(4)
        running_mean = cast(torch.Tensor, bn.running_mean)
        running_mean.fill_(float(dist.get_rank()))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DDP(nn.Sequential(nn.Linear(4, 4), bn), **kwargs)
        future = [str(w.message).split(". ")[0] for w in caught if w.category is FutureWarning]
        args = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        out[f"DDP(model{', ' if args else ''}{args})"] = (
            f"buffers equal after construction: {_same(running_mean)}"
            + (f"; FutureWarning: {future[0]}" if future else "")
        )
    return out


def buffer_drift(steps: int = 30) -> dict[str, str]:
    """Train a BatchNorm model ``steps`` steps; rank r's inputs have mean r (global mean 0.5).
    Returns each wrapper's ``running_mean[0]`` on every rank after the last step."""
    wrappers: dict[str, Callable[[nn.Module], nn.Module]] = {
        "MiniDDP(model)": lambda m: MiniDDP(m),
        "MiniDDP(model, forward_sync_buffers=True)": lambda m: MiniDDP(
            m, forward_sync_buffers=True
        ),
        "DDP(model)": lambda m: DDP(m),
    }
    out = {}
    for label, wrap in wrappers.items():
        torch.manual_seed(0)
        bn = nn.BatchNorm1d(4)
        ddp = wrap(nn.Sequential(bn, nn.Linear(4, 1)))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for step in range(steps):
            ddp(_rank_data(16, 4, step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        means = [torch.empty(1) for _ in range(dist.get_world_size())]
        dist.all_gather(means, cast(torch.Tensor, bn.running_mean)[:1].clone())
        out[label] = ", ".join(f"rank {r}: {float(m):.2f}" for r, m in enumerate(means))
    try:
        sync = nn.SyncBatchNorm(4)
        sync(_rank_data(16, 4, 0))
        out["nn.SyncBatchNorm on CPU"] = "ran"
    except ValueError as exc:
        out["nn.SyncBatchNorm on CPU"] = f"ValueError: {exc}"
    return out


def no_sync_placement() -> dict[str, dict[str, bool]]:
    """Where must forward and backward be for ``no_sync()`` to skip the all-reduce? For DDP
    and MiniDDP, whether the gradients came out equal on all ranks (i.e. were all-reduced)."""
    placements = (
        "forward and backward inside",
        "forward outside, backward inside",
        "forward inside, backward outside",
    )
    out: dict[str, dict[str, bool]] = {p: {} for p in placements}
    for impl in ("DDP", "MiniDDP"):
        for placement in placements:
            model = make_mlp()
            ddp = DDP(model) if impl == "DDP" else MiniDDP(model)
            x = _batch(0, 0)
            if placement == "forward and backward inside":
                with ddp.no_sync():
                    ddp(x).sum().backward()
            elif placement == "forward outside, backward inside":
                loss = ddp(x).sum()
                with ddp.no_sync():
                    loss.backward()
            else:
                with ddp.no_sync():
                    loss = ddp(x).sum()
                loss.backward()
            grad = next(model.parameters()).grad
            assert grad is not None
            out[placement][impl] = _same(grad)
    return out


def accumulation_matches_global_batch(per_rank: int = 4, micro_steps: int = 2) -> float:
    """DDP with gradient accumulation (forward and backward inside ``no_sync()`` for all but
    the last micro-step, loss divided by ``micro_steps``) against one process on the global
    batch of ``per_rank * world_size * micro_steps`` rows; returns the largest difference."""
    world, rank = dist.get_world_size(), dist.get_rank()
    full = torch.randn(
        per_rank * world * micro_steps, 32, generator=torch.Generator().manual_seed(5)
    )
    single = make_mlp()
    single(full).pow(2).mean().backward()
    model = DDP(make_mlp())
    chunks = full.chunk(micro_steps * world)  # micro-step m of rank r: chunk m * world + r
    for m in range(micro_steps):
        ctx = model.no_sync() if m < micro_steps - 1 else contextlib_null()
        with ctx:
            (model(chunks[m * world + rank]).pow(2).mean() / micro_steps).backward()
    return _max_diff(
        [p.grad for p in model.parameters()],  # type: ignore[misc]
        [p.grad for p in single.parameters()],  # type: ignore[misc]
    )


def ddp_unused_parameter(debug: str = "OFF", hold_s: float = 0.0) -> str:
    """Real DDP (``find_unused_parameters=False``) on `Branchy`; rank 1 skips the branch.
    ``debug`` is ``TORCH_DISTRIBUTED_DEBUG`` (set here and re-read, as ``import
    torch.distributed`` does). With ``hold_s == 0`` rank 1's error propagates; otherwise each
    rank returns its own error and rank 1 stays alive ``hold_s`` so rank 0's side is seen."""
    import os

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = debug
    dist.set_debug_level_from_env()  # type: ignore[attr-defined]
    rank = dist.get_rank()
    model = DDP(Branchy())  # built after the debug level is set: it records parameter names
    step = 0
    try:
        for n in (1, 2):
            step = n
            model(torch.ones(4, 8), use_branch=rank != 1).sum().backward()
        outcome = "two steps, no error"
    except RuntimeError as exc:
        if hold_s <= 0:
            raise
        outcome = f"step {step}: {exc}"
    if rank == 1:
        time.sleep(hold_s)
    return outcome


def trim_ddp_error(message: str) -> str:
    """The lines of DDP's unused-parameter error that carry information: its first sentence,
    and the lines that name parameters."""
    first = message.split(". ")[0] + "."
    named = [line.strip() for line in message.splitlines() if line.startswith("Parameter")]
    return "\n".join([first, *named])


class RankOrdered(nn.Module):
    """Three square layers, applied a -> b -> c on rank 0 and c -> b -> a on the other ranks,
    so each rank's gradients become ready in a different order."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = [self.a, self.b, self.c]
        for layer in layers if dist.get_rank() == 0 else layers[::-1]:
            x = torch.relu(layer(x))
        return x


def _ddp_buckets(ddp: DDP, index: dict[int, int]) -> list[list[int]]:
    return [
        [index[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()
    ]


def rebuild_follows_rank0(bucket_cap_mb: float = 0.3) -> dict[str, Any]:
    """Rank-dependent gradient order (`RankOrdered`): each rank's own ready order, the buckets
    after steps 1-3 for four DDP settings, and `assign_buckets` fed with rank 0's order."""
    settings = {
        "DDP(model)": {},
        "static_graph=True": {"static_graph": True},
        "find_unused_parameters=True": {"find_unused_parameters": True},
        "static_graph=True, find_unused_parameters=True": {
            "static_graph": True,
            "find_unused_parameters": True,
        },
    }
    out: dict[str, Any] = {}
    for label, kwargs in settings.items():
        model = RankOrdered()
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, **kwargs)  # type: ignore[arg-type]
        params = list(model.parameters())
        index = {id(p): i for i, p in enumerate(params)}
        ready: list[int] = []
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                lambda _, i=i, seen=ready: seen.append(i)
            )
        buckets = [_ddp_buckets(ddp, index)]
        for step in range(3):
            ddp(_batch(step, 0, 4, 256)).sum().backward()
            buckets.append(_ddp_buckets(ddp, index))
        order = ready[: len(params)]
        orders = [torch.empty(len(order), dtype=torch.long) for _ in range(dist.get_world_size())]
        dist.all_gather(orders, torch.tensor(order))
        out[label] = {
            "ready order": order,
            "buckets": buckets,  # construction, after step 1, 2, 3
            "assign_buckets(rank 0's order)": assign_buckets(
                params, bucket_cap_mb, None, order=orders[0].tolist()
            ),
            "assign_buckets(own order)": assign_buckets(params, bucket_cap_mb, None, order=order),
        }
    return out


def join_uneven_inputs(use_join: bool, hold_s: float = 4.0) -> str:
    """Rank 0 has 3 batches, rank 1 has 2. Without ``Join`` rank 0's third backward waits for an
    all-reduce rank 1 never starts (until the collective timeout); inside ``Join([model])`` the
    rank that runs out shadows the others' all-reduces and everyone finishes."""
    from torch.distributed.algorithms.join import Join

    rank = dist.get_rank()
    model = DDP(make_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [_batch(step, 0) for step in range(3 if rank == 0 else 2)]
    done = 0
    try:
        with Join([model]) if use_join else contextlib_null():
            for x in batches:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                done += 1
        outcome = f"finished its {done} batches"
    except RuntimeError as exc:
        outcome = f"stopped after {done} batches: {str(exc).splitlines()[0]}"
    if rank == 1 and not use_join:
        time.sleep(hold_s)  # stay alive, as a rank busy with evaluation would
    return outcome


def sum_order_by_layout(numel: int = 1000, shifts: tuple[int, ...] = (1, 7, 100)) -> dict[str, int]:
    """Worker: does an all-reduced sum depend on where the values sit in the buffer?

    Each rank draws ``numel`` random values (seeded by its rank), divides them by the world
    size as DDP's Reducer and MiniDDP divide gradients, and all-reduces them at offset 0 of a
    flat buffer, then shifted by each of ``shifts`` elements and split into two buckets, as
    another bucket layout would place them. Returns, per layout, how many of the ``numel``
    sums differ in any bit from the offset-0 ones.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    values = torch.randn(numel, generator=torch.Generator().manual_seed(rank)) / world
    reference = values.clone()
    dist.all_reduce(reference)
    out = {}
    for shift in shifts:
        buffer = torch.cat([torch.zeros(shift), values])
        dist.all_reduce(buffer)
        out[f"shifted by {shift}"] = int((buffer[shift:] != reference).sum())
    halves = [h.clone() for h in values.tensor_split(2)]
    for half in halves:
        dist.all_reduce(half)
    out["in two buckets"] = int((torch.cat(halves) != reference).sum())
    return out


class _CheckpointedTwice(nn.Module):
    """One ``Linear`` run twice in a forward, each time under activation checkpointing."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for _ in range(2):
            x = checkpoint(self.lin, x, use_reentrant=self.use_reentrant)
        return x


def checkpoint_twice(use_reentrant: bool, static_graph: bool) -> dict[str, Any]:
    """Worker: one layer checkpointed twice, under DDP with ``static_graph``, on inputs that
    differ by rank. Whether backward raised (its first line, else ``""``), whether this rank's
    gradient equals the average of the ranks' gradients computed without DDP, and whether
    every rank holds the same gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(_CheckpointedTwice(use_reentrant), static_graph=static_graph)
    torch.manual_seed(0)
    alone = _CheckpointedTwice(use_reentrant)
    x = torch.full((2, 4), float(rank + 1))
    alone(x.clone().requires_grad_()).sum().backward()
    want = cast(torch.Tensor, alone.lin.weight.grad).clone()
    dist.all_reduce(want)
    want /= world
    error = ""
    try:
        model(x.clone().requires_grad_()).sum().backward()
    except RuntimeError as exc:
        error = str(exc).splitlines()[0]
    got = model.module.lin.weight.grad
    got = torch.zeros(4, 4) if got is None else got.detach().clone()
    every = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(every, got)
    return {
        "error": error,
        "true average": not error and torch.allclose(got, want),
        "ranks agree": all(torch.equal(every[0], g) for g in every),
    }
