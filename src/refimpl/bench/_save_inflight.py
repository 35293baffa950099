"""What a save in flight costs the training it overlaps (the saving-overhead benchmark).

A small MLP trains on the benchmark's process while a staged ``dcp.async_save`` of the state
is written in the background by one of five writers (`WRITERS`): DCP's thread checkpointer
as it comes (a write call per tensor record; `AsyncSaver`'s default), the same thread at a
lower CPU priority (``refimpl.sharded._low_priority.LowPriorityWriter``), the thread writing
in 1 MiB pieces without pacing (``refimpl.sharded._paced_writer.PacedWriter`` with
``cpu_share=1``), the same paced to `PACED_SHARE` of a core
(``AsyncSaver(writer_cpu_share=...)``), and DCP's process checkpointer (a daemon with an
interpreter and a GIL of its own). Steps alone and steps during each kind of save are
measured interleaved, the order rotating every round, so load from elsewhere on a shared
machine hits every kind alike.

Beside the step times: the CPU seconds the writing thread spent per save (thread writers),
the training time lost per save (the steps' excess over a step alone, summed), and how long a
pure-Python thread waited for the GIL while each writer worked (Linux ``schedstat``: a thread
is either on a CPU, runnable in the queue, or asleep; a spinning thread sleeps only while
waiting for the GIL).
"""

from __future__ import annotations

import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.storage import WriteResult

from refimpl.bench import summarize
from refimpl.bench._save_files import FileSave
from refimpl.sharded._paced_writer import PacedWriter

__all__ = ["LOW_NICE", "PACED_SHARE", "WRITERS", "gil_wait", "step_times"]

LOW_NICE = 19  # the low-priority row: AsyncSaver(writer_nice=19)
PACED_SHARE = 0.05  # the paced row: AsyncSaver(writer_cpu_share=0.05)
WRITERS = {  # kind: (DCP's process checkpointer?, nice, CPU share: None unpaced, 1 pieces)
    "save": (False, 0, None),  # AsyncSaver's default: a tensor record per write call
    "low_save": (False, LOW_NICE, None),
    "piece_save": (False, 0, 1.0),  # 1 MiB pieces, no sleeps
    "paced_save": (False, 0, PACED_SHARE),
    "process_save": (True, 0, None),
}


class _MeteredWriter(PacedWriter):
    """Appends the CPU seconds of the thread that planned and wrote to ``sink`` (thread
    writers only: a writer sent to DCP's daemon is a copy, its numbers stay there)."""

    def __init__(self, path: Path, kind: str, sink: list[float] | None) -> None:
        _, nice, share = WRITERS[kind]
        super().__init__(path, nice=nice, cpu_share=share)
        self._sink = sink
        self._cpu0 = 0.0

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._cpu0 = time.thread_time()
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        if self._sink is not None:
            self._sink.append(time.thread_time() - self._cpu0)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_sink": None}


def start_save(
    state: dict[str, torch.Tensor],
    path: Path,
    stager: Any,
    kind: str,
    cpu_sink: list[float] | None = None,
) -> Any:
    """Start a staged ``dcp.async_save`` of ``state`` with writer ``kind``; return its future."""
    process = WRITERS[kind][0]
    return dcp_async_save(
        {"model": state},
        storage_writer=_MeteredWriter(path, kind, None if process else cpu_sink),
        no_dist=True,
        async_stager=stager,
        async_checkpointer_type=(
            AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        ),
    )


def _clean(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def step_times(
    state: dict[str, torch.Tensor],
    scratch: Path,
    stagers: dict[str, Any],
    rounds: int = 3,
    width: int = 1024,
    file_savers: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Seconds per training step (median, min, max) alone and during each kind of save
    (``step_s_median_during_<kind>``), steps counted only while a save is in flight; per
    kind also the steps counted, the training seconds lost per save and the save's duration
    (medians), and for thread writers the writing thread's CPU seconds per save.
    ``file_savers`` adds kinds saved by an `AsyncCheckpointer` each (`refimpl.checkpoint`:
    the state as one key of a file checkpoint)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, width)

    def step() -> float:
        start = time.perf_counter()
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    for _ in range(3):
        step()  # warm-up
    files = file_savers or {}
    kinds = list(WRITERS) + list(files)
    alone: list[float] = []
    during: dict[str, list[float]] = {k: [] for k in kinds}
    lost: dict[str, list[float]] = {k: [] for k in kinds}
    took: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            before = [step() for _ in range(6)]
            alone += before
            path = scratch / f"inflight_{kind}_{r}"
            start = time.perf_counter()
            if kind in files:
                future: Any = FileSave(files[kind], {"model": state}, r + 1)
                path = future.path
            else:
                future = start_save(state, path, stagers[kind], kind, cpu[kind])
            steps = []
            while not future.done():
                steps.append(step())
            future.result()
            took[kind].append(time.perf_counter() - start)
            during[kind] += steps
            lost[kind].append(sum(steps) - len(steps) * statistics.median(before))
            _clean(path)
    out: dict[str, float] = {}
    for name, samples in {"alone": alone, **{f"during_{k}": during[k] for k in kinds}}.items():
        summary = summarize(samples or [float("nan")])
        for stat in ("median", "min", "max"):
            out[f"step_s_{stat}_{name}"] = summary[stat]
    for kind in kinds:
        out[f"steps_during_{kind}"] = float(len(during[kind]))
        out[f"lost_s_median_{kind}"] = statistics.median(lost[kind])
        out[f"save_s_median_{kind}"] = statistics.median(took[kind])
        if cpu[kind]:
            out[f"writer_cpu_s_median_{kind}"] = statistics.median(cpu[kind])
    return out


def _schedstat() -> tuple[float, float] | None:
    """This thread's (seconds on a CPU, seconds runnable in the queue), or None off Linux."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            on_cpu, queued, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return int(on_cpu) / 1e9, int(queued) / 1e9


def gil_wait(
    state: dict[str, torch.Tensor], scratch: Path, stagers: dict[str, Any], rounds: int = 3
) -> dict[str, float]:
    """Per writer kind, the fraction of the save during which a thread running pure Python
    (this one) waited for the GIL (median over ``rounds``); empty off Linux."""
    if _schedstat() is None:
        return {}
    out: dict[str, float] = {}
    for kind in WRITERS:
        fractions = []
        for r in range(rounds):
            path = scratch / f"gil_{kind}_{r}"
            s0, w0 = _schedstat(), time.perf_counter()
            future = start_save(state, path, stagers[kind], kind)
            while not future.done():
                for _ in range(200):
                    pass
            wall, s1 = time.perf_counter() - w0, _schedstat()
            future.result()
            _clean(path)
            assert s0 is not None and s1 is not None
            asleep = wall - (s1[0] - s0[0]) - (s1[1] - s0[1])
            fractions.append(max(asleep, 0.0) / wall)
        out[f"gil_wait_fraction_{kind}"] = statistics.median(fractions)
    return out
