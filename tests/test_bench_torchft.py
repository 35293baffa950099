"""refimpl.bench.torchft: the crossover of the waste model chapter 13 draws from the
benchmark. The benchmark itself is not run here: at 16 steps and one approach it took over
four minutes on the 2-core machine (load about 11, the full benchmark beside it), every run
starting processes that import torch and torchft; its parts run in tests/test_torchft_job.py
and chapter 13."""

from __future__ import annotations

from refimpl.bench.torchft import crossover


def test_the_crossover_is_where_the_two_wastes_meet() -> None:
    """Restart: sqrt(2 C l) + R l; torchft: o + c l. With C = 0, R = 2 and c = 1 the two
    meet where o = l (2 - 1): l = o."""
    lam = crossover(0.01, 1.0, 0.0, 2.0)
    assert lam is not None and abs(lam - 0.01) < 1e-9
    assert crossover(0.01, 3.0, 0.0, 2.0) is None  # torchft costs more per failure: never
    assert crossover(0.0, 3.0, 1.0, 2.0) == 0.0  # no overhead: torchft wins at every rate
    lam = crossover(0.05, 10.0, 60.0, 600.0)
    assert lam is not None
    assert abs((0.05 + 10 * lam) - ((2 * 60 * lam) ** 0.5 + 600 * lam)) < 1e-9
