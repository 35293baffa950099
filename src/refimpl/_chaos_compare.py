"""`refimpl.chaos`'s comparison: two saved files, flattened to dotted keys, bit for bit."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts, lists and tuples as ``{"a.b.0": leaf}``; a bare leaf keys as ``prefix``."""
    if isinstance(obj, Mapping):
        items = [(str(k), v) for k, v in obj.items()]
    elif isinstance(obj, list | tuple):
        items = [(str(i), v) for i, v in enumerate(obj)]
    else:
        return {prefix: obj}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def load_flat(path: str | Path) -> dict[str, Any]:
    """A ``.safetensors`` file, or a torch file loaded with ``weights_only=True``, flattened.

    A missing file raises `OSError`; one that does not load, `ValueError` naming the path.
    """
    try:
        if str(path).endswith(".safetensors"):
            from safetensors.torch import load_file

            return flatten(load_file(str(path)))
        return flatten(torch.load(path, map_location="cpu", weights_only=True))
    except OSError:
        raise
    except Exception as exc:  # safetensors' own error type, pickle's, torch's: all "unreadable"
        raise ValueError(f"{path} does not load: {type(exc).__name__}: {exc}") from exc


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: equal bits means equal, NaN payloads and -0.0 included."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _tensor_difference(key: str, a: torch.Tensor, b: torch.Tensor) -> str | None:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{key}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    if torch.equal(_bits(a), _bits(b)):
        return None
    x, y = a.detach().cpu(), b.detach().cpu()
    if x.dtype == torch.bool:
        x, y = x.to(torch.int8), y.to(torch.int8)
    wide = torch.complex128 if x.is_complex() else torch.float64
    diff = (x.to(wide) - y.to(wide)).abs()
    return f"{key}: max abs diff {diff.max().item():.3g}"


def first_difference(reference: Mapping[str, Any], other: Mapping[str, Any]) -> str | None:
    """None when both hold the same keys with bit-identical tensors and ``==`` other leaves;
    otherwise the first differing key (in the reference's order) and how it differs."""
    for key, ref in reference.items():
        if key not in other:
            return f"{key}: missing (the reference has it)"
        got = other[key]
        if isinstance(ref, torch.Tensor) and isinstance(got, torch.Tensor):
            if (why := _tensor_difference(key, ref, got)) is not None:
                return why
        elif isinstance(ref, torch.Tensor) or isinstance(got, torch.Tensor) or ref != got:
            return f"{key}: {ref!r:.40} vs {got!r:.40}"
    extra = [k for k in other if k not in reference]
    return f"{extra[0]}: not in the reference" if extra else None
