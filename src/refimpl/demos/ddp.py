"""Chapter 2: the models the DDP chapters train, and the core workers they spawn.

Parity with torch's DDP, construction, hook order, unused parameters, gradient storage;
the details (`refimpl.demos.ddp_details`) and chapter 3's workers (`refimpl.demos.buckets`)
build on these models.

Each function runs on every rank under `refimpl.launch.spawn` and returns plain data
(numbers, lists, strings), so the notebook prints one deterministic result per rank.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from refimpl.buckets import assign_buckets
from refimpl.ddp import MiniDDP, fp16_compress_hook
from refimpl.device import rank_device

__all__ = [
    "Branchy",
    "amp_step",
    "batch_split_matches_full_batch",
    "broadcast_at_construction",
    "grad_storage",
    "hook_and_launch_order",
    "make_mlp",
    "no_sync_step",
    "parity_with_torch_ddp",
    "torch_ddp_buckets",
    "unused_parameter_step",
]


def make_mlp(widths: tuple[int, ...] = (32, 64, 64, 8), seed: int = 0) -> nn.Sequential:
    """A ReLU MLP with the given layer widths, initialised from ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class Branchy(nn.Module):
    """An MLP with an optional middle branch: a forward with ``use_branch=False`` leaves
    ``branch.weight`` and ``branch.bias`` without a gradient (think: a mixture-of-experts
    expert no token was routed to, or an auxiliary head used on some batches only)."""

    def __init__(self, width: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(8, width)
        self.branch = nn.Linear(width, width)
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if use_branch:
            h = h + torch.relu(self.branch(h))
        out: torch.Tensor = self.out(h)
        return out


def _batch(step: int, micro: int, n: int = 8, dim: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return torch.randn(n, dim, generator=g)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def broadcast_at_construction() -> tuple[float, float]:
    """Each rank seeds its model differently; returns (first weight before, after) MiniDDP."""
    model = make_mlp(seed=dist.get_rank())
    first = next(model.parameters())  # layer 0's weight
    before = float(first[0, 0])
    MiniDDP(model)
    return round(before, 4), round(float(first[0, 0]), 4)


def parity_with_torch_ddp(
    steps: int = 4, micro_steps: int = 2, bucket_cap_mb: float = 0.01, fp16: bool = False
) -> dict[str, Any]:
    """Train torch DDP and MiniDDP side by side (same start, data, SGD) with gradient
    accumulation; every rank starts from a different random model. Returns the largest
    gradient and parameter differences seen, and whether the replicas stayed identical."""
    device = rank_device()  # CPU under gloo, cuda:LOCAL_RANK under torchrun with NCCL
    base = make_mlp(seed=17 + dist.get_rank()).to(device)  # different weights on every rank
    ref = DDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb)
    mine = MiniDDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb)
    if fp16:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ref.register_comm_hook(None, default_hooks.fp16_compress_hook)
        mine.comm_hook = fp16_compress_hook
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, mine)]
    grad_diff = 0.0
    for step in range(steps):
        for model in (ref, mine):
            for micro in range(micro_steps):
                x = _batch(step, micro).to(device)
                sync = contextlib_null() if micro == micro_steps - 1 else model.no_sync()
                with sync:
                    model(x).pow(2).mean().backward()
        grads = [[p.grad for p in m.parameters()] for m in (ref, mine)]
        grad_diff = max(grad_diff, _max_diff(*grads))  # type: ignore[arg-type]
        for opt in opts:
            opt.step()
            opt.zero_grad()
    params = [[p.detach() for p in m.parameters()] for m in (ref, mine)]
    flat = torch.cat([p.reshape(-1) for p in params[1]])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return {
        "max_grad_diff": grad_diff,
        "max_param_diff": _max_diff(*params),
        "replicas_equal": all(torch.equal(gathered[0], g) for g in gathered),
        "buckets": len(mine.buckets),
    }


def contextlib_null() -> Any:
    """A do-nothing context manager (the synchronising micro-step)."""
    import contextlib

    return contextlib.nullcontext()


def hook_and_launch_order(bucket_cap_mb: float = 0.01) -> list[str]:
    """One traced backward: the order hooks fire and buckets launch (deterministic)."""
    model = MiniDDP(make_mlp(), bucket_cap_mb=bucket_cap_mb, trace=True)
    model(_batch(0, 0)).sum().backward()
    names = model.names
    return [
        f"grad {names[i]}" if kind == "grad" else f"launch bucket {i}"
        for _, kind, i in model.events
        if kind in ("grad", "launch")
    ]


def torch_ddp_buckets(bucket_cap_mb: float | None = None) -> dict[str, Any]:
    """What a real DDP does with its buckets: at construction, after 1 and after 2 steps;
    plus the gradient-ready order it saw and `assign_buckets` fed with that order."""
    model = make_mlp((256, 512, 512, 512, 8))
    ddp = DDP(model) if bucket_cap_mb is None else DDP(model, bucket_cap_mb=bucket_cap_mb)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    ready: list[int] = []
    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda _, i=i: ready.append(i))  # type: ignore[no-untyped-call]

    def now() -> list[list[int]]:
        zeros = ddp.reducer._get_zeros_like_grad_buckets()
        return [[index[id(p)] for p in b.parameters()] for b in zeros]

    seen = {"construction": now()}
    for step in (1, 2):
        ddp(torch.randn(4, 256)).sum().backward()
        seen[f"after step {step}"] = now()
    params = list(model.parameters())
    cap = 25.0 if bucket_cap_mb is None else bucket_cap_mb
    first = 1.0 if bucket_cap_mb is None else None
    order = ready[: len(params)]
    return {
        **seen,
        "ready order": order,
        "assign_buckets": assign_buckets(params, cap, first, order=order),
    }


