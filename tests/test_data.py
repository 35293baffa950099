"""ResumableSampler: every sample of the epoch drawn exactly once across a world-size change."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from refimpl.data import RandomOffsets, ResumableBatches, ResumableSampler, sample_seed
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


# --- issue 24 item 2: ResumableBatches, and what batches_done counts from ----------------------


def _stream(n: int, batch: int, ws: int, epochs: int, tail: str = "pad") -> list[list[list[int]]]:
    """Each rank's batches of ``epochs`` whole epochs, straight from the sampler."""
    out = []
    for r in range(ws):
        s = ResumableSampler(n, batch_size=batch, rank=r, world_size=ws, tail=tail)  # type: ignore[arg-type]
        mine = []
        for e in range(epochs):
            s.set_epoch(e)
            idx = list(s)
            mine += [idx[i : i + batch] for i in range(0, len(idx), batch)]
        out.append(mine)
    return out


def test_batches_run_epoch_after_epoch_and_pair_each_batch_with_its_position() -> None:
    s = ResumableSampler(10, batch_size=2, rank=0, world_size=2, seed=0)
    b = ResumableBatches(s)
    got = [next(b) for _ in range(9)]  # 3 global batches an epoch (the last one padded)
    assert [batch for _, batch in got] == _stream(10, 2, 2, 3)[0]
    assert [(st_["epoch"], st_["position"]) for st_, _ in got] == [
        (0, 0),
        (0, 4),
        (0, 8),
        (1, 0),
        (1, 4),
        (1, 8),
        (2, 0),
        (2, 4),
        (2, 8),
    ]
    assert b.state_dict() == {"seed": 0, "epoch": 2, "position": 12}  # after the last one
    assert iter(b) is b


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 40),
    batch=st.integers(1, 4),
    ws=st.integers(1, 3),
    new_ws=st.integers(1, 3),
    k=st.integers(0, 25),
    tail=st.sampled_from(["pad", "drop"]),
)
def test_resuming_from_a_batchs_position_draws_that_batch_again_at_any_world_size(
    n: int, batch: int, ws: int, new_ws: int, k: int, tail: str
) -> None:
    if n < batch * max(ws, new_ws) and tail == "drop":
        return  # no full batch at all: refused (next test)
    ranks = [
        ResumableBatches(ResumableSampler(n, batch_size=batch, rank=r, world_size=ws, tail=tail))
        for r in range(ws)
    ]  # type: ignore[arg-type]
    drawn = [[next(b) for _ in range(k + 1)] for b in ranks]  # batch k was fetched ahead ...
    states = [d[k][0] for d in drawn]  # ... and its position is what a checkpoint saves
    assert all(st_ == states[0] for st_ in states)  # the same on every rank
    if new_ws == ws:  # the same world: exactly the batches from k on, rank by rank
        for r in range(ws):
            s = ResumableSampler(n, batch_size=batch, rank=r, world_size=ws, tail=tail)  # type: ignore[arg-type]
            s.load_state_dict(states[0])
            again = ResumableBatches(s)
            assert [next(again)[1] for _ in range(3)] == [
                bt for _, bt in [*drawn[r][k:], *(next(ranks[r]) for _ in range(2))]
            ]
    # any world: the rest of the epoch is the samples nobody trained yet, each once
    epoch, pos = states[0]["epoch"], states[0]["position"]
    rest, dropped = [], 0
    for r in range(new_ws):
        s = ResumableSampler(n, batch_size=batch, rank=r, world_size=new_ws, tail=tail)  # type: ignore[arg-type]
        s.load_state_dict(states[0])
        dropped = s.dropped_tail  # (read before iterating: a finished epoch starts over)
        rest += [i for p, i in zip(s.positions(), s, strict=True) if not s.is_padding(p)]
    perm = ResumableSampler(n, batch_size=batch, rank=0, world_size=1)
    perm.set_epoch(epoch)
    order = perm.permutation().tolist()
    assert sorted(rest) == sorted(order[pos : n - dropped])


def test_batches_refuse_an_epoch_without_one_full_batch_instead_of_looping() -> None:
    s = ResumableSampler(3, batch_size=2, rank=0, world_size=2, tail="drop")
    with pytest.raises(ValueError, match="no full global batch of 4"):
        next(ResumableBatches(s))


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 30),
    batch=st.integers(1, 4),
    ws=st.integers(1, 3),
    start=st.integers(0, 30),
    k=st.integers(0, 20),
)
def test_batches_state_dict_is_the_samplers_when_nothing_is_fetched_ahead(
    n: int, batch: int, ws: int, start: int, k: int
) -> None:
    # refimpl.train saves batches.state_dict() where it used to save sampler.state_dict():
    # checkpoints keep their meaning.
    s = ResumableSampler(n, batch_size=batch, rank=ws - 1, world_size=ws)
    s.load_state_dict({"seed": 0, "epoch": 0, "position": min(start, n)})
    b = ResumableBatches(s)
    for _ in range(k):
        next(b)
        assert b.state_dict() == s.state_dict()


def test_batches_done_counts_from_where_the_epoch_was_resumed_as_documented() -> None:
    # state_dict's docstring: resumed at 40, 3 batches of a global batch of 8 -> position 64.
    s = ResumableSampler(100, batch_size=4, rank=1, world_size=2, seed=0)
    s.load_state_dict({"seed": 0, "epoch": 0, "position": 40})
    it = iter(s)
    for _ in range(3 * 4 + 6):  # 3 batches trained, one and a half more prefetched
        next(it)
    assert s.state_dict(batches_done=3) == {"seed": 0, "epoch": 0, "position": 64}
    s.set_epoch(1)  # a new epoch: counted from 0 again
    assert s.state_dict(batches_done=3)["position"] == 24


