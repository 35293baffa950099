"""The small trained and untrained models tests/test_sharded*.py save and load."""

from __future__ import annotations

import torch

from refimpl.demos.sharded import tiny_model, train


def trained(seed: int = 0, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The chapter's MLP with Adam after ``steps`` training steps."""
    model = tiny_model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, range(1, steps + 1))
    return model, opt


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Other weights and an empty Adam: what a load must overwrite."""
    model = tiny_model(5)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)
