"""Chapter 6: what a ``DataLoader`` holds besides the sampler, and how a resume treats it.

Three things live in the loader and its worker processes, not in the trainer's variables:

- **The position under prefetching.** `loader_stop_resume` stops and resumes one simulated
  rank's epoch under a ``DataLoader`` with worker processes, saving the position three ways
  (the trainer's batch count, the sampler's own count, torchdata's ``StatefulDataLoader``);
  `stateful_dataloader_resume` runs ``StatefulDataLoader`` across a world-size change.
- **The workers' random streams.** `worker_seeds` shows where each worker's seed comes from
  (``base_seed + worker_id``, ``base_seed`` drawn from the main process's torch RNG when the
  iterator is created); `augment_resume` stops and resumes an epoch whose samples carry
  random "augmentation" noise, drawn either from the worker's RNG or from a generator seeded
  by (seed, epoch, sample index) with `refimpl.data.sample_seed`.
- **A stream's position.** `stream_resume` does the same for an ``IterableDataset`` read by
  several workers, where the position is one count per worker plus which worker is next.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any, Literal, cast

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    get_worker_info,
)

from refimpl.data import ResumableSampler, sample_seed
from refimpl.demos.resume import Draws, count_lost_repeated


def _stateful_loader() -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader


def stateful_dataloader_resume(
    n: int, batch_size: int, old_ws: int, new_ws: int, step: int, num_workers: int = 0
) -> tuple[int, int]:
    """torchdata's StatefulDataLoader over a DistributedSampler on simulated ranks: save each
    rank's loader state after ``step`` batches at ``old_ws``, resume at ``new_ws`` (rank r
    loads old rank ``r % old_ws``'s state: there is no other to give it). Returns
    (lost, repeated); pick ``n`` divisible by both world sizes (no sampler padding)."""

    def loader(ws: int, r: int) -> Any:
        data: Any = range(n)
        s: DistributedSampler[int] = DistributedSampler(
            data, num_replicas=ws, rank=r, shuffle=True, seed=0
        )
        return _stateful_loader()(
            list(range(n)), batch_size=batch_size, sampler=s, num_workers=num_workers
        )

    draws: Draws = []
    states = []
    for r in range(old_ws):
        dl = loader(old_ws, r)
        it = iter(dl)
        for _ in range(step):
            draws += [(int(i), False) for i in next(it)]
        states.append(dl.state_dict())
        del it
    for r in range(new_ws):
        dl = loader(new_ws, r)
        dl.load_state_dict(states[r % old_ws])
        for batch in dl:
            draws += [(int(i), False) for i in batch]
    return count_lost_repeated(n, draws)


def loader_stop_resume(
    dataset: Dataset[Any],
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    stop_after: int,
    save: Literal["batches_done", "sampler_count", "stateful"] = "batches_done",
    num_workers: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """One simulated rank's epoch through a loader with worker processes, run three times:
    uninterrupted; stopped after ``stop_after`` consumed batches, saving the position; and
    resumed from it in a fresh loader and sampler. ``save`` picks what is saved: the trainer's
    count, ``sampler.state_dict(batches_done=stop_after)``; the sampler's own count of indices
    handed out, ``sampler.state_dict()`` (wrong under prefetching); or torchdata's
    ``StatefulDataLoader.state_dict()`` (the loader is then a ``StatefulDataLoader``, which
    stores the sampler's ``state_dict()`` as it was when each batch was sent to a worker).
    ``dataset`` yields 1-tuples of a number (a ``TensorDataset``). Returns the batches, as
    lists, of the uninterrupted run (``"full"``), the stopped one (``"first"``) and the
    resumed one (``"rest"``), the saved state (``"saved"``) and the sampler's own state at the
    save (``"sampler_ahead"``, where its iterator had got to)."""
    n = len(dataset)  # type: ignore[arg-type]

    def fresh() -> tuple[ResumableSampler, Any]:
        s = ResumableSampler(n, batch_size=batch_size, rank=rank, world_size=world_size, seed=seed)
        kind = _stateful_loader() if save == "stateful" else DataLoader
        return s, kind(dataset, batch_size=batch_size, sampler=s, num_workers=num_workers)

    def listed(batch: Any) -> list[int]:
        return [int(i) for i in batch[0]]

    full = [listed(b) for b in fresh()[1]]
    sampler, loader = fresh()
    it = iter(loader)
    first = [listed(next(it)) for _ in range(stop_after)]
    ahead = sampler.state_dict()
    saved: dict[str, Any] = ahead
    if save == "batches_done":
        saved = sampler.state_dict(batches_done=stop_after)
    elif save == "stateful":
        saved = loader.state_dict()
    del it  # the "crash": workers and prefetched batches are gone
    sampler, loader = fresh()
    (loader if save == "stateful" else sampler).load_state_dict(saved)
    rest = [listed(b) for b in loader]
    return {"full": full, "first": first, "rest": rest, "saved": saved, "sampler_ahead": ahead}


class _WorkerProbe(Dataset[tuple[int, int, int]]):
    """Sample i -> (worker id, ``get_worker_info().seed``, ``torch.initial_seed()``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        info = get_worker_info()
        assert info is not None, "the probe runs in worker processes"
        return info.id, info.seed, torch.initial_seed()


def _as_list(batch: list[Any]) -> list[Any]:
    return batch  # no collation: seeds are uint64 and would overflow an int64 tensor


def worker_seeds(num_workers: int = 2, seed: int = 0) -> dict[str, Any]:
    """Where each ``DataLoader`` worker's seed comes from, measured.

    Seeds the main process with ``torch.manual_seed(seed)``, notes the first 64-bit number its
    RNG would draw (``expected_base_seed``), then iterates a loader whose samples report,
    from inside each worker, ``get_worker_info().seed`` and ``torch.initial_seed()``.
    Also checks that creating a loader's iterator advances the main process's torch RNG, with
    and without workers. Returns ``expected_base_seed``, ``workers`` ({id: (info seed,
    torch.initial_seed())}) and ``advances`` ({num_workers: bool})."""
    torch.manual_seed(seed)
    expected = int(torch.empty((), dtype=torch.int64).random_().item())
    torch.manual_seed(seed)
    loader = DataLoader(
        _WorkerProbe(2 * num_workers), batch_size=1, num_workers=num_workers, collate_fn=_as_list
    )
    workers = {wid: (s, t) for batch in loader for wid, s, t in batch}
    advances, four = {}, cast(Any, list(range(4)))
    for w in (0, num_workers):
        before = torch.get_rng_state()
        iter(DataLoader(four, num_workers=w))  # created, never iterated
        advances[w] = not torch.equal(before, torch.get_rng_state())
    return {"expected_base_seed": expected, "workers": workers, "advances": advances}


class NoisySamples(Dataset[tuple[int, int, int]]):
    """Sample i -> (i, an "augmentation" draw in [0, 10**6), the worker id or -1).

    With ``seed=None`` the draw comes from the worker process's torch RNG, as
    ``torch.rand`` in a transform does; otherwise from a generator seeded with
    `refimpl.data.sample_seed` ``(seed, epoch, i)``."""

    def __init__(self, n: int, seed: int | None = None, epoch: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, epoch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        info = get_worker_info()
        g = None
        if self.seed is not None:
            g = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, i))
        noise = int(torch.randint(0, 10**6, (), generator=g))
        return i, noise, info.id if info is not None else -1


def augment_resume(
    draw_from: Literal["worker_rng", "sample_seed"],
    loader: Literal["plain", "stateful"] = "plain",
    *,
    n: int = 24,
    batch_size: int = 2,
    stop_after: int = 3,
    num_workers: int = 2,
) -> dict[str, Any]:
    """An epoch of `NoisySamples` through a loader with workers: uninterrupted, then stopped
    after ``stop_after`` batches and resumed (the sampler state saved with the trainer's
    count, or the ``StatefulDataLoader``'s state). The main process is seeded alike before
    each run, so both runs' workers get the same seeds. Returns the batches of both runs,
    each a list of (index, noise, worker id)."""
    kind = _stateful_loader() if loader == "stateful" else DataLoader
    seed = 7 if draw_from == "sample_seed" else None

    def fresh() -> tuple[ResumableSampler, Any]:
        torch.manual_seed(0)  # the same base_seed for every loader's workers
        s = ResumableSampler(n, batch_size=batch_size, rank=0, world_size=1, seed=0)
        dl = kind(
            NoisySamples(n, seed),
            batch_size=batch_size,
            sampler=s,
            num_workers=num_workers,
            collate_fn=_as_list,
        )
        return s, dl

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11, torch 2.13
        full = list(fresh()[1])
        sampler, dl = fresh()
        it = iter(dl)
        first = [next(it) for _ in range(stop_after)]
        saved = dl.state_dict() if loader == "stateful" else sampler.state_dict(stop_after)
        del it
        sampler, dl = fresh()
        (dl if loader == "stateful" else sampler).load_state_dict(saved)
        resumed = first + list(dl)
    return {"full": full, "resumed": resumed}


class ShardedStream(IterableDataset[int]):
    """Records ``0..n-1`` read by workers: worker w of W reads records w, w + W, w + 2W, ...

    Its position is one number per worker, records done (`state_dict` inside a worker, which
    is what ``StatefulDataLoader`` saves per worker); ``skip`` ({worker id: records}) starts
    each worker further on, as a hand-written resume would."""

    def __init__(self, n: int, skip: dict[int, int] | None = None) -> None:
        self.n, self.skip, self.done = n, dict(skip or {}), 0
        self._loaded: int | None = None  # this worker's records done, from load_state_dict

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        w, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = range(w, self.n, workers)
        self.done = self.skip.get(w, 0) if self._loaded is None else self._loaded
        for record in mine[self.done :]:
            self.done += 1
            yield record

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._loaded = int(state["done"])


def stream_resume(
    loader: Literal["plain", "stateful"],
    *,
    n: int = 24,
    batch_size: int = 2,
    stop_after: int = 3,
    num_workers: int = 2,
) -> dict[str, Any]:
    """A `ShardedStream` epoch, uninterrupted, then stopped after ``stop_after`` batches and
    resumed. ``"plain"``: a ``DataLoader`` and a hand-written resume that skips, in each
    worker, the records of the batches that worker delivered (the loader takes batches from
    its workers in turn, so worker w delivered batches w, w + W, ... of those consumed).
    ``"stateful"``: a ``StatefulDataLoader``, which saves each worker's `state_dict` and
    which worker is next. Returns both runs' batches."""
    kind = _stateful_loader() if loader == "stateful" else DataLoader

    def batches(dl: Any) -> list[list[int]]:
        return [b.tolist() for b in dl]

    def make(ds: ShardedStream) -> Any:
        return kind(ds, batch_size=batch_size, num_workers=num_workers)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        full = batches(make(ShardedStream(n)))
        dl = make(ShardedStream(n))
        it = iter(dl)
        first = [next(it).tolist() for _ in range(stop_after)]
        saved = dl.state_dict() if loader == "stateful" else None
        del it
        if loader == "stateful":
            dl = make(ShardedStream(n))
            dl.load_state_dict(saved)
        else:
            delivered = {w: len(range(w, stop_after, num_workers)) for w in range(num_workers)}
            dl = make(ShardedStream(n, {w: k * batch_size for w, k in delivered.items()}))
        resumed = first + batches(dl)
    return {"full": full, "resumed": resumed}