def test_the_class_docstring_example_says_what_it_does() -> None:
    s = ResumableSampler(10, batch_size=2, rank=0, world_size=2, seed=0)
    it = iter(s)
    [next(it) for _ in range(2)]
    st_ = s.state_dict(batches_done=1)
    assert st_ == {"seed": 0, "epoch": 0, "position": 4}
    t = ResumableSampler(10, batch_size=4, rank=0, world_size=1, seed=0)
    t.load_state_dict(st_)
    rest = list(t)
    assert len(rest) == 8 and [t.is_padding(p) for p in t.positions()].count(True) == 2
    assert sorted(rest[:6]) == sorted(s.permutation().tolist()[4:])


def test_sample_seed_is_a_fixed_function_of_seed_epoch_and_index() -> None:
    assert sample_seed(7, 0, 5) == sample_seed(7, 0, 5)
    seeds = {sample_seed(s, e, i) for s in (7, 8) for e in (0, 1) for i in range(50)}
    assert len(seeds) == 2 * 2 * 50 and all(0 <= x < 2**64 for x in seeds)
    # torch accepts every value as a generator seed, and equal seeds draw equal numbers.
    draws = [
        torch.randint(0, 10**6, (3,), generator=torch.Generator().manual_seed(x)).tolist()
        for x in sorted(seeds)[-2:] * 2
    ]
    assert draws[0] == draws[2] and draws[0] != draws[1]


# RandomOffsets: nanoGPT's with-replacement offsets from a counter, resumable bit for bit.


def _draw(offsets: RandomOffsets, n: int) -> list[list[int]]:
    return [offsets.next().tolist() for _ in range(n)]


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 4),
    high=st.integers(1, 10**12),
    batch=st.integers(1, 8),
    before=st.integers(0, 12),
    prefetched=st.integers(0, 1),
)
def test_random_offsets_resume_is_bit_identical_at_the_same_world_size(
    world: int, high: int, batch: int, before: int, prefetched: int
) -> None:
    """Every rank draws `before` batches, saves (one batch prefetched or not), and a fresh
    RandomOffsets that loads the state draws exactly what the uninterrupted one draws next."""
    prefetched = min(prefetched, before)
    for rank in range(world):
        a = RandomOffsets(high, batch, seed=7, rank=rank, world_size=world)
        _draw(a, before)
        state = a.state_dict(prefetched=prefetched)
        rest = _draw(a, 5)
        b = RandomOffsets(high, batch, seed=7, rank=rank, world_size=world)
        b.load_state_dict(dict(state))
        again = _draw(b, 5 + prefetched)
        if prefetched:  # the batch drawn ahead comes again: global (before - 1) * world + rank
            assert again[0] == b.offsets((before - 1) * world + rank).tolist()
        assert again[prefetched:] == rest
        assert all(0 <= o < high for row in again for o in row)


def test_random_offsets_batch_is_a_function_of_seed_rank_and_count() -> None:
    """Batch k on rank r: the same in any process and after any history; ranks differ."""
    first = [_draw(RandomOffsets(10**9, 4, seed=1, rank=r, world_size=2), 3) for r in range(2)]
    again = [_draw(RandomOffsets(10**9, 4, seed=1, rank=r, world_size=2), 3) for r in range(2)]
    assert first == again and first[0] != first[1]
    other_seed = _draw(RandomOffsets(10**9, 4, seed=2, rank=0, world_size=2), 3)
    assert other_seed != first[0]


def test_random_offsets_are_uniform_and_drawn_with_replacement() -> None:
    """20 000 offsets in [0, 10): each value about 2000 times (chi-square well under the
    0.1% critical value for 9 degrees of freedom, 27.9), and repeats inside one batch of 16
    from 10 values, which sampling without replacement could never give."""
    s = RandomOffsets(10, 16, seed=0, rank=1, world_size=3)
    drawn = torch.cat([s.next() for _ in range(1250)])
    assert drawn.dtype == torch.int64 and int(drawn.min()) == 0 and int(drawn.max()) == 9
    counts = torch.bincount(drawn, minlength=10).double()
    chi2 = float(((counts - 2000) ** 2 / 2000).sum())
    assert chi2 < 27.9, counts
    assert len(set(s.next().tolist())) < 16  # pigeonhole: 16 draws from 10 values repeat


def test_random_offsets_need_no_memory_per_offset() -> None:
    """high = 2**62 offsets: a permutation of them would need 2**65 bytes; RandomOffsets
    draws a batch and its state is one counter."""
    s = RandomOffsets(2**62, 3, seed=0, rank=0, world_size=1)
    batch = s.next()
    assert batch.shape == (3,) and int(batch.max()) < 2**62
    assert s.state_dict()["position"] == 1


def test_random_offsets_refuse_another_world_size_unless_told() -> None:
    """A state from 2 ranks loaded at 3: refused, naming both world sizes; allowed, the
    3 ranks continue the global stream where the 2 left it, no global batch drawn twice."""
    two = [RandomOffsets(1000, 4, seed=5, rank=r, world_size=2) for r in range(2)]
    for s in two:
        _draw(s, 3)  # global batches 0..5
    state = two[0].state_dict()
    three = RandomOffsets(1000, 4, seed=5, rank=2, world_size=3)
    with pytest.raises(ValueError, match=r"world size 2, this run has world size 3"):
        three.load_state_dict(state)
    three.load_state_dict(state, allow_world_size_change=True)
    assert three.next().tolist() == three.offsets(8).tolist()  # 6, 7, 8: rank 2 takes 8
    with pytest.raises(ValueError, match="seed 5, this RandomOffsets 6"):
        RandomOffsets(1000, 4, seed=6, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="outside world_size"):
        RandomOffsets(1000, 4, seed=5, rank=2, world_size=2)
