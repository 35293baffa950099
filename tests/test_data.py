"""ResumableSampler: every sample of the epoch drawn exactly once across a world-size change."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from refimpl.data import ResumableSampler
from refimpl.demos.resume import count_lost_repeated, resumable_draws


def test_permutation_is_deterministic_per_seed_and_epoch() -> None:
    a = ResumableSampler(50, batch_size=2, rank=0, world_size=1, seed=3)
    b = ResumableSampler(50, batch_size=2, rank=0, world_size=1, seed=3)
    assert a.permutation().tolist() == b.permutation().tolist()
    b.set_epoch(1)
    assert a.permutation().tolist() != b.permutation().tolist()
    assert sorted(b.permutation().tolist()) == list(range(50))


@pytest.mark.parametrize(("a", "b"), [(2, 4), (3, 2), (4, 3), (1, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("step", [0, 1, 3, 7])
def test_resume_a_to_b_draws_each_sample_once(a: int, b: int, step: int) -> None:
    assert count_lost_repeated(101, resumable_draws(101, 4, a, b, step)) == (0, 0)


@settings(max_examples=150, deadline=None)
@given(
    a=st.integers(1, 6),
    b=st.integers(1, 6),
    n=st.integers(1, 200),
    batch=st.integers(1, 9),
    step=st.integers(0, 40),
)
def test_resume_any_a_to_b_property(a: int, b: int, n: int, batch: int, step: int) -> None:
    assert count_lost_repeated(n, resumable_draws(n, batch, a, b, step)) == (0, 0)


def test_tail_pad_fills_last_global_batch_from_the_start() -> None:
    s = [ResumableSampler(10, batch_size=4, rank=r, world_size=2, seed=0) for r in range(2)]
    drawn = [list(x) for x in s]
    assert [len(d) for d in drawn] == [8, 8]  # 16 positions: 10 samples + 6 padding
    assert sorted(set(drawn[0] + drawn[1])) == list(range(10))
    assert s[0].dropped_tail == 0 and s[1].is_padding(10) and not s[1].is_padding(9)


def test_tail_drop_ends_epoch_and_says_how_many() -> None:
    s = ResumableSampler(10, batch_size=4, rank=0, world_size=2, seed=0, tail="drop")
    assert len(list(s)) == 4 and s.dropped_tail == 2 and len(s) == 4


def test_state_after_prefetch_needs_batches_done() -> None:
    s = ResumableSampler(64, batch_size=4, rank=0, world_size=1, seed=0)
    loader = DataLoader(range(64), batch_size=4, sampler=s, num_workers=2, prefetch_factor=2)
    it = iter(loader)
    consumed = [next(it) for _ in range(3)]
    assert s.state_dict()["position"] > 12  # the sampler ran ahead of training
    state = s.state_dict(batches_done=3)
    assert state["position"] == 12
    del it
    t = ResumableSampler(64, batch_size=4, rank=0, world_size=1, seed=0)
    t.load_state_dict(state)
    rest = list(DataLoader(range(64), batch_size=4, sampler=t, num_workers=2))
    got = [int(i) for b in consumed + rest for i in b]
    assert got == s.permutation().tolist()


def test_seed_mismatch_and_bad_arguments_are_refused() -> None:
    s = ResumableSampler(10, batch_size=2, rank=0, world_size=1, seed=1)
    with pytest.raises(ValueError, match="seed"):
        s.load_state_dict({"seed": 2, "epoch": 0, "position": 0})
    with pytest.raises(ValueError, match="rank 3"):
        ResumableSampler(10, batch_size=2, rank=3, world_size=2)
    with pytest.raises(ValueError, match="tail"):
        ResumableSampler(10, batch_size=2, rank=0, world_size=1, tail="wrap")  # type: ignore[arg-type]


def test_set_epoch_keeps_loaded_position_for_same_epoch() -> None:
    s = ResumableSampler(20, batch_size=2, rank=0, world_size=1, seed=0)
    s.load_state_dict({"seed": 0, "epoch": 1, "position": 6})
    s.set_epoch(1)
    assert len(list(s)) == 14
    s.set_epoch(2)
    assert len(list(s)) == 20
