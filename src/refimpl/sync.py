"""Chapter 4: barriers around rank-0 work (saving a checkpoint), and where they belong.

When only rank 0 saves, the other ranks run on into the next step and wait for rank 0 inside
the next collective, under the timeout chosen for training collectives. `barrier_safe` puts
that wait at a named place right after the save, with a timeout sized for saving, and can
name the rank that is late (``monitored=True``). `main_process_first` lets rank 0 create
something (a file, a cache, a checkpoint) before the other ranks go on, and turns a failure on
rank 0 into an error on every rank instead of a hang; its block must call no collective (a
DDP forward can be one).

The chapter's demos (the incident, its fixes, their timelines) are in `refimpl.demos.sync`.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MainProcessFailed", "barrier_safe", "main_process_first"]

_GROUPS: dict[tuple[int, float | None], Any] = {}


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _gloo_group(timeout_s: float | None) -> Any:
    """The group to wait in: WORLD when it is gloo with the default timeout, else a cached
    gloo group with ``timeout_s``. Every rank must ask for the same timeouts in the same
    order, since creating a group is itself collective."""
    if timeout_s is None and dist.get_backend() == "gloo":
        return None
    key = (id(dist.group.WORLD), timeout_s)
    if key not in _GROUPS:
        seconds = 1800.0 if timeout_s is None else timeout_s
        _GROUPS[key] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
    return _GROUPS[key]


def barrier_safe(*, timeout_s: float | None = None, monitored: bool = False) -> None:
    """Wait until every rank gets here; a no-op when not distributed (1 process, no group).

    ``timeout_s`` gives this wait its own limit (a CPU gloo group created once per value),
    so a save may take longer than the timeout you want on training collectives.
    ``monitored=True`` uses ``dist.monitored_barrier``: if a rank has not arrived after
    3/4 of the timeout, rank 0 raises naming every missing rank ("Ranks 1, 2 failed to
    pass monitoredBarrier"); the others wait the full timeout, so that report, which names
    the culprit, is the one the job dies with. All ranks must pass the same arguments. The
    first call with a new ``timeout_s`` creates that group, itself a wait for every rank:
    make it at start-up, so a rank late later is reported by the barrier, not by creation.

    Example::

        if dist.get_rank() == 0:
            atomic_save(model.state_dict(), "model.pt")
        barrier_safe(timeout_s=600)  # every rank, outside the `if`
    """
    if not _active():
        return
    if not monitored:
        dist.barrier(group=_gloo_group(timeout_s))
        return
    seconds = 1800.0 if timeout_s is None else timeout_s  # gloo's default, made explicit
    # Ranks other than 0 wait for rank 0's answer under the group's timeout; rank 0 must
    # give up first, or a bystander's "no answer from rank 0" would be the reported error.
    limit = datetime.timedelta(seconds=0.75 * seconds)
    dist.monitored_barrier(group=_gloo_group(seconds), timeout=limit, wait_all_ranks=True)


class MainProcessFailed(dist.DistError):
    """Raised on the other ranks when rank 0 failed inside `main_process_first`."""


@contextlib.contextmanager
def main_process_first(*, timeout_s: float | None = None) -> Iterator[bool]:
    """Run the block on rank 0 first, then on the other ranks; yields ``rank == 0``.

    The other ranks wait (up to ``timeout_s``, default: the group's) until rank 0 has left
    the block, so whatever rank 0 wrote there exists when they run it. If rank 0 raises,
    they raise `MainProcessFailed` at once instead of hanging until a timeout.

    The rule: the block holds rank-0-only work that calls no collective, and saving the
    checkpoint is such work (the other ranks wait at the entrance under ``timeout_s``, the
    save's budget, and learn at once if it fails); anything collective runs before the block
    on every rank. Rank 0 runs the block alone while every other rank waits at the entrance,
    so a collective there (``all_reduce``, ``barrier``, ``broadcast``,
    `refimpl.trainstate.capture_every_rank`) waits for ranks that cannot come: the job
    deadlocks until the group timeout, and the error then appears on an innocent rank. A
    forward through the DDP-wrapped model is such a collective: DDP's first forward after a
    training step broadcasts the module's buffers (BatchNorm statistics, a registered
    attention mask). So an evaluation (nanoGPT's ``estimate_loss``) runs before the block on
    every rank, or inside it on rank 0 through the bare model
    (`refimpl.state.unwrap_model`), which calls no collective.

    Example::

        with main_process_first() as is_main:
            if is_main:
                atomic_save(tokenizer_cache, "cache.pt")
            cache = safe_load("cache.pt")

        state = capture_every_rank(ddp, opt, step=step)      # collective: every rank, first
        with main_process_first(timeout_s=600) as is_main:   # the save's budget
            if is_main:
                losses = estimate_loss(unwrap_model(ddp))    # bare model: no collective
                save_checkpoint("ckpt", state, step)
    """
    if not _active():
        yield True
        return
    group = _gloo_group(timeout_s)
    status = torch.zeros(1, dtype=torch.int32)
    if dist.get_rank() != 0:
        dist.broadcast(status, src=0, group=group)
        if status.item() != 1:
            raise MainProcessFailed(
                f"rank {dist.get_rank()}: rank 0 failed inside main_process_first, so this "
                "rank stopped instead of waiting; rank 0's error is the cause"
            )
        yield False
        return
    try:
        yield True
    except BaseException:
        status.fill_(-1)
        with contextlib.suppress(Exception):
            dist.broadcast(status, src=0, group=group)
        raise
    status.fill_(1)
    dist.broadcast(status, src=0, group=group)
