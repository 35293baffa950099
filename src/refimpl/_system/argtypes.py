"""argparse ``type=`` functions that refuse a bad value when the command line is parsed.

A value the trainer cannot use must stop it before anything starts: ``--keep-last 0`` used to
train until the first save and then fail on every rank (and again on every torchrun restart),
and ``--pg-timeout 0`` reached the TCPStore as a raw C++ "timed out after 0ms". argparse turns
the ``ArgumentTypeError`` these raise into ``argument --flag: <message>`` and exit status 2.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["float_range", "int_range", "nonempty"]


def int_range(low: int, high: int | None = None) -> Callable[[str], int]:
    """A parser of integers in ``[low, high]`` (no upper bound when ``high`` is None)."""
    bounds = f">= {low}" if high is None else f"from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {value}")
        return value

    return parse


def float_range(
    low: float, high: float = math.inf, *, low_open: bool = False
) -> Callable[[str], float]:
    """A parser of finite numbers in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    lower = f"> {low:g}" if low_open else f">= {low:g}"
    bounds = lower if math.isinf(high) else f"{lower} and <= {high:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {bounds}, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or value > high:
            raise argparse.ArgumentTypeError(f"must be a finite number {bounds}, got {text}")
        return value

    return parse


def nonempty(text: str) -> str:
    """A path or name that is not the empty string (``--ckpt-dir ''`` would mean the cwd)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text
