"""`refimpl.guard`'s carried all-reduce: a small CPU tensor travels inside the fingerprint
exchange, and every rank reduces the copies it received itself, in rank order, with numpy's
element-wise ops: the same arithmetic on every rank, so the same bits."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from refimpl.guard._fingerprint import REDUCE_OPS

__all__ = ["carriable", "reduce_in_rank_order"]

_CODE = {name: code for code, name in REDUCE_OPS.items()}
_OPS: dict[int, Any] = {  # reduce op code: the element-wise op applied rank after rank
    _CODE["SUM"]: np.add,
    _CODE["PRODUCT"]: np.multiply,
    _CODE["MAX"]: np.maximum,
    _CODE["MIN"]: np.minimum,
}
_DTYPES = {
    torch.float16,
    torch.float32,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
}


def carriable(tensor: torch.Tensor, code: int) -> bool:
    """Whether a reduce op (by its fingerprint code) and a tensor's kind can be carried; the
    size and world limits are the guard's."""
    return tensor.is_cpu and code in _OPS and tensor.dtype in _DTYPES


def reduce_in_rank_order(
    copies: list[np.ndarray[Any, Any]],
    values: np.ndarray[Any, Any],
    tensor: torch.Tensor,
    code: int,
) -> None:
    """Reduce ``copies`` (rank r's copy at index r) into ``tensor``, whose numpy view is
    ``values``."""
    combine = _OPS[code]
    out = values.reshape(-1)  # a view of the tensor, unless it is strided
    if len(copies) == 1:
        np.copyto(out, copies[0])
    else:
        combine(copies[0], copies[1], out=out)
    for r in range(2, len(copies)):
        combine(out, copies[r], out=out)
    if not values.flags.c_contiguous:  # reshape may have copied: write the result back
        tensor.copy_(torch.from_numpy(out).view(tensor.shape))
