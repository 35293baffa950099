"""Benchmarks: ``python -m refimpl.bench NAME --out DIR`` (JSON + PNG in DIR).

Each benchmark is a module of this package with a ``main(argv) -> int``. Every benchmark
measures ratios inside one run (the machines are shared and noisy), reports the median of at
least 5 repeats with the spread, and measures the floors (memcpy, raw write + fsync) beside
the methods where they apply.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of repeated timings (seconds)."""
    if not samples:
        raise ValueError("summarize() needs at least one sample")
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": float(len(samples)),
    }


def write_json(out_dir: Path, name: str, data: dict[str, Any]) -> Path:
    """Write ``data`` as ``out_dir/name.json`` (creating the folder) and return the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path
