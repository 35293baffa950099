"""Chapter 7's look at PyTorch's own desync tools, run on gloo.

- `detail_recorded_calls`: what the flight recorder sees of two all-reduces under DETAIL.
- `late_rank_under_detail`: under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` every collective first
  runs a monitored barrier centred on rank 0 (``ProcessGroupWrapper``); a late rank shows it.
- `dump_flight_recorder` / `read_flight_recorder`: each rank's flight-recorder buffer
  written where ``torchfrtrace`` reads it, and what ``torchfrtrace`` reports about it.
"""

from __future__ import annotations

import io
import pickle
import time
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = [
    "detail_recorded_calls",
    "dump_flight_recorder",
    "late_rank_under_detail",
    "read_flight_recorder",
]


def late_rank_under_detail(late_s: float) -> str:
    """Worker, run under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: every rank all-reduces once, the
    last rank ``late_s`` seconds after the others. Returns this rank's error (or success)."""
    rank = dist.get_rank()
    if rank == dist.get_world_size() - 1:
        time.sleep(late_s)
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.float64))
    except RuntimeError as exc:
        return f"rank {rank}: {exc}"
    return f"rank {rank}: no error"


def dump_flight_recorder(folder: str) -> Path:
    """Write this rank's flight-recorder buffer to ``folder/rank_<rank>``, as `torchfrtrace`
    reads it. gloo records too: every collective of every group, in a ring buffer of
    ``TORCH_FR_BUFFER_SIZE`` entries (2000 by default). NCCL's watchdog writes this dump by
    itself on a timeout; for gloo we ask for it (``_dump_fr_trace``, a private call). With
    the stack of every call, which takes seconds per dump to symbolize on this machine."""
    raw = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())  # type: ignore[attr-defined]
    # torch 2.13's gloo records its group's ranks before the group has its name: pg_config
    # says "" where the entries say "0" (default_pg), and torchfrtrace matches them by name.
    unnamed = raw["pg_config"].pop("", None)
    for entry in raw["entries"]:
        name, desc = entry["process_group"]
        if unnamed is not None and name not in raw["pg_config"]:
            raw["pg_config"][name] = {**unnamed, "name": name, "desc": desc}
    path = Path(folder) / f"rank_{dist.get_rank()}"
    path.write_bytes(pickle.dumps(raw))
    return path


def read_flight_recorder(folder: str) -> list[str]:
    """What ``torchfrtrace folder`` reports about the dumps in ``folder``, as lines (it runs
    in this process: its log is captured instead of printed)."""
    from torch.distributed.flight_recorder.components.fr_logger import FlightRecorderLogger

    handlers = [h for h in FlightRecorderLogger().logger.handlers if hasattr(h, "setStream")]
    out = io.StringIO()
    saved = [h.setStream(out) for h in handlers]
    try:
        from torch.distributed.flight_recorder import fr_trace

        fr_trace.main([folder])
    finally:
        for handler, stream in zip(handlers, saved, strict=True):
            handler.setStream(stream)
    return out.getvalue().splitlines()


def detail_recorded_calls(calls: int) -> list[str]:
    """Worker, run under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: ``calls`` all-reduces of 2
    float64, then this rank's flight-recorder entries as "op [sizes]", oldest first."""
    for _ in range(calls):
        dist.all_reduce(torch.ones(2, dtype=torch.float64))
    # without stack traces: symbolizing them takes seconds per dump here
    dump = torch._C._distributed_c10d._dump_fr_trace  # type: ignore[attr-defined]
    raw = pickle.loads(dump(includeStackTraces=False))
    return [f"{e['profiling_name']} {e['input_sizes']}" for e in raw["entries"]]