def unused_parameter_step(find_unused: bool, hold_s: float = 0.0) -> str:
    """Rank 1's batch skips the branch. Returns what happened on this rank, as text.

    With ``hold_s > 0`` each rank catches its own error and rank 1 stays alive that long, so
    rank 0's side of the story (waiting for an all-reduce nobody started) can be seen too."""
    model = MiniDDP(Branchy(), bucket_cap_mb=0.0005, find_unused_parameters=find_unused)
    rank = dist.get_rank()
    start = time.monotonic()
    try:
        model(torch.ones(4, 8), use_branch=rank != 1).sum().backward()
        p = dict(model.module.named_parameters())["branch.weight"]
        outcome = f"ok, branch.weight.grad is {'None' if p.grad is None else 'set'}"
    except RuntimeError as exc:
        if hold_s <= 0:
            raise
        waited = time.monotonic() - start
        outcome = (
            f"RuntimeError after waiting {'>= 2' if waited >= 2 else '< 2'} s: "
            + str(exc).split(". ")[0]
        )
    if hold_s > 0 and rank == 1:
        time.sleep(hold_s)  # rank 1 "moves on" to its next batch, leaving rank 0 waiting
    return outcome


def no_sync_step() -> dict[str, Any]:
    """A backward inside ``no_sync()`` launches no all-reduce and leaves gradients local;
    the next backward outside it all-reduces the accumulated sum."""
    model = MiniDDP(make_mlp(), bucket_cap_mb=0.01)
    x = _batch(0, 0)
    with model.no_sync():
        model(x).sum().backward()
    first = next(model.parameters()).grad
    assert first is not None
    inside = {"all-reduces launched": len(model.futures), "grads equal across ranks": _same(first)}
    model(x).sum().backward()
    first = next(model.parameters()).grad  # now a view of its bucket, the averaged sum
    assert first is not None
    after = {"all-reduces launched": len(model.futures), "grads equal across ranks": _same(first)}
    return {"inside no_sync": inside, "next backward": after}


def _same(t: torch.Tensor) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return all(torch.equal(parts[0], q) for q in parts)


def amp_step() -> dict[str, str]:
    """A MiniDDP step under CPU autocast (bfloat16): activations in bf16, gradients and the
    all-reduce stay float32 because the parameters are float32."""
    model = MiniDDP(make_mlp())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(_batch(0, 0))
    out.float().pow(2).mean().backward()
    grad = next(model.module.parameters()).grad
    assert grad is not None
    flat = grad.reshape(-1).clone()
    other = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(other, flat)
    return {
        "output dtype": str(out.dtype),
        "grad dtype": str(grad.dtype),
        "grads equal on all ranks": str(all(torch.equal(other[0], o) for o in other)),
    }


def batch_split_matches_full_batch(per_rank: int = 4) -> float:
    """Each rank takes ``per_rank`` rows of one global batch; returns the largest difference
    between MiniDDP's averaged gradient and a single process's gradient on the whole batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    full = torch.randn(per_rank * world, 32, generator=torch.Generator().manual_seed(5))
    single = make_mlp()
    single(full).pow(2).mean().backward()
    model = MiniDDP(make_mlp())
    model(full[rank * per_rank : (rank + 1) * per_rank]).pow(2).mean().backward()
    return _max_diff(
        [p.grad for p in model.parameters()],  # type: ignore[misc]
        [p.grad for p in single.parameters()],  # type: ignore[misc]
    )


# --- Chapter 2: what PyTorch's DDP does, observed on gloo ----------------------------------


def grad_storage(steps: int = 2) -> dict[str, str]:
    """How many separate storages the parameters' ``.grad`` tensors use after ``steps`` steps:
    one per parameter when DDP copies the averaged bucket back (its default), one per bucket
    when ``.grad`` is a view of the bucket (``gradient_as_bucket_view=True``, and MiniDDP)."""
    wrappers: dict[str, Callable[[nn.Module], nn.Module]] = {
        "DDP(model)": lambda m: DDP(m, bucket_cap_mb=0.01),
        "DDP(model, gradient_as_bucket_view=True)": lambda m: DDP(
            m, bucket_cap_mb=0.01, gradient_as_bucket_view=True
        ),
        "MiniDDP(model)": lambda m: MiniDDP(m, bucket_cap_mb=0.01),
    }
    out = {}
    for label, wrap in wrappers.items():
        model = make_mlp()
        ddp = wrap(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for step in range(steps):
            opt.zero_grad()  # set_to_none=True, the default
            ddp(_batch(step, 0)).sum().backward()
            opt.step()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        storages = {g.untyped_storage().data_ptr() for g in grads}
        out[label] = f"{len(grads)} gradients in {len(storages)} storage(s)"
    return out


def main() -> None:
    """``python -m refimpl.demos.ddp``: MiniDDP vs torch DDP parity, on 2 local gloo ranks or
    under ``torchrun --nproc-per-node=N -m refimpl.demos.ddp`` (rank 0 prints)."""
    import os

    from refimpl.launch import init_from_env, spawn

    if "RANK" in os.environ:
        rank = init_from_env().rank
        result = parity_with_torch_ddp()
        if rank != 0:
            return
    else:
        result = spawn(parity_with_torch_ddp, 2, timeout_s=120)[0]
    print(f"MiniDDP vs DistributedDataParallel after 4 steps: {result}")


if __name__ == "__main__":
    main()
