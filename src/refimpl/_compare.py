"""Two saved results, flattened to dotted keys, compared bit for bit (`refimpl.chaos`'s
``--compare``, and the porting demos' count of differing tensors).

A result is a ``torch.save`` file (loaded weights-only), a ``.safetensors`` file, or a DCP
checkpoint directory (read with ``torch.distributed.checkpoint``, no process group). It is
flattened to ``{"model.0.weight": leaf}``; each container also gets an entry of its own (a
`Node`: its type and its keys, typed), so ``{"a": {"b": x}}`` and ``{"a.b": x}``, a list and a
dict, or the keys ``1`` and ``"1"`` differ. Two keys of one result that flatten to the same
dotted name are refused. Leaves compare by type and bits: tensors by dtype, shape and bytes;
floats by their IEEE bits (``nan`` equals ``nan``, ``0.0`` is not ``-0.0``); ``1`` is not
``True``.
"""

from __future__ import annotations

import re
import struct
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Node:
    """A container in a flattened result: its type and its keys (each a ``(repr, dotted
    key)`` pair, sorted), so that structure is compared as well as the leaves."""

    kind: str
    children: tuple[tuple[str, str], ...]

    def keys_seen(self, ignore: re.Pattern[str] | None) -> tuple[str, ...]:
        """The keys' reprs, without those whose dotted key ``ignore`` matches."""
        return tuple(r for r, full in self.children if not _ignored(full, ignore))


def _ignored(key: str, ignore: re.Pattern[str] | None) -> bool:
    """Whether ``ignore`` matches ``key`` whole, or one of its parents (``a`` covers ``a.b``)."""
    if ignore is None or not key:
        return False
    parts = key.split(".")
    return any(ignore.fullmatch(".".join(parts[:i])) for i in range(1, len(parts) + 1))


def flatten(obj: Any) -> dict[str, Any]:
    """Nested mappings, lists and tuples as ``{"a.b.0": leaf}`` plus one `Node` per container
    (the top one under ``""``). Raises `ValueError` naming the key when two entries flatten
    to the same dotted key (``{"a.b": 1, "a": {"b": 2}}``, or the keys ``1`` and ``"1"``)."""
    out: dict[str, Any] = {}

    def put(key: str, value: Any) -> None:
        if key in out:
            raise ValueError(
                f"two entries flatten to the key {key!r} (a dotted key beside a nested one, "
                "or keys like 1 and '1'): the comparison could not tell them apart"
            )
        out[key] = value

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, Mapping):
            items = [(repr(k), str(k), v) for k, v in value.items()]
        elif isinstance(value, list | tuple):
            items = [(str(i), str(i), v) for i, v in enumerate(value)]
        else:
            put(prefix, value)
            return
        full = [(r, f"{prefix}.{name}" if prefix else name, v) for r, name, v in items]
        put(prefix, Node(type(value).__name__, tuple(sorted((r, f) for r, f, _ in full))))
        for _, key, child in full:
            walk(child, key)

    walk(obj, "")
    return out


def load_flat(path: str | Path) -> dict[str, Any]:
    """A ``.safetensors`` file, a torch file loaded with ``weights_only=True``, or a DCP
    checkpoint directory (one holding a ``.metadata``), flattened.

    A missing path raises `OSError`; one that does not load, `ValueError` naming the path.
    """
    path = Path(path)
    try:
        if path.is_dir():
            if not (path / ".metadata").is_file():
                raise ValueError(f"{path} is a directory without a DCP .metadata file")
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            with tempfile.TemporaryDirectory(prefix="chaos-dcp-") as tmp:
                dcp_to_torch_save(path, Path(tmp) / "whole.pt")
                return flatten(torch.load(Path(tmp) / "whole.pt", weights_only=True))
        if path.name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return flatten(load_file(str(path)))
        return flatten(torch.load(path, map_location="cpu", weights_only=True))
    except OSError:
        raise
    except ValueError as exc:
        if str(path) in str(exc):
            raise
        raise ValueError(f"{path} does not load: ValueError: {exc}") from exc
    except Exception as exc:  # safetensors' own error type, pickle's, torch's: all "unreadable"
        raise ValueError(f"{path} does not load: {type(exc).__name__}: {exc}") from exc


