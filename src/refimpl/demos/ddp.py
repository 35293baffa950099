"""Chapters 2–3: the workers the DDP notebooks and tests spawn, and the models they train.

Each function runs on every rank under `refimpl.launch.spawn` and returns plain data
(numbers, lists, strings), so the notebook prints one deterministic result per rank.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from refimpl.buckets import assign_buckets
from refimpl.ddp import MiniDDP, NaiveDDP, fp16_compress_hook
from refimpl.device import rank_device

__all__ = [
    "Branchy",
    "RankOrdered",
    "accumulation_matches_global_batch",
    "amp_step",
    "batch_split_matches_full_batch",
    "broadcast_at_construction",
    "buffer_drift",
    "buffers_at_construction",
    "ddp_hook_trace",
    "ddp_statistics",
    "ddp_unused_parameter",
    "draw_ddp_hook_trace",
    "fp16_hook_error",
    "fp16_overflow",
    "grad_scaler_with_fp16_hook",
    "grad_storage",
    "hook_and_launch_order",
    "join_uneven_inputs",
    "make_mlp",
    "no_sync_placement",
    "no_sync_step",
    "parity_with_torch_ddp",
    "rebuild_follows_rank0",
    "timeline",
    "torch_ddp_buckets",
    "trim_ddp_error",
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


def timeline(
    impl: str = "mini",
    bucket_cap_mb: float = 5.0,
    widths: tuple[int, ...] = (1024,) * 9,
    batch: int = 64,
) -> dict[str, Any]:
    """Three traced training steps of `MiniDDP` (``impl="mini"``) or `NaiveDDP`; returns the
    last step's events in seconds since ``backward()`` was called, when it returned, and the
    buckets (for the naive version, one per parameter)."""
    model = make_mlp(widths)
    ddp: MiniDDP | NaiveDDP
    if impl == "naive":
        ddp = NaiveDDP(model, trace=True)
    else:
        ddp = MiniDDP(model, bucket_cap_mb=bucket_cap_mb, trace=True)
    x = torch.randn(batch, widths[0], generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(3):
        ddp.events.clear()
        loss = ddp(x).pow(2).mean()
        t0 = time.perf_counter()
        loss.backward()
        returned = time.perf_counter() - t0
        ddp.zero_grad()
    buckets = ddp.buckets if isinstance(ddp, MiniDDP) else [[i] for i in range(len(ddp.params))]
    return {
        "events": [(t - t0, kind, i) for t, kind, i in ddp.events],
        "backward_returned": returned,
        "buckets": buckets,
        "names": ddp.names,
    }


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


def fp16_hook_error(numel: int = 100_000) -> dict[str, float]:
    """All-reduce the same gradient bucket in fp32 and through `fp16_compress_hook`; returns
    bytes on the wire and the error fp16 adds (relative to the largest gradient)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    bucket = torch.randn(numel, generator=g) * 1e-3
    exact = bucket.clone()
    dist.all_reduce(exact)
    exact /= dist.get_world_size()
    compressed = fp16_compress_hook(bucket.clone()).wait()
    return {
        "fp32_bytes": float(exact.numel() * 4),
        "fp16_bytes": float(exact.numel() * 2),
        "max_rel_error": float((compressed - exact).abs().max() / exact.abs().max()),
    }


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
    placements = ("forward and backward inside", "forward outside, backward inside",
                  "forward inside, backward outside")  # fmt: skip
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
            "static_graph": True, "find_unused_parameters": True},
    }  # fmt: skip
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


