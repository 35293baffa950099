"""refimpl.mixture.MixtureSampler: one dataset per step on every rank, disjoint samples, each
sample of an epoch drawn once, independent of the order the datasets were given in."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.mixture import MixtureSampler


def _epoch(
    sizes: dict[str, int], world: int, batch: int, seed: int = 0, epoch: int = 0
) -> list[list[tuple[str, list[int]]]]:
    out = []
    for rank in range(world):
        s = MixtureSampler(sizes, batch_size=batch, rank=rank, world_size=world, seed=seed)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@settings(max_examples=80, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["cls", "det", "seg", "ocr", "qa"]), st.integers(0, 60), min_size=1
    ),
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(0, 3),
)
def test_same_dataset_every_step_disjoint_samples_each_once(
    sizes: dict[str, int], world: int, batch: int, epoch: int
) -> None:
    if not any(n // (batch * world) for n in sizes.values()):
        with pytest.raises(ValueError, match="no dataset fills one global batch"):
            MixtureSampler(sizes, batch_size=batch, rank=0, world_size=world)
        return
    ranks = _epoch(sizes, world, batch, epoch=epoch)
    steps = len(ranks[0])
    assert all(len(r) == steps for r in ranks)
    drawn: Counter[tuple[str, int]] = Counter()
    for step in range(steps):
        names = {ranks[r][step][0] for r in range(world)}
        assert len(names) == 1  # every rank draws the same dataset at this step
        for r in range(world):
            name, idx = ranks[r][step]
            assert len(idx) == batch
            drawn.update((name, i) for i in idx)
    assert max(drawn.values()) == 1  # nothing twice, across ranks and steps
    per = batch * world
    for name, n in sizes.items():
        assert sum(1 for d, _ in drawn if d == name) == n // per * per  # only the tail dropped


def test_order_of_the_given_datasets_does_not_matter() -> None:
    a = _epoch({"seg": 40, "cls": 80, "det": 24}, 2, 4)
    b = _epoch({"det": 24, "cls": 80, "seg": 40}, 2, 4)
    assert a == b


def test_epochs_differ_and_seed_matters() -> None:
    sizes = {"cls": 64, "seg": 64}
    assert _epoch(sizes, 2, 4, epoch=0) != _epoch(sizes, 2, 4, epoch=1)
    assert _epoch(sizes, 2, 4, seed=0) != _epoch(sizes, 2, 4, seed=1)


def test_resume_mid_epoch_continues_exactly() -> None:
    sizes = {"cls": 64, "seg": 32, "det": 48}
    full = _epoch(sizes, 2, 4, epoch=2)
    for rank in range(2):
        s = MixtureSampler(sizes, batch_size=4, rank=rank, world_size=2)
        s.set_epoch(2)
        it = iter(s)
        head = [next(it) for _ in range(5)]
        state = s.state_dict()
        t = MixtureSampler(sizes, batch_size=4, rank=rank, world_size=2)
        t.load_state_dict(state)
        assert head + list(t) == full[rank]
        assert t.state_dict()["step"] == 0  # the epoch ended: the next iteration starts afresh


def test_refuses_a_state_from_another_configuration() -> None:
    s = MixtureSampler({"cls": 64}, batch_size=4, rank=0, world_size=2)
    other = MixtureSampler({"cls": 64}, batch_size=4, rank=0, world_size=4).state_dict()
    with pytest.raises(ValueError, match="global_batch"):
        s.load_state_dict(other)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sizes": {}}, "at least one dataset"),
        ({"sizes": {"a": -1}}, "int >= 0"),
        ({"rank": 2}, "0 <= rank < world_size"),
        ({"batch_size": 0}, "batch_size >= 1"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:  # type: ignore[type-arg]
    args = {"sizes": {"a": 8}, "batch_size": 2, "rank": 0, "world_size": 2} | kwargs
    sizes = args.pop("sizes")
    with pytest.raises(ValueError, match=match):
        MixtureSampler(sizes, **args)