def summary(flat: Mapping[str, Any], ignore: re.Pattern[str] | None = None) -> str:
    """What a comparison of ``flat`` covers: tensors, their bytes, other values, ignored."""
    kept = {k: v for k, v in flat.items() if not _ignored(k, ignore)}
    tensors = [v for v in kept.values() if isinstance(v, torch.Tensor)]
    size = sum(t.numel() * t.element_size() for t in tensors)
    others = sum(not isinstance(v, torch.Tensor | Node) for v in kept.values())
    skipped = sum(not isinstance(v, Node) for k, v in flat.items() if k not in kept)
    return f"{len(tensors)} tensors ({size} bytes) and {others} other values" + (
        f", {skipped} ignored" if ignore is not None else ""
    )


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


def _same_leaf(a: Any, b: Any) -> bool:
    """Same type and same bits (floats and complex numbers by their IEEE bits)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, complex):
        return struct.pack("<dd", a.real, a.imag) == struct.pack("<dd", b.real, b.imag)
    return bool(a == b)


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.40}"


def first_difference(
    reference: Mapping[str, Any], other: Mapping[str, Any], ignore: re.Pattern[str] | None = None
) -> str | None:
    """None when both hold the same keys and structure, bit-identical tensors and leaves of
    the same type and bits; otherwise the first differing key (in the reference's order) and
    how it differs. Keys that ``ignore`` matches whole (or under a matched parent) are
    skipped."""
    for key, ref in reference.items():
        if _ignored(key, ignore):
            continue
        if key not in other:
            return f"{key}: missing (the reference has it)"
        got = other[key]
        if isinstance(ref, torch.Tensor) and isinstance(got, torch.Tensor):
            if (why := _tensor_difference(key, ref, got)) is not None:
                return why
        elif isinstance(ref, Node) and isinstance(got, Node):
            mine, theirs = ref.keys_seen(ignore), got.keys_seen(ignore)
            if ref.kind != got.kind or mine != theirs:
                where = key or "(top level)"
                only = sorted(set(mine) ^ set(theirs))
                keys = f"; keys in one only: {', '.join(only)[:80]}" if only else ""
                return f"{where}: {ref.kind} of {len(mine)} vs {got.kind} of {len(theirs)}{keys}"
        elif isinstance(ref, torch.Tensor | Node) or isinstance(got, torch.Tensor | Node):
            return f"{key or '(top level)'}: {_show(ref)} vs {_show(got)}"
        elif not _same_leaf(ref, got):
            return f"{key}: {_show(ref)} vs {_show(got)}"
    extra = [k for k in other if k not in reference and not _ignored(k, ignore)]
    return f"{extra[0]}: not in the reference" if extra else None


def tensor_distance(
    reference: Mapping[str, Any], other: Mapping[str, Any], ignore: re.Pattern[str] | None = None
) -> str:
    """How far ``other``'s tensors are from the reference's, for results not expected to be
    bit-identical: how many differ, and the largest absolute difference among them."""
    keys = [
        k for k, v in reference.items() if isinstance(v, torch.Tensor) and not _ignored(k, ignore)
    ]
    worst, differ, absent = 0.0, 0, 0
    for key in keys:
        a, b = reference[key], other.get(key)
        if not isinstance(b, torch.Tensor) or a.shape != b.shape:
            absent += 1
            continue
        if _tensor_difference(key, a, b) is not None:
            differ += 1
            diff = (a.detach().cpu().double() - b.detach().cpu().double()).abs()
            worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    lost = f", {absent} missing or reshaped" if absent else ""
    return f"{differ} of {len(keys)} tensors differ, max abs diff {worst:.3g}{lost}"
