"""Chapters 2–3: data parallelism built by hand, a naive version and DDP's bucketed one.

`NaiveDDP` waits for backward to finish and then all-reduces every gradient, one call per
parameter: correct, simple, and slow, because the network sits idle during backward and pays
one call's latency per tensor. `MiniDDP` does what ``DistributedDataParallel``'s Reducer does:

1. at construction, rank 0's parameters and buffers are broadcast, so every replica starts
   equal whatever each rank's seed was;
2. parameters are grouped into buckets in reverse order (`refimpl.buckets.assign_buckets`);
3. a post-accumulate-grad hook per parameter copies its gradient into its bucket's flat buffer
   and marks it ready; a full bucket's all-reduce is launched asynchronously at once, while
   backward keeps computing earlier layers (buckets start strictly in index order, so every
   rank issues the same collectives in the same order);
4. right after the copy, the hook points ``param.grad`` at its slice of the bucket, so the
   gradient tensor autograd just allocated is freed at once (see `MiniDDP`: on this CPU,
   keeping all of them alive until the end of backward cost 45 MB of fresh page faults per
   step); a callback queued on the autograd engine waits for every all-reduce at the end of
   backward, and then each ``param.grad`` already holds its average (no copy back). That is
   DDP with ``gradient_as_bucket_view=True``; DDP's default (``False``) copies the averaged
   bucket back into a separate ``.grad`` tensor.

``no_sync()`` skips step 3 for gradient-accumulation micro-steps, and
``find_unused_parameters=True`` marks parameters that the forward pass did not reach as ready
(with a zero gradient) so their bucket is still reduced on every rank.
``tests/test_ddp.py`` proves gradients and parameters equal ``DistributedDataParallel``'s.

Where MiniDDP differs from DDP on purpose (each difference is shown in chapter 2):
buffers are broadcast only at construction unless ``forward_sync_buffers=True`` (DDP's default
re-broadcasts rank 0's buffers before every forward); ``no_sync()`` is read when the gradient
hooks fire, during backward (DDP reads it during forward); buckets are fixed at construction
in reverse parameter order (DDP rebuilds them once from rank 0's observed gradient order).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from refimpl.buckets import assign_buckets

__all__ = ["CommHook", "MiniDDP", "NaiveDDP", "broadcast_state", "fp16_compress_hook"]

CommHook = Callable[[torch.Tensor], "torch.futures.Future[torch.Tensor]"]
"""A communication hook: takes a bucket's flat gradient (already summed over micro-steps, not
averaged) and returns a future whose value is the averaged bucket."""


def broadcast_state(module: nn.Module) -> None:
    """Overwrite every rank's parameters and buffers with rank 0's (DDP's construction step)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)


def fp16_compress_hook(bucket: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Communication hook that all-reduces the bucket in float16: half the bytes on the wire.

    Same arithmetic as PyTorch's ``default_hooks.fp16_compress_hook``: cast, *then* divide by
    the world size, all-reduce, cast back. The price is fp16 rounding (about 3 decimal digits)
    and overflow: because the cast comes first, any rank's *local* gradient above 65504 becomes
    ``inf`` before it is averaged (local 70000 and 50000 give ``inf``, not 60000), and the
    ``inf`` reaches every rank.
    """
    compressed = bucket.to(torch.float16).div_(dist.get_world_size())
    work = dist.all_reduce(compressed, async_op=True)
    assert work is not None  # async_op=True always returns a Work
    fut = work.get_future().then(lambda f: f.value()[0].to(bucket.dtype))
    return cast("torch.futures.Future[torch.Tensor]", fut)


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside a (nested) forward output."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors_in(v)]
    return []


def _reachable_params(output: Any) -> set[int]:
    """ids of the parameters the autograd graph of ``output`` leads to (DDP's graph walk)."""
    seen: set[Any] = set()
    stack = [t.grad_fn for t in _tensors_in(output) if t.grad_fn is not None]
    found: set[int] = set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):  # an AccumulateGrad node: a leaf, i.e. a parameter
            found.add(id(fn.variable))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return found


class _DDPBase(nn.Module):
    """What both versions share: broadcast at construction, forward, ``no_sync``."""

    def __init__(self, module: nn.Module, trace: bool = False) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "MiniDDP/NaiveDDP need an initialised process group: call "
                "dist.init_process_group first, or run under refimpl.launch.spawn / torchrun."
            )
        self.module = module
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.require_sync = True  # False inside no_sync(); read by the hooks during backward
        self.trace = trace
        self.events: list[tuple[float, str, int]] = []  # (perf_counter, kind, index)
        broadcast_state(module)

    def _log(self, kind: str, index: int) -> None:
        if self.trace:
            self.events.append((time.perf_counter(), kind, index))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this block backward only accumulates local gradients; the next backward
        outside it all-reduces the accumulated sum (one all-reduce per optimizer step).

        The flag is read when the gradient hooks fire, i.e. during *backward*. PyTorch's DDP
        reads it during *forward* (``require_backward_grad_sync`` in ``_post_forward``), so a
        forward outside the block with the backward inside still synchronises there. Put both
        the forward and the backward inside the block: then the two agree."""
        before, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = before


class NaiveDDP(_DDPBase):
    """Data parallelism without buckets or overlap: after backward, one blocking all-reduce
    per parameter. Same interface as `MiniDDP`; the baseline it is measured against."""

    def __init__(self, module: nn.Module, trace: bool = False) -> None:
        super().__init__(module, trace)
        self._queued = False
        self._index = {id(p): i for i, p in enumerate(self.params)}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]

    def _on_grad(self, param: torch.Tensor) -> None:
        self._log("grad", self._index[id(param)])
        # The only job of the hook is to run `_sync` once, after the whole backward.
        if self.require_sync and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._sync)

    def _sync(self) -> None:
        self._queued = False
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self._log("launch", i)
                dist.all_reduce(p.grad)
                self._log("done", i)
                p.grad.div_(self.world_size)


class MiniDDP(_DDPBase):
    """``DistributedDataParallel`` in miniature: buckets, per-parameter hooks, overlap.

    ``bucket_cap_mb`` and ``first_bucket_mb`` (``None``: same as the cap, which is what
    PyTorch does when you pass ``bucket_cap_mb`` explicitly) set the partition
    (`refimpl.buckets.assign_buckets`). ``find_unused_parameters`` walks the autograd graph
    after each forward and reduces a zero gradient for parameters it did not reach; without
    it such a parameter's bucket never starts, and this rank raises at the end of backward
    while the others wait for it. ``comm_hook`` replaces the all-reduce of a bucket (see
    `fp16_compress_hook`). After backward each ``param.grad`` is a view into its bucket, as
    with DDP's ``gradient_as_bucket_view=True`` (DDP's default, ``False``, copies back instead).
    The hook makes ``.grad`` that view as soon as it has copied the gradient in, as DDP's
    Reducer does, so each fresh gradient tensor is freed while backward still runs and the
    allocator hands the same memory to the next one. (Pointing ``.grad`` at the bucket only at
    the end of backward keeps every fresh gradient alive until then; freed together, glibc
    returns them to the OS and the next step faults them in again, page by page: chapter 3
    measures what that costs.)
    With ``trace=True`` every hook, launch and completion is timestamped into ``self.events``
    (``(perf_counter, kind, index)``).

    Buffers (BatchNorm running statistics) are broadcast from rank 0 once, at construction.
    After that each rank updates its own copy from its own batches, so the copies drift apart
    unless ``forward_sync_buffers=True``, which re-broadcasts rank 0's buffers before a forward
    with DDP's rule (only when the previous forward was a synchronising training forward).
    DDP's default is to re-broadcast; ``torch.nn.SyncBatchNorm`` instead computes the
    statistics over the global batch (GPU only). ``no_sync()`` is decided at backward time
    here, at forward time in DDP (see `no_sync`).
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float | None = None,
        find_unused_parameters: bool = False,
        comm_hook: CommHook | None = None,
        trace: bool = False,
        forward_sync_buffers: bool = False,
    ) -> None:
        super().__init__(module, trace)
        self.find_unused_parameters = find_unused_parameters
        self.forward_sync_buffers = forward_sync_buffers
        self._sync_buffers_next = True  # DDP's require_forward_param_sync
        self.comm_hook = comm_hook
        self.buckets = assign_buckets(self.params, bucket_cap_mb, first_bucket_mb)
        self.where: dict[int, tuple[int, int]] = {}  # param index -> (bucket, offset)
        self.buffers_: list[torch.Tensor] = []
        for b, bucket in enumerate(self.buckets):
            offset = 0
            for i in bucket:
                self.where[i] = (b, offset)
                offset += self.params[i].numel()
            p0 = self.params[bucket[0]]
            self.buffers_.append(torch.zeros(offset, dtype=p0.dtype, device=p0.device))
        # What each param.grad becomes: its slice of the bucket, shaped like the parameter.
        self.grad_views: list[torch.Tensor] = []
        for i, p in enumerate(self.params):
            b, offset = self.where[i]
            self.grad_views.append(self.buffers_[b][offset : offset + p.numel()].view_as(p))
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                lambda _, i=i: self._on_grad(i)
            )
        self._reset()

    def _reset(self) -> None:
        self.pending = [len(b) for b in self.buckets]  # gradients each bucket still waits for
        self.ready = [False] * len(self.params)
        # In-flight all-reduces, one per launched bucket (a Work, or a hook's Future).
        self.futures: list[dist.Work | torch.futures.Future[torch.Tensor]] = []
        self.next_bucket = 0
        self.backward_started = False
        self.unused: list[int] = []

    def _log_done(self, b: int, fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        self._log("done", b)  # runs on gloo's thread, the moment the all-reduce completes
        return fut.value()[0]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._reset()  # a backward that raised must not leak its half-filled buckets
        if self.forward_sync_buffers and self._sync_buffers_next:
            with torch.no_grad():
                for buf in self.module.buffers():
                    dist.broadcast(buf, src=0)  # rank 0's running statistics win
        # DDP's rule: the *next* forward syncs buffers only if this one is a synchronising
        # training forward (grad enabled, outside no_sync).
        self._sync_buffers_next = torch.is_grad_enabled() and self.require_sync
        out = self.module(*args, **kwargs)
        if self.find_unused_parameters and self.require_sync and torch.is_grad_enabled():
            reached = _reachable_params(out)
            self.unused = [i for i, p in enumerate(self.params) if id(p) not in reached]
        return out

    def _on_grad(self, i: int) -> None:
        if not self.require_sync:
            return  # no_sync(): the gradient just accumulates in p.grad
        if not self.backward_started:
            self.backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            for j in self.unused:  # reduce zeros for what the forward never touched
                self._mark_ready(j, self.params[j].grad)
        self._log("grad", i)
        self._mark_ready(i, self.params[i].grad)
        # The gradient is in the bucket now: make .grad the bucket's slice (DDP's
        # gradient_as_bucket_view), which frees the tensor autograd just allocated, so the
        # allocator reuses its memory for the next gradient instead of asking the OS again.
        self.params[i].grad = self.grad_views[i]

    def _mark_ready(self, i: int, grad: torch.Tensor | None) -> None:
        b, offset = self.where[i]
        view = self.buffers_[b][offset : offset + self.params[i].numel()]
        if grad is None:
            view.zero_()
        elif self.comm_hook is None:
            # Divide while copying (as the Reducer does): the all-reduce then sums averages.
            torch.mul(grad.reshape(-1), 1.0 / self.world_size, out=view)
        else:
            view.copy_(grad.reshape(-1))
        self.ready[i] = True
        self.pending[b] -= 1
        # Launch full buckets strictly in order: every rank must issue the same sequence
        # of collectives, whatever order its hooks happen to fire in.
        while self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] == 0:
            self._launch(self.next_bucket)
            self.next_bucket += 1

    def _launch(self, b: int) -> None:
        self._log("launch", b)
        pending: dist.Work | torch.futures.Future[torch.Tensor]
        if self.comm_hook is not None:
            pending = self.comm_hook(self.buffers_[b])
        elif self.trace:  # a completion callback costs a GIL hand-off: only when tracing
            work = dist.all_reduce(self.buffers_[b], async_op=True)
            assert work is not None
            pending = work.get_future().then(functools.partial(self._log_done, b))
        else:
            pending = cast(dist.Work, dist.all_reduce(self.buffers_[b], async_op=True))
        self.futures.append(pending)

    def _finish(self) -> None:
        """End of backward: wait for every bucket, then write averages into ``param.grad``."""
        for b, pending in enumerate(self.futures):
            try:
                result = pending.wait()
                if (
                    isinstance(result, torch.Tensor)
                    and result.data_ptr() != self.buffers_[b].data_ptr()
                ):
                    self.buffers_[b].copy_(result)  # a comm hook returned a new tensor
            except Exception as exc:  # gloo's timeout, or a peer that went away
                names = [self.names[i] for i in self.buckets[b]]
                raise RuntimeError(
                    f"rank {self.rank}: the all-reduce of bucket {b} (parameters {names}) did "
                    "not complete. Another rank never started it, usually because one of "
                    "these parameters got no gradient there. Pass find_unused_parameters=True "
                    "to MiniDDP, or make every parameter take part in the loss on every rank. "
                    f"The backend said: {str(exc).splitlines()[0] if str(exc) else exc!r}"
                ) from exc
        if self.next_bucket < len(self.buckets):
            b = self.next_bucket
            missing = [self.names[i] for i in self.buckets[b] if not self.ready[i]]
            raise RuntimeError(
                f"rank {self.rank}: backward finished but bucket {b} never filled: {missing} "
                f"got no gradient, so the all-reduces of buckets {b}..{len(self.buckets) - 1} "
                "never started and every other rank is waiting for them. Pass "
                "find_unused_parameters=True to MiniDDP, or use every parameter in the loss."
            )
        self._log("finish", -1)
        used = self._globally_used()
        for i, p in enumerate(self.params):
            # Each hook already pointed its .grad at the bucket; what is left are parameters
            # this rank did not use: they get the averaged slice too if they had a gradient
            # or another rank used them (no copy back either way).
            if p.grad is not self.grad_views[i] and (p.grad is not None or used[i]):
                p.grad = self.grad_views[i]
        self.backward_started = False

    def _globally_used(self) -> list[bool]:
        """Which parameters some rank used (one tiny extra all-reduce, as DDP does), so a
        parameter nobody used keeps ``grad=None`` instead of a zero gradient."""
        if not self.find_unused_parameters:
            return [True] * len(self.params)
        flags = torch.tensor(  # on the parameters' device: NCCL reduces only GPU tensors
            [0 if i in self.unused else 1 for i in range(len(self.params))],
            device=self.params[0].device,
        )
        dist.all_reduce(flags)
        return [bool(f) for f in flags.tolist()]
