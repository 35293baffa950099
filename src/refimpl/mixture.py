"""Chapter 7: multi-dataset sampling where every rank draws the same dataset at each step.

A multi-dataset trainer that lets each rank pick its next dataset on its own (its own RNG,
its own shuffled list) makes each rank run a different model head and reduce a different
set of metrics at the same step. Collectives pair by call order, not by meaning, so the ranks
hang or average unrelated numbers. `MixtureSampler` takes the fix DistributedSampler already
uses for sample order and applies it to the dataset choice: the choice comes from a generator
seeded by ``(seed, epoch)`` alone, identical on every rank, while the samples inside the
chosen dataset are split between ranks so none is drawn twice.

Datasets are kept in *sorted name order*. A ``set`` of names iterates in an order that depends
on the process's string hashing (``PYTHONHASHSEED``, random per process under torchrun), and a
dict built from one inherits that order: sorting is what makes "the same list" true on every
rank. The same applies to validation splits.

Epoch layout: dataset ``d`` of ``n_d`` samples contributes ``n_d // (batch_size * world_size)``
global batches; the tail that does not fill one is dropped for the epoch (a different tail
each epoch, since each epoch reshuffles). The epoch's sequence of dataset choices is those
batches, shuffled: a mixture proportional to dataset size, each sample drawn once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["MixtureSampler"]


class MixtureSampler:
    """Yields ``(dataset_name, indices)`` per step: the same name on every rank, this rank's
    ``batch_size`` indices into that dataset, disjoint from every other rank's.

    ``sizes`` maps dataset names to lengths. Call `set_epoch` at the start of each epoch
    (as with DistributedSampler) for a new order. `state_dict` / `load_state_dict` resume
    mid-epoch at the next step on the same world size and batch size.

    Example::

        sampler = MixtureSampler({"cls": 1000, "seg": 300}, batch_size=8,
                                 rank=dist.get_rank(), world_size=dist.get_world_size())
        for name, idx in sampler:
            batch = datasets[name][idx]
    """

    def __init__(
        self,
        sizes: Mapping[str, int],
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
    ) -> None:
        if not sizes:
            raise ValueError("MixtureSampler needs at least one dataset")
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"MixtureSampler: need batch_size >= 1 and 0 <= rank < world_size, got "
                f"batch_size={batch_size}, rank={rank}, world_size={world_size}"
            )
        for name, n in sizes.items():
            if not isinstance(n, int) or n < 0:
                raise ValueError(f"MixtureSampler: size of {name!r} must be an int >= 0, got {n!r}")
        self.names = sorted(sizes)  # the same order on every rank, whatever built ``sizes``
        self.sizes = {name: sizes[name] for name in self.names}
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.epoch = 0
        self.step = 0
        if not len(self):
            raise ValueError(
                f"MixtureSampler: no dataset fills one global batch of {batch_size * world_size} "
                f"samples ({self.sizes})"
            )

    def batches_per_dataset(self) -> dict[str, int]:
        """Global batches each dataset contributes to an epoch (the rest is its dropped tail)."""
        per = self.batch_size * self.world_size
        return {name: n // per for name, n in self.sizes.items()}

    def __len__(self) -> int:
        return sum(self.batches_per_dataset().values())

    def choices(self) -> list[str]:
        """This epoch's dataset per step: identical on every rank (seeded by seed and epoch)."""
        order = [name for name, k in self.batches_per_dataset().items() for _ in range(k)]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return [order[i] for i in torch.randperm(len(order), generator=gen).tolist()]

    def _permutation(self, name: str) -> list[int]:
        gen = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + self.epoch) * 1009 + self.names.index(name)
        )
        return torch.randperm(self.sizes[name], generator=gen).tolist()

    def __iter__(self) -> Iterator[tuple[str, list[int]]]:
        choices = self.choices()
        perms = {name: self._permutation(name) for name in self.names}
        used = {name: 0 for name in self.names}  # global batches of each dataset drawn so far
        per = self.batch_size * self.world_size
        for step, name in enumerate(choices):
            start = used[name] * per + self.rank * self.batch_size
            used[name] += 1
            if step < self.step:
                continue  # resumed mid-epoch: replay the choices, skip what was drawn
            self.step = step + 1
            yield name, perms[name][start : start + self.batch_size]
        self.step = 0

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (every rank must pass the same number)."""
        self.epoch, self.step = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch is: identical on every rank when they step in lockstep."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "step": self.step,
            "sizes": dict(self.sizes),
            "global_batch": self.batch_size * self.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state_dict`; refuses a different seed, datasets or global batch."""
        mine = self.state_dict()
        for key in ("seed", "sizes", "global_batch"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"MixtureSampler.load_state_dict: saved {key}={state[key]!r} but this sampler "
                    f"has {mine[key]!r}; resuming would draw a different sequence"
                )
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