def ddp_hook_trace(widths: tuple[int, ...] = (512,) * 9, steps: int = 3) -> dict[str, Any]:
    """Record a real DDP (default arguments) during ``steps`` training steps: when each
    parameter's gradient became ready, and when each bucket's all-reduce was launched and
    completed (through a comm hook wrapping PyTorch's plain ``allreduce_hook``). Times are
    seconds since ``backward()`` was called; one entry per step."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = make_mlp(widths)
    ddp = DDP(model)
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    events: list[tuple[float, str, int]] = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            lambda _, i=i: events.append((time.perf_counter(), "grad", i))
        )

    # No annotations: DDP's register_comm_hook compares them with the real classes, and this
    # module's `from __future__ import annotations` would turn them into strings.
    def recording_hook(state, bucket):  # type: ignore[no-untyped-def]
        b = bucket.index()
        events.append((time.perf_counter(), "launch", b))
        fut = default_hooks.allreduce_hook(state, bucket)

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            events.append((time.perf_counter(), "done", b))
            return f.value()

        return fut.then(done)

    ddp.register_comm_hook(None, recording_hook)
    x = torch.randn(32, widths[0], generator=torch.Generator().manual_seed(dist.get_rank()))
    trace = []
    for _ in range(steps):
        events.clear()
        loss = ddp(x).pow(2).mean()
        buckets = _ddp_buckets(ddp, index)  # rebuilt (once) at the start of this forward
        t0 = time.perf_counter()
        loss.backward()
        returned = time.perf_counter() - t0
        ddp.zero_grad()
        trace.append({
            "events": [(t - t0, kind, i) for t, kind, i in sorted(events)],
            "buckets": buckets, "backward_returned": returned,
        })  # fmt: skip
    return {"steps": trace, "names": [n for n, _ in model.named_parameters()]}


def draw_ddp_hook_trace(step: dict[str, Any], names: list[str], ax: Any, title: str) -> Any:
    """One step of `ddp_hook_trace`: a dot per gradient (row = parameter, colour = bucket) and
    a bar per bucket all-reduce from launch to completion, along the time axis."""
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10")
    bucket_of = {i: b for b, bucket in enumerate(step["buckets"]) for i in bucket}
    launched: dict[int, float] = {}
    n = len(names)
    for t, kind, i in step["events"]:
        if kind == "grad":
            ax.plot(1e3 * t, i, "o", color=colors(bucket_of[i] % 10), markersize=4)
        elif kind == "launch":
            launched[i] = 1e3 * t
        elif kind == "done" and i in launched:
            ax.barh(-1.5 - i, 1e3 * t - launched[i], left=launched[i], height=0.8,
                    color=colors(i % 10))  # fmt: skip
    ax.axvline(1e3 * step["backward_returned"], color="black", linestyle="--", linewidth=1)
    rows = list(range(n)) + [-1.5 - b for b in range(len(step["buckets"]))]
    labels = names + [f"all-reduce b{b}" for b in range(len(step["buckets"]))]
    ax.set_yticks(rows, labels, fontsize=6)
    ax.set_title(title)
    return ax


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


# --- Chapter 3: DDP's statistics, fp16 overflow ---------------------------------------------


def ddp_statistics(widths: tuple[int, ...] = (1024,) * 9, steps: int = 12) -> dict[str, Any]:
    """DDP's own runtime statistics (``_get_ddp_logging_data()``) after ``steps`` steps of the
    timeline model: averages in milliseconds over the iterations DDP sampled."""
    ddp = DDP(make_mlp(widths))
    x = torch.randn(64, widths[0], generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(steps):
        ddp(x).pow(2).mean().backward()
        ddp.zero_grad()
    data = ddp._get_ddp_logging_data()  # type: ignore[no-untyped-call]
    keys = ("avg_backward_compute_time", "avg_backward_comm_time",
            "avg_backward_compute_comm_overlap_time")  # fmt: skip
    return {
        **{k: data[k] / 1e6 for k in keys},
        "sampled iteration": data["iteration"],
        "rebuilt_bucket_sizes": data["rebuilt_bucket_sizes"],
        "gradient_as_bucket_view": data["gradient_as_bucket_view"],
    }


def fp16_overflow(local: tuple[float, float] = (70000.0, 50000.0)) -> dict[str, str]:
    """A one-weight model whose local gradient is ``local[rank]`` (mean 60000, which float16
    can hold). Returns the averaged gradient without a hook, with PyTorch's
    ``fp16_compress_hook`` (cast, then divide), with MiniDDP's copy of it, and with a hook that
    divides first; and what registering ``bf16_compress_hook`` on gloo says."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def divide_then_cast(state, bucket):  # type: ignore[no-untyped-def]  # (see recording_hook)
        buf = bucket.buffer()
        half = (buf / dist.get_world_size()).to(torch.float16)
        work = dist.all_reduce(half, async_op=True)
        assert work is not None
        return work.get_future().then(lambda f: buf.copy_(f.value()[0]))

    hooks: dict[str, Any] = {
        "DDP, no hook (float32)": None,
        "DDP + default_hooks.fp16_compress_hook": default_hooks.fp16_compress_hook,
        "MiniDDP + fp16_compress_hook": "mini",
        "DDP + a hook that divides, then casts": divide_then_cast,
    }
    x = torch.tensor([[local[dist.get_rank()]]])
    out = {}
    for label, hook in hooks.items():
        lin = nn.Linear(1, 1, bias=False)
        if hook == "mini":
            model: nn.Module = MiniDDP(lin, comm_hook=fp16_compress_hook)
        else:
            model = DDP(lin)
            if hook is not None:
                model.register_comm_hook(None, hook)
        model(x).sum().backward()  # d(w * x)/dw = x
        assert lin.weight.grad is not None
        out[label] = f"{float(lin.weight.grad):g}"
    try:
        DDP(nn.Linear(1, 1)).register_comm_hook(None, default_hooks.bf16_compress_hook)
        out["bf16_compress_hook on gloo"] = "registered"
    except TypeError as exc:
        out["bf16_compress_hook on gloo"] = f"TypeError: {exc}"
    return out


def grad_scaler_with_fp16_hook(fp16_hook: bool, steps: int = 6) -> list[str]:
    """``torch.amp.GradScaler`` (initial scale 2**16) with DDP, with or without PyTorch's
    ``fp16_compress_hook``: per step, the scale after ``update()`` and whether the optimizer
    step was taken (a skipped step means the scaler found inf in the averaged gradients)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    lin = nn.Linear(8, 1)
    model = DDP(lin)
    if fp16_hook:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = 3 * torch.randn(16, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = []
    for _ in range(steps):
        scaler.scale(model(x).pow(2).mean()).backward()
        before = lin.weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        taken = not torch.equal(before, lin.weight)
        out.append(f"{'step' if taken else 'SKIP'} (scale {scaler.get_scale():g})")
        opt.zero_grad()
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
