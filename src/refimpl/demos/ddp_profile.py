"""Chapter 3's profile of one training step: where `MiniDDP`'s time went, next to DDP's.

A first `MiniDDP` was slower per step than ``DistributedDataParallel`` (chapter 3 shows by how
much) with the same buckets and the same gradient storage (``gradient_as_bucket_view=True``).
The obvious suspect was Python: one hook call per parameter where DDP's Reducer runs C++.
`profile_step` measures a step of each version side by side: wall time, CPU time of the
training thread, the process's minor page faults, the tail after the last gradient, and the CPU
time of MiniDDP's hooks with and without the copies into the buckets. It found the allocator,
not Python: the first version kept every fresh gradient alive until the end of backward
(`LateViewMiniDDP`, kept here to measure it), and the memory came back from the OS on every
step.
`grad_during_backward` shows the fix: each hook now points ``.grad`` at the bucket at once.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from refimpl.ddp import MiniDDP
from refimpl.demos.ddp import make_mlp

__all__ = ["PROFILED", "LateViewMiniDDP", "grad_during_backward", "profile_step"]


class LateViewMiniDDP(MiniDDP):
    """`MiniDDP` as chapter 3 first measured it: each hook copies its gradient into the bucket
    but leaves ``param.grad`` on the tensor autograd allocated, and only the end of backward
    points ``.grad`` at the bucket. Every fresh gradient (the whole model's worth) stays alive
    until then. Kept so that `profile_step` and ``python -m refimpl.bench ddp`` can measure
    what that cost, side by side with the fixed `MiniDDP`."""

    def _on_grad(self, i: int) -> None:
        fresh = self.params[i].grad
        super()._on_grad(i)
        if self.require_sync:
            self.params[i].grad = fresh  # undo the early switch; _finish makes it the view


PROFILED: dict[str, Callable[[nn.Module, float], nn.Module]] = {
    "MiniDDP before": lambda m, cap: LateViewMiniDDP(m, bucket_cap_mb=cap),
    "MiniDDP": lambda m, cap: MiniDDP(m, bucket_cap_mb=cap),
    "DDP(view)": lambda m, cap: DDP(m, bucket_cap_mb=cap, gradient_as_bucket_view=True),
    "DDP()": lambda m, cap: DDP(m),
}
"""The versions `profile_step` compares: like for like, ``DDP(view)`` has the same buckets
and the same gradient storage as `MiniDDP`; ``DDP()`` is PyTorch's default."""


class _Clock:
    """Per-step accumulators filled while a step runs (all times in seconds)."""

    def __init__(self) -> None:
        self.hooks_cpu = 0.0  # training-thread CPU inside MiniDDP's hooks and end callback
        self.last_grad = 0.0  # perf_counter of the last gradient of the current backward


def _instrument(model: nn.Module, clock: _Clock) -> None:
    """Record when each gradient is ready (a hook after the wrapper's own), and, for a
    MiniDDP, the CPU time of its hooks and end-of-backward callback."""
    wrapped = model.module if isinstance(model, MiniDDP | DDP) else model
    for p in wrapped.parameters():
        p.register_post_accumulate_grad_hook(
            lambda _: setattr(clock, "last_grad", time.perf_counter())
        )
    if isinstance(model, MiniDDP):
        for name in ("_on_grad", "_finish"):
            method = getattr(model, name)

            def timed(*args: Any, method: Callable[..., None] = method) -> None:
                start = time.thread_time()
                method(*args)
                clock.hooks_cpu += time.thread_time() - start

            setattr(model, name, timed)  # the hooks look the method up on the instance


def _copy_cpu(model: MiniDDP, steps: int = 5) -> float:
    """CPU seconds of copying every gradient into its bucket slice, divided by the world
    size (what each MiniDDP hook does), on its own: the part of the hooks DDP does too."""
    grads = [torch.randn_like(p) for p in model.params]
    start = time.thread_time()
    for _ in range(steps):
        for g, view in zip(grads, model.grad_views, strict=True):
            torch.mul(g, 1.0 / model.world_size, out=view)
    return (time.thread_time() - start) / steps


def profile_step(
    widths: tuple[int, ...] = (768,) * 21,
    batch: int = 16,
    bucket_cap_mb: float = 25.0,
    repeats: int = 5,
    steps: int = 2,
) -> dict[str, dict[str, float]]:
    """Where one training step (forward, backward, SGD step) goes, for each of `PROFILED`.

    Interleaved repeats (the order rotates) of ``steps`` steps each, per step: wall time and
    ``x DDP(view)`` (the paired ratio), CPU time of the training thread (which runs forward,
    backward and the hooks; CPU time, unlike the wall clock, barely moves when other jobs
    share the cores), the process's minor page faults (memory the OS had to map in, 4 KiB
    each), and the tail: wall time from the last gradient to the end of ``backward()``, the
    wait for the last bucket. For the MiniDDP versions also the CPU time of the hooks and
    the end-of-backward callback, and of the copies into the buckets alone; their
    difference is the Python bookkeeping. Slowest rank's value (page faults: the largest),
    median over repeats; times in ms. Returns ``{version: {measure: value}}``."""
    models = {k: wrap(make_mlp(widths), bucket_cap_mb) for k, wrap in PROFILED.items()}
    clocks = {k: _Clock() for k in models}
    for k, model in models.items():
        _instrument(model, clocks[k])
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}
    x = torch.randn(batch, widths[0], generator=torch.Generator().manual_seed(dist.get_rank()))

    def run(k: str) -> float:
        """``steps`` steps of version k; returns the summed tails (seconds)."""
        tails = 0.0
        for _ in range(steps):
            loss = models[k](x).pow(2).mean()
            loss.backward()
            tails += time.perf_counter() - clocks[k].last_grad
            opts[k].step()
            opts[k].zero_grad()
        return tails

    for k in models:  # warm-up, and DDP's bucket rebuild after its first step
        run(k)
    names = list(models)
    samples: dict[str, list[list[float]]] = {k: [] for k in names}
    for r in range(repeats):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            clocks[k].hooks_cpu = 0.0
            wall, cpu = time.perf_counter(), time.thread_time()
            tails = run(k)
            sample = (
                torch.tensor(
                    [
                        time.perf_counter() - wall,
                        time.thread_time() - cpu,
                        resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                        tails,
                        clocks[k].hooks_cpu,
                    ],
                    dtype=torch.float64,
                )
                / steps
            )
            dist.all_reduce(sample, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            samples[k].append(sample.tolist())
    out: dict[str, dict[str, float]] = {}
    for k in names:
        wall, cpu, faults, tail, hooks = (
            statistics.median(col) for col in zip(*samples[k], strict=True)
        )
        per_repeat = [a[0] / b[0] for a, b in zip(samples[k], samples["DDP(view)"], strict=True)]
        out[k] = {
            "step": 1e3 * wall,
            "x DDP(view)": statistics.median(per_repeat),
            "training thread CPU": 1e3 * cpu,
            "page faults": faults,
            "tail": 1e3 * tail,
        }
        model = models[k]
        if isinstance(model, MiniDDP):
            copies = _copy_cpu(model)
            out[k] |= {
                "hooks CPU": 1e3 * hooks,
                "copies CPU": 1e3 * copies,
                "Python per parameter (us)": 1e6 * (hooks - copies) / len(model.params),
            }
    return out


def grad_during_backward(bucket_cap_mb: float = 0.01) -> dict[str, str]:
    """For `MiniDDP` and `LateViewMiniDDP`: right after the wrapper's hook of each parameter
    (seen from a hook registered after it), is ``param.grad`` already its bucket slice, or
    still the tensor autograd allocated (alive until the end of backward)?"""
    out = {}
    for wrap in (MiniDDP, LateViewMiniDDP):
        ddp = wrap(make_mlp(), bucket_cap_mb=bucket_cap_mb)
        seen: list[bool] = []
        for i, p in enumerate(ddp.params):
            p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                lambda q, v=ddp.grad_views[i], seen=seen: seen.append(q.grad is v)
            )
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
        ddp(x).pow(2).sum().backward()
        after = sum(p.grad is v for p, v in zip(ddp.params, ddp.grad_views, strict=True))
        out[wrap.__name__] = (
            f"{sum(seen)} of {len(seen)} .grad were the bucket during backward, {after} after"
        )
    return out
