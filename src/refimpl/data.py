"""A sampler whose position survives a restart on a different number of ranks.

`ResumableSampler` draws one deterministic permutation of the dataset per epoch (from
``seed + epoch``) and cuts it into *global* batches of ``batch_size * world_size`` stream
positions; rank ``r`` takes the ``r``-th contiguous slice of ``batch_size`` of each global
batch. Its state is the number of stream positions all ranks have drawn so far, a number that
is the same on every rank and means the same thing at any world size. A sampler built for
another world size that loads it continues the same permutation from the same place, so every
sample of the epoch is drawn exactly once. (Converting a *per-rank step count* instead, as
``step * old_ws // new_ws``, loses or repeats samples; chapter 6 counts them.)

The tail: when fewer than one global batch of the epoch is left, ``tail="pad"`` (default)
fills the last global batch with samples from the start of the permutation (stream positions
``>= dataset_len``, reported by `is_padding`), so every sample is drawn and every rank gets a
full batch; ``tail="drop"`` ends the epoch instead, and those last samples are not drawn in
this epoch (`dropped_tail` says how many).

`ResumableBatches` is the loop around the sampler that a trainer needs: this rank's batches
epoch after epoch, each handed out with the sampler state to save in a checkpoint taken before
that batch is trained, so a script that fetches its next batch ahead (prefetching) still
saves the right position.

`RandomOffsets` is the other way to draw: nanoGPT's ``torch.randint(len(data) - block_size,
(batch_size,))``, offsets drawn *with* replacement, made resumable without a permutation. Each
batch is a pure function of the seed and its index, so its state is one counter and its memory
one batch, however long the data.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch.utils.data import Sampler

__all__ = ["RandomOffsets", "ResumableBatches", "ResumableSampler", "sample_seed"]


class ResumableSampler(Sampler[int]):
    """This rank's sample indices, resumable at any world size.

    ``state_dict()`` is ``{"seed", "epoch", "position"}``, with ``position`` the global
    stream positions drawn this epoch: the same on every rank, and meaningful at any world
    size. A training loop rarely calls it directly: `ResumableBatches` hands out each batch
    with the state to save. Without it, note that under a ``DataLoader`` the sampler's own
    iterator runs ahead of training (prefetching), so a trainer passes what it has *consumed*:
    ``state_dict(batches_done=k)``, with k counted from where this epoch's iteration started
    (see `state_dict`). Example::

        s = ResumableSampler(10, batch_size=2, rank=0, world_size=2, seed=0)
        it = iter(s); [next(it) for _ in range(2)]     # first global batch, rank 0's half
        st = s.state_dict(batches_done=1)              # {'seed': 0, 'epoch': 0, 'position': 4}
        t = ResumableSampler(10, batch_size=4, rank=0, world_size=1, seed=0)
        t.load_state_dict(st); list(t)   # the 6 samples no rank has drawn, + 2 of padding
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        tail: Literal["pad", "drop"] = "pad",
    ) -> None:
        if dataset_len < 1 or batch_size < 1 or world_size < 1:
            raise ValueError(
                f"rank {rank}: dataset_len, batch_size and world_size must be >= 1, got "
                f"{dataset_len}, {batch_size}, {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if tail not in ("pad", "drop"):
            raise ValueError(f"rank {rank}: tail must be 'pad' or 'drop', got {tail!r}")
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.tail = tail
        self.epoch = 0
        self._start = 0  # stream position this epoch's next iteration starts from
        self._iter_start = 0  # where the current (or last) iteration started
        self._yielded = 0  # indices the current iterator has handed out (runs ahead)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless a loaded state is for this same epoch.

        A new epoch resets every counter: where the next iteration starts, where the last one
        started and how many indices it handed out. A `state_dict` taken right after
        ``set_epoch`` is then the new epoch's start, not the last epoch's end.
        """
        if epoch != self.epoch:
            self.epoch = epoch
            self._start = self._iter_start = self._yielded = 0

    def permutation(self) -> torch.Tensor:
        """This epoch's order of all ``dataset_len`` indices (the same on every rank)."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=g)

    def _end(self, start: int) -> int:
        """Stream position where the epoch ends when iteration starts at ``start``."""
        left = max(0, self.dataset_len - start)
        full, rest = divmod(left, self.global_batch)
        if rest and self.tail == "pad":
            full += 1
        return start + full * self.global_batch

    @property
    def dropped_tail(self) -> int:
        """Samples of this epoch never drawn because ``tail="drop"`` (0 with ``"pad"``)."""
        return max(0, self.dataset_len - self._end(self._start))

    def is_padding(self, position: int) -> bool:
        """Whether a stream position is tail padding (a repeat added by ``tail="pad"``)."""
        return position >= self.dataset_len

    def positions(self) -> Iterator[int]:
        """The stream positions this rank draws, from the current start to the epoch's end."""
        b, g = self.batch_size, self.global_batch
        for batch_start in range(self._start, self._end(self._start), g):
            first = batch_start + self.rank * b
            yield from range(first, first + b)

    def __iter__(self) -> Iterator[int]:
        perm = self.permutation().tolist()
        self._iter_start, self._yielded = self._start, 0
        for p in self.positions():
            self._yielded += 1
            yield perm[p % self.dataset_len]
        # A finished epoch: the next iteration (after set_epoch) starts from the beginning.
        self._start = 0

    def __len__(self) -> int:
        return (self._end(self._start) - self._start) // self.world_size

    def state_dict(self, batches_done: int | None = None) -> dict[str, int]:
        """The global position after ``batches_done`` batches of this rank in this epoch.

        ``batches_done`` counts from the position this epoch's iteration started at, which
        is not always the epoch's first sample: 0 for an epoch begun with `set_epoch` (or
        never resumed), but the loaded ``position`` for an epoch resumed with
        `load_state_dict`. So after resuming at position 40 and training 3 batches of a
        global batch of 8, pass ``batches_done=3`` (the result is position 64), not the
        number of batches since the epoch's start. Without ``batches_done`` the sampler's
        own count of handed-out indices (since that same start) is used, which is right only
        when nothing prefetches (``num_workers=0``, saved between batches); with worker
        processes the iterator is several batches ahead. `ResumableBatches` does this
        counting for you.
        """
        if batches_done is None:
            batches_done = self._yielded // self.batch_size
        start = self._iter_start if self._yielded else self._start
        position = min(start + batches_done * self.global_batch, self._end(start))
        return {"seed": self.seed, "epoch": self.epoch, "position": position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (saved at any world size); the seed must match."""
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"rank {self.rank}: sampler state has seed {state['seed']}, this sampler "
                f"{self.seed}; the permutation would differ. Build the sampler with the "
                "saved seed."
            )
        self.epoch = int(state["epoch"])
        self._start = self._iter_start = int(state["position"])
        self._yielded = 0


class ResumableBatches:
    """This rank's batches from a `ResumableSampler`, epoch after epoch, each with its position.

    ``next(batches)`` returns ``(state, batch)``: ``batch`` is this rank's next list of
    ``batch_size`` sample indices, and ``state`` the sampler state to put in a checkpoint
    taken *before* ``batch`` is trained; a run resumed from it (a sampler built alike,
    ``load_state_dict(state)``, a new ``ResumableBatches``) hands out ``batch`` again, then
    what followed it. The state travels with its batch, so a loop that fetches a batch ahead
    (nanoGPT's "prefetch the next batch" before the forward pass) saves the position of the
    batch it will train next, not of the one it fetched last. `state_dict` is the position
    after every batch handed out so far: what to save in a loop that saves *after* training a
    batch and fetches nothing ahead (`refimpl.train`). When an epoch has no full batch left
    the iterator moves the sampler to the next epoch (`ResumableSampler.set_epoch`), so it
    never ends. It reads the sampler's position at its first batch, so it may be built before
    or after ``sampler.load_state_dict``. Example::

        sampler = ResumableSampler(len(data), batch_size=4, rank=rank, world_size=world)
        if resumed is not None:
            sampler.load_state_dict(resumed["sampler"])
        batches = ResumableBatches(sampler)
        position, batch = next(batches)                 # prefetch, as nanoGPT does
        for step in range(start, steps):
            if step % save_every == 0:
                save(..., sampler_state=position)        # resumes at `batch`
            x = data[batch]
            position, batch = next(batches)              # the next one, ahead of training
            train_step(x)
    """

    def __init__(self, sampler: ResumableSampler) -> None:
        self.sampler = sampler
        self._epoch_iter: Iterator[int] | None = None
        self._start = 0  # where the current epoch's iteration started
        self._done = 0  # batches handed out since then

    def __iter__(self) -> ResumableBatches:
        return self

    def state_dict(self) -> dict[str, int]:
        """The sampler state after every batch handed out so far (the next batch's position)."""
        s = self.sampler
        if self._epoch_iter is None:  # between epochs, or before the first batch
            return {"seed": s.seed, "epoch": s.epoch, "position": s._start}
        position = min(self._start + self._done * s.global_batch, s._end(self._start))
        return {"seed": s.seed, "epoch": s.epoch, "position": position}

    def __next__(self) -> tuple[dict[str, int], list[int]]:
        s = self.sampler
        while True:
            if self._epoch_iter is None:
                self._start, self._done = s._start, 0
                self._epoch_iter = iter(s)
            state = self.state_dict()
            batch = list(itertools.islice(self._epoch_iter, s.batch_size))
            if len(batch) == s.batch_size:
                self._done += 1
                return state, batch
            if self._start == 0 and self._done == 0:  # a whole epoch without one batch
                raise ValueError(
                    f"rank {s.rank}: an epoch of {s.dataset_len} samples has no full global "
                    f"batch of {s.global_batch} with tail='drop': use tail='pad' or a smaller "
                    "batch"
                )
            # The epoch is over (positions come in whole batches): the next one from its start.
            s.set_epoch(s.epoch + 1)
            self._epoch_iter = None


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed for one sample's randomness, a fixed function of (seed, epoch, index).

    Augmentation drawn in a ``DataLoader`` worker from the worker's own RNG depends on which
    worker serves the sample and on what that worker served before, and a resume in the middle
    of an epoch changes both (the workers restart their streams). A generator seeded per sample
    with this value draws the same whichever worker, rank or world size draws the sample,
    prefetched or resumed, so there is no worker RNG state to save. Example::

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, i))
            top, left = torch.randint(0, 8, (2,), generator=g).tolist()   # a random crop
    """
    digest = hashlib.blake2b(f"{seed}/{epoch}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class RandomOffsets:
    """Random offsets drawn with replacement, resumable bit for bit, with no permutation.

    ``next()`` returns this rank's next ``batch_size`` offsets in ``[0, high)`` (int64),
    uniform and independent, as nanoGPT's ``torch.randint(len(data) - block_size,
    (batch_size,))`` draws them, but from a counter-based stream instead of the global RNG:
    the ranks together draw global batches 0, 1, 2, ... in turn, rank ``r`` taking indices
    ``r, r + world_size, r + 2 * world_size, ...`` (batch k of rank r is global batch
    ``k * world_size + r``), and global batch ``i`` is drawn by a ``torch.Generator`` seeded
    from a hash of ``(seed, i)``. So batch k on rank r is a pure function of (seed, rank, k)
    at a given world size: nothing is materialised (memory is one batch, where a permutation
    of every offset is ``8 * high`` bytes) and the state is one counter. Why: a resume is then
    exact without saving any RNG, and the sampling stays nanoGPT's (with replacement), which a
    permutation (`ResumableSampler`) silently changes to without.

    ``state_dict()`` is ``{"seed", "high", "batch_size", "world_size", "position"}``, with
    ``position`` the global batches drawn by all ranks (the same on every rank when they draw
    in lockstep); a `RandomOffsets` built alike that loads it draws exactly what the saved
    one would have drawn next. At another world size `load_state_dict` refuses unless
    ``allow_world_size_change=True``; then the rule is: continue from the global number of
    batches drawn (``position``), the new ranks taking the next global indices in turn. No
    global batch is drawn twice or skipped, so the stream stays i.i.d. and is even the same
    sequence of batches, but steps group them differently (M batches per step instead of N),
    so the training is not bit-identical to the uninterrupted run. Example::

        offsets = RandomOffsets(len(data) - block_size, batch_size, seed=1337,
                                rank=rank, world_size=world)
        if resumed is not None:
            offsets.load_state_dict(resumed.extra["offsets"])
        ix = offsets.next()
        x = torch.stack([data[i : i + block_size] for i in ix])

    Raises ValueError when ``high``, ``batch_size`` or ``world_size`` is below 1 or ``rank``
    is outside the world.
    """

    def __init__(
        self, high: int, batch_size: int, *, seed: int, rank: int, world_size: int
    ) -> None:
        if high < 1 or batch_size < 1 or world_size < 1:
            raise ValueError(
                f"rank {rank}: high, batch_size and world_size must be >= 1, got {high}, "
                f"{batch_size}, {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.high = high
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.position = 0  # global batches drawn by all ranks before this rank's next one

    def offsets(self, index: int) -> torch.Tensor:
        """Global batch ``index``: ``batch_size`` offsets in ``[0, high)``, the same anywhere."""
        digest = hashlib.blake2b(f"offsets/{self.seed}/{index}".encode(), digest_size=8)
        g = torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little"))
        return torch.randint(self.high, (self.batch_size,), generator=g, dtype=torch.int64)

    def next(self) -> torch.Tensor:
        """This rank's next batch of offsets (global batch ``position + rank``)."""
        batch = self.offsets(self.position + self.rank)
        self.position += self.world_size
        return batch

    def __iter__(self) -> RandomOffsets:
        return self

    def __next__(self) -> torch.Tensor:
        return self.next()

    def state_dict(self, prefetched: int = 0) -> dict[str, int]:
        """The state to save; ``prefetched``: batches drawn ahead and not trained yet.

        A loop that draws its next batch before the forward pass (nanoGPT's prefetch) saves
        ``state_dict(prefetched=1)``, so the resume draws that batch again.
        """
        if not 0 <= prefetched * self.world_size <= self.position:
            raise ValueError(
                f"rank {self.rank}: prefetched={prefetched} batches, but only "
                f"{self.position // self.world_size} were drawn"
            )
        position = self.position - prefetched * self.world_size
        return {
            "seed": self.seed,
            "high": self.high,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "position": position,
        }

    def load_state_dict(
        self, state: dict[str, Any], *, allow_world_size_change: bool = False
    ) -> None:
        """Continue from ``state``; see the class for the rule at another world size.

        Raises ValueError when the seed, ``high`` or ``batch_size`` differ (the draws would
        not be the saved run's), and when the world size differs unless
        ``allow_world_size_change``.
        """
        for key in ("seed", "high", "batch_size"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"rank {self.rank}: offsets state has {key} {state[key]}, this RandomOffsets "
                    f"{getattr(self, key)}; build it with the saved {key} to continue its stream"
                )
        saved_world = int(state["world_size"])
        if saved_world != self.world_size and not allow_world_size_change:
            raise ValueError(
                f"rank {self.rank}: offsets state was saved at world size {saved_world}, this "
                f"run has world size {self.world_size}. Pass allow_world_size_change=True to "
                "continue from the global number of batches drawn (i.i.d., not bit-identical "
                f"to a run at world size {saved_world})"
            )
        self.position = int(state["position"])
