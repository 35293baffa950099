"""Chapter 3's workers: overlap timelines, compression hooks and what they cost.

`timeline` records when each gradient is ready and each bucket's all-reduce runs, and
`ddp_hook_trace` does the same inside torch's DDP (the figure of chapter 2);
`ddp_statistics` reads DDP's own overlap counters; `ddp_small_bucket` shows which end of
the model DDP's 1 MB first bucket lands on; the fp16 workers show the error and the overflow
of compressing gradients, with and without GradScaler, and `undivided_hook` a hook that
forgets to average. The models come from `refimpl.demos.ddp`; the profile of a step is in
`refimpl.demos.ddp_profile`.
"""

from __future__ import annotations

import time
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from refimpl.buckets import MB
from refimpl.ddp import MiniDDP, NaiveDDP, fp16_compress_hook
from refimpl.demos.ddp import make_mlp
from refimpl.demos.ddp_details import _ddp_buckets

__all__ = [
    "ddp_hook_trace",
    "ddp_small_bucket",
    "ddp_statistics",
    "fp16_hook_error",
    "fp16_overflow",
    "grad_scaler_with_fp16_hook",
    "timeline",
    "undivided_hook",
]


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
        trace.append(
            {
                "events": [(t - t0, kind, i) for t, kind, i in sorted(events)],
                "buckets": buckets,
                "backward_returned": returned,
            }
        )
    return {"steps": trace, "names": [n for n, _ in model.named_parameters()]}


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


def ddp_statistics(widths: tuple[int, ...] = (1024,) * 9, steps: int = 12) -> dict[str, Any]:
    """DDP's own runtime statistics (``_get_ddp_logging_data()``) after ``steps`` steps of the
    timeline model: averages in milliseconds over the iterations DDP sampled."""
    ddp = DDP(make_mlp(widths))
    x = torch.randn(64, widths[0], generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(steps):
        ddp(x).pow(2).mean().backward()
        ddp.zero_grad()
    data = ddp._get_ddp_logging_data()  # type: ignore[no-untyped-call]
    keys = (
        "avg_backward_compute_time",
        "avg_backward_comm_time",
        "avg_backward_compute_comm_overlap_time",
    )
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


def grad_scaler_with_fp16_hook(
    fp16_hook: bool, steps: int = 6, init_scale: float = 2.0**16
) -> list[str]:
    """``torch.amp.GradScaler`` (initial scale ``init_scale``, PyTorch's default 2**16) with
    DDP, with or without PyTorch's ``fp16_compress_hook``: per step, the scale after
    ``update()`` and whether the optimizer step was taken (a skipped step means the scaler
    found inf in the averaged gradients)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    lin = nn.Linear(8, 1)
    model = DDP(lin)
    if fp16_hook:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
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


def ddp_small_bucket(widths: tuple[int, ...] = (768,) * 21, steps: int = 2) -> dict[str, str]:
    """DDP with its default buckets (25 MB, 1 MB first) after ``steps`` steps, with and
    without ``find_unused_parameters``: each bucket in the order it is all-reduced, as its
    first and last parameter and its size in MB."""
    out = {}
    for find_unused in (False, True):
        model = make_mlp(widths)
        ddp = DDP(model, find_unused_parameters=find_unused)
        names = [n for n, _ in model.named_parameters()]
        params = list(model.parameters())
        x = torch.randn(4, widths[0])
        for _ in range(steps):
            ddp(x).sum().backward()
        buckets = _ddp_buckets(ddp, {id(p): i for i, p in enumerate(params)})
        out[f"find_unused_parameters={find_unused}"] = ", ".join(
            f"[{names[b[0]]}..{names[b[-1]]}: {sum(params[i].numel() for i in b) * 4 / MB:.1f}]"
            for b in buckets
        )
    return out


def _sum_only(bucket: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A comm hook that all-reduces (sums) the bucket and forgets to divide."""
    work = dist.all_reduce(bucket, async_op=True)
    assert work is not None
    fut = work.get_future().then(lambda f: f.value()[0])
    return cast("torch.futures.Future[torch.Tensor]", fut)


def undivided_hook(seed: int = 0) -> dict[str, Any]:
    """The same model and batch through `MiniDDP` without a hook and with `_sum_only`, a hook
    that sums and does not divide by the world size: the largest gradient of each, and
    whether every hooked gradient is exactly ``world_size`` times the plain one."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    grads = []
    for hook in (None, _sum_only):
        model = MiniDDP(make_mlp(seed=seed), comm_hook=hook)
        model(x).pow(2).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))  # type: ignore[union-attr]
    plain, hooked = grads
    return {
        "max |grad|, no hook": f"{float(plain.abs().max()):.4f}",
        "max |grad|, sum-only hook": f"{float(hooked.abs().max()):.4f}",
        "sum-only == world_size * no hook": torch.equal(hooked, dist.get_world_size() * plain),
    }
