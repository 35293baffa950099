"""Chapter 6's loader demos: the position under prefetching, worker seeds, a stream's position."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from refimpl.data import ResumableSampler
from refimpl.demos.loader_state import (
    NoisySamples,
    ShardedStream,
    augment_resume,
    loader_stop_resume,
    stateful_dataloader_resume,
    stream_resume,
    worker_seeds,
)


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
        TensorDataset(torch.arange(46)),
        batch_size=3,
        rank=0,
        world_size=2,
        stop_after=3,
        save="sampler_count",
        seed=1,
    )
    assert r["rest"] == r["full"][7:] and len(r["full"]) == 8


def test_without_workers_the_sampler_count_is_the_trained_count() -> None:
    r = loader_stop_resume(
        TensorDataset(torch.arange(46)),
        batch_size=3,
        rank=0,
        world_size=2,
        stop_after=3,
        save="sampler_count",
        seed=1,
        num_workers=0,
    )
    assert r["saved"]["position"] == 18 and r["first"] + r["rest"] == r["full"]


def test_worker_seed_is_base_seed_plus_worker_id_and_iter_draws_from_the_main_rng() -> None:
    s = worker_seeds(num_workers=2, seed=3)
    base = s["expected_base_seed"]
    assert s["workers"] == {0: (base, base), 1: (base + 1, base + 1)}
    assert s["advances"] == {0: True, 2: True}
    assert worker_seeds(num_workers=2, seed=4)["expected_base_seed"] != base


def _noise(batches: list[list[tuple[int, int, int]]]) -> list[list[tuple[int, int]]]:
    return [[(i, n) for i, n, _ in b] for b in batches]


@pytest.mark.parametrize("loader", ["plain", "stateful"])
def test_worker_rng_augmentation_does_not_survive_a_mid_epoch_resume(loader: str) -> None:
    r = augment_resume("worker_rng", loader)  # type: ignore[arg-type]
    full, resumed = _noise(r["full"]), _noise(r["resumed"])
    assert [[i for i, _ in b] for b in full] == [[i for i, _ in b] for b in resumed]
    assert full[:3] == resumed[:3] and full[3:] != resumed[3:]
    # The resumed workers start their streams again: batch 3 carries an early batch's noise.
    noise = [tuple(n for _, n in b) for b in full]
    assert noise.index(tuple(n for _, n in resumed[3])) < 3


@pytest.mark.parametrize("loader", ["plain", "stateful"])
def test_per_sample_seeded_augmentation_survives_any_resume(loader: str) -> None:
    r = augment_resume("sample_seed", loader)  # type: ignore[arg-type]
    assert _noise(r["full"]) == _noise(r["resumed"])
    assert augment_resume("sample_seed", stop_after=4)["resumed"] is not None


def test_noisy_samples_with_a_seed_draw_per_sample_not_per_worker() -> None:
    a, b = NoisySamples(10, seed=7), NoisySamples(10, seed=7, epoch=1)
    assert a[3][:2] == NoisySamples(10, seed=7)[3][:2] and a[3][1] != b[3][1]
    assert NoisySamples(10)[3][2] == -1  # no worker: the main process


@pytest.mark.parametrize("stop_after", [3, 4])
def test_stream_resume_by_hand_is_in_order_only_on_a_round_boundary(stop_after: int) -> None:
    plain = stream_resume("plain", stop_after=stop_after)
    assert sorted(plain["full"]) == sorted(plain["resumed"])
    assert (plain["full"] == plain["resumed"]) == (stop_after % 2 == 0)
    stateful = stream_resume("stateful", stop_after=stop_after)
    assert stateful["full"] == stateful["resumed"]


def test_sharded_stream_without_workers_reads_every_record_and_skips() -> None:
    assert list(ShardedStream(5)) == [0, 1, 2, 3, 4]
    assert list(ShardedStream(5, skip={0: 2})) == [2, 3, 4]
