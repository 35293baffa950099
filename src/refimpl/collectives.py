"""Chapter 1: processes, ranks and collectives, shown on a few gloo processes."""

from __future__ import annotations

from refimpl.launch import RankInfo, init_from_env


def rank_info() -> RankInfo:
    """Worker: report where this process sits (rank, local rank, world size, backend)."""
    return init_from_env()
