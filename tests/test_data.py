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


# --- issue 19 item 5: set_epoch resets every iteration counter ---------------------------------


def _resume_draws(s: ResumableSampler, epoch: int, batches_done: int | None) -> list[int]:
    """What a fresh sampler (same config) draws of ``epoch`` after loading ``s``'s state."""
    state = s.state_dict() if batches_done is None else s.state_dict(batches_done=batches_done)
    t = ResumableSampler(s.dataset_len, batch_size=s.batch_size, rank=0, world_size=1, seed=0)
    t.load_state_dict(state)
    t.set_epoch(epoch)
    return list(t)


def test_state_after_set_epoch_is_the_new_epochs_start() -> None:
    s = ResumableSampler(20, batch_size=2, rank=0, world_size=1, seed=0)
    list(s)  # the whole of epoch 0
    s.set_epoch(1)  # a checkpoint taken here must resume at the start of epoch 1
    assert s.state_dict() == {"seed": 0, "epoch": 1, "position": 0}
    assert len(_resume_draws(s, 1, None)) == 20


def test_state_after_a_resumed_epoch_does_not_carry_its_start_offset() -> None:
    s = ResumableSampler(20, batch_size=2, rank=0, world_size=1, seed=0)
    s.load_state_dict({"seed": 0, "epoch": 0, "position": 12})
    assert len(list(s)) == 8  # the rest of the resumed epoch 0
    s.set_epoch(1)
    assert s.state_dict(batches_done=0)["position"] == 0
    assert len(_resume_draws(s, 1, 0)) == 20


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 60),
    batch=st.integers(1, 5),
    ws=st.integers(1, 4),
    start=st.integers(0, 60),
    done=st.integers(0, 20),
    use_count=st.booleans(),
)
def test_any_save_after_set_epoch_resumes_the_whole_new_epoch(
    n: int, batch: int, ws: int, start: int, done: int, use_count: bool
) -> None:
    # epoch 0 resumed anywhere, drawn (partly or to the end), then set_epoch(1) and a save:
    # epoch 1 must come back whole on every rank, whatever was counted before.
    ranks = [ResumableSampler(n, batch_size=batch, rank=r, world_size=ws) for r in range(ws)]
    for s in ranks:
        s.load_state_dict({"seed": 0, "epoch": 0, "position": min(start, n)})
        it = iter(s)
        for _ in range(min(done * batch, len(s))):
            next(it)
        s.set_epoch(1)
    states = [s.state_dict() if use_count else s.state_dict(batches_done=0) for s in ranks]
    assert all(st_ == {"seed": 0, "epoch": 1, "position": 0} for st_ in states)
    fresh = [ResumableSampler(n, batch_size=batch, rank=r, world_size=ws) for r in range(ws)]
    drawn = []
    for s in fresh:
        s.load_state_dict(states[0])
        s.set_epoch(1)
        drawn += [i for p, i in zip(s.positions(), s, strict=True) if not s.is_padding(p)]
    assert sorted(drawn) == list(range(n))
