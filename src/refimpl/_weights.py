"""A model's weights as an export stores them: both `refimpl.state.export_safetensors` (one
process's model) and `refimpl.sharded.export_hf` (a sharded step) name and copy tensors the
same way, so the two exports of one model hold the same keys and bytes."""

from __future__ import annotations

import torch

__all__ = ["WRAPPER_PREFIXES", "inference_tensor"]

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
"""Key prefixes a wrapper adds in front of the model's own names: DDP's ``module.`` and
``torch.compile``'s ``_orig_mod.`` (either may be repeated, in any order)."""


def inference_tensor(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` as safetensors stores it: floating point cast to ``dtype`` (None: kept), on the
    CPU, contiguous, and a copy of its own (safetensors refuses tensors that share storage,
    such as tied weights, and a view would save its whole base)."""
    cast = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return cast.detach().cpu().contiguous().clone()
