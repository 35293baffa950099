"""refimpl.torchft_checkpoint: the batch of a committed step, and refimpl checkpoints that carry a
torchft Manager's state (a fake manager here; tests/test_torchft_job.py runs the real one)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from refimpl.checkpoint import CheckpointError, list_checkpoints, save_checkpoint
from refimpl.torchft_checkpoint import (
    MANAGER_KEY,
    batch_for_step,
    load_ft_checkpoint,
    save_ft_checkpoint,
)


class FakeManager:
    """The four methods the glue uses, with torchft.Manager's meanings."""

    def __init__(self, step: int = 0, rank: int | None = 0) -> None:
        self.step, self.rank, self.batches = step, rank, 0

    def current_step(self) -> int:
        return self.step

    def participating_rank(self) -> int | None:
        return self.rank

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "batches_committed": self.batches}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.step, self.batches = state_dict["step"], state_dict["batches_committed"]


def test_each_epoch_the_groups_batches_cover_the_dataset_once() -> None:
    """3 groups x 4 samples, 36 samples: 3 steps an epoch; every sample once per epoch."""
    for epoch in range(2):
        seen = Counter(
            i
            for step in range(3 * epoch, 3 * epoch + 3)
            for g in range(3)
            for i in batch_for_step(step, replica=g, replicas=3, dataset_len=36, batch_size=4)
        )
        assert sorted(seen) == list(range(36)) and set(seen.values()) == {1}


def test_the_batch_is_a_function_of_the_step_and_epochs_are_shuffled_apart() -> None:
    kw = {"replica": 1, "replicas": 2, "dataset_len": 32, "batch_size": 4, "seed": 7}
    assert batch_for_step(5, **kw) == batch_for_step(5, **kw)  # a healed group: same batch
    assert batch_for_step(1, **kw) != batch_for_step(5, **kw)  # step 1 and 5: epochs 0 and 1
    assert batch_for_step(1, **kw) != batch_for_step(1, **{**kw, "replica": 0})


def test_bad_input_is_refused_with_the_replica_named() -> None:
    with pytest.raises(ValueError, match="replica 0: step must be >= 0"):
        batch_for_step(-1, replica=0, replicas=2, dataset_len=32, batch_size=4)
    with pytest.raises(ValueError, match="replica 1: a dataset of 7 samples is smaller"):
        batch_for_step(0, replica=1, replicas=2, dataset_len=7, batch_size=4)
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        batch_for_step(0, replica=2, replicas=2, dataset_len=32, batch_size=4)


def test_only_participating_rank_0_saves_at_multiples_of_every(tmp_path: Path) -> None:
    state = {"model": {"w": torch.ones(2)}}
    assert save_ft_checkpoint(tmp_path, FakeManager(10, rank=1), state, every=5) is None
    assert save_ft_checkpoint(tmp_path, FakeManager(10, rank=None), state, every=5) is None
    assert save_ft_checkpoint(tmp_path, FakeManager(7), state, every=5) is None
    assert save_ft_checkpoint(tmp_path, FakeManager(0), state, every=5) is None
    assert list_checkpoints(tmp_path) == []
    saved = save_ft_checkpoint(tmp_path, FakeManager(10), state, every=5)
    assert saved is not None and saved.name == "step_00000010"


def test_a_restart_restores_the_managers_step_with_the_weights(tmp_path: Path) -> None:
    writer = FakeManager(20)
    writer.batches = 37
    save_ft_checkpoint(tmp_path, writer, {"model": {"w": torch.arange(3.0)}}, every=10)
    fresh = FakeManager()
    found = load_ft_checkpoint(tmp_path, fresh)
    assert found is not None
    step, state = found
    assert step == 20 and fresh.state_dict() == {"step": 20, "batches_committed": 37}
    assert torch.equal(state["model"]["w"], torch.arange(3.0))
    assert load_ft_checkpoint(tmp_path / "empty", FakeManager()) is None


def test_a_checkpoint_without_the_managers_state_is_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"model": {"w": torch.ones(1)}}, 5)
    with pytest.raises(CheckpointError, match="step_00000005: has no 'torchft' entry"):
        load_ft_checkpoint(tmp_path, FakeManager())


def test_bad_arguments_to_save_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="every must be >= 1"):
        save_ft_checkpoint(tmp_path, FakeManager(10), {}, every=0)
    with pytest.raises(ValueError, match=f"must not have the key '{MANAGER_KEY}'"):
        save_ft_checkpoint(tmp_path, FakeManager(10), {MANAGER_KEY: {}}, every=5)
