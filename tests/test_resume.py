"""Chapter 6's demos: MiniMind's step conversion miscounts; our resume is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from refimpl.data import ResumableSampler
from refimpl.demos.resume import (
    count_lost_repeated,
    loader_stop_resume,
    lost_repeated_table,
    minimind_draws,
    resume_experiment,
    stateful_dataloader_resume,
)


def test_minimind_conversion_repeats_rounded_away_steps() -> None:
    # 2 -> 4 GPUs after 1 step: 1 * 2 // 4 = 0 batches skipped, so the 8 drawn are redrawn.
    assert count_lost_repeated(100, minimind_draws(100, 4, 2, 4, 1)) == (0, 8)
    # Same world size: nothing lost, nothing repeated.
    assert count_lost_repeated(100, minimind_draws(100, 4, 2, 2, 5)) == (0, 0)


def test_minimind_one_gpu_uses_another_permutation() -> None:
    lost, repeated = count_lost_repeated(100, minimind_draws(100, 4, 2, 1, 5))
    assert lost > 0 and repeated > 0


def test_table_resumable_columns_are_zero() -> None:
    rows = lost_repeated_table(100, 4, [(2, 4), (3, 2), (4, 3), (1, 2)], [1, 5])
    assert all(r["resumable lost"] == 0 and r["resumable repeated"] == 0 for r in rows)
    assert any(r["minimind repeated"] > 0 for r in rows)


def test_stateful_dataloader_exact_same_world_size_not_across() -> None:
    assert stateful_dataloader_resume(96, 4, 2, 2, 5, num_workers=2) == (0, 0)
    lost, repeated = stateful_dataloader_resume(96, 4, 2, 4, 5)
    assert (lost, repeated) != (0, 0)


@pytest.mark.parametrize("save", ["batches_done", "stateful"])
def test_loader_with_workers_resumes_where_training_stopped(save: str) -> None:
    # 46 samples, global batch 2 x 3 = 6: the last global batch has 2 positions of padding.
    data = TensorDataset(torch.arange(46))
    for rank in range(2):
        r = loader_stop_resume(
            data, batch_size=3, rank=rank, world_size=2, stop_after=3, save=save, seed=1
        )
        assert r["first"] == r["full"][:3] and r["rest"] == r["full"][3:]
        # Workers prefetched 2 x 2 batches ahead of the 3 consumed: the sampler ran ahead.
        assert r["sampler_ahead"]["position"] == 7 * 6
    s = ResumableSampler(46, batch_size=3, rank=1, world_size=2, seed=1)
    assert [p for p in s.positions() if s.is_padding(p)] == [46, 47]


def test_loader_saving_the_sampler_count_loses_prefetched_batches() -> None:
    r = loader_stop_resume(
        TensorDataset(torch.arange(46)), batch_size=3, rank=0, world_size=2, stop_after=3,
        save="sampler_count", seed=1,
    )  # fmt: skip
    assert r["rest"] == r["full"][7:] and len(r["full"]) == 8


@pytest.mark.slow
def test_resume_same_world_size_is_bit_identical(tmp_path: Path) -> None:
    r = resume_experiment(str(tmp_path))
    assert r["resumed_losses"] == r["full_losses"]
    assert r["resumed_order"] == r["full_order"]
    assert torch.equal(r["resumed_params"], r["full_params"])


@pytest.mark.slow
@pytest.mark.parametrize("what", ["optimizer", "rng"])
def test_resume_negative_controls_differ(tmp_path: Path, what: str) -> None:
    r = resume_experiment(
        str(tmp_path), restore_optimizer=what != "optimizer", restore_rng=what != "rng"
    )
    assert r["resumed_order"] == r["full_order"]
    assert r["resumed_losses"][:5] == r["full_losses"][:5]
    assert r["resumed_losses"][5:] != r["full_losses"][5:]
    assert not torch.equal(r["resumed_params"], r["full_params"])


@pytest.mark.slow
def test_resume_across_world_size_same_order_close_losses(tmp_path: Path) -> None:
    r = resume_experiment(str(tmp_path), ws_before=2, ws_after=4, dropout=0.0)
    assert r["resumed_order"] == r["full_order"]
    torch.testing.assert_close(
        torch.tensor(r["resumed_losses"]), torch.tensor(r["full_losses"]), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(r["resumed_params"], r["full_params"], rtol=1e-5, atol=1e-6)
