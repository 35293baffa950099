"""Chapter 4's demos: the rank-0-save incident on gloo, its fixes, and per-rank timelines.

The ``*_worker`` functions run under `refimpl.launch.spawn`; each rank records what it did in
a `Timeline` (one JSON line per phase, flushed as it ends), which survives the job failing,
so the notebook can draw what every rank was doing when the job died. The hang toolbox of
the same chapter (how long a peer waits, looking inside a hung rank) is `refimpl.demos.hangs`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from refimpl.sync import barrier_safe, main_process_first

__all__ = [
    "Timeline",
    "barrier_cost_worker",
    "late_barrier_worker",
    "main_process_first_worker",
    "plot_timeline",
    "read_timeline",
    "short_error",
    "straggler_worker",
    "train_and_save_worker",
]


class Timeline:
    """Per-rank spans (phase, start, end) appended to ``log_dir/rankN.jsonl``.

    A line is written and flushed when a span begins and another when it ends, so the
    timeline of a job that failed, or whose ranks the launcher SIGKILLed mid-span, can
    still be read (`read_timeline`) and drawn (`plot_timeline`).
    """

    def __init__(self, log_dir: str | os.PathLike[str], rank: int | None = None) -> None:
        self.rank = dist.get_rank() if rank is None else rank
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self._file = open(Path(log_dir) / f"rank{self.rank}.jsonl", "a", buffering=1)  # noqa: SIM115

    @contextlib.contextmanager
    def span(self, phase: str) -> Iterator[None]:
        """Record the block as ``phase``; a block that raises is recorded with its error."""
        rec: dict[str, Any] = {"rank": self.rank, "phase": phase, "start": time.monotonic()}
        self._file.write(json.dumps(rec) + "\n")  # begin: survives a SIGKILL mid-span
        error = ""
        try:
            yield
        except BaseException as exc:
            error = type(exc).__name__
            raise
        finally:
            self._file.write(json.dumps({**rec, "end": time.monotonic(), "error": error}) + "\n")


def read_timeline(log_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All spans of all ranks, times in seconds from the first start, sorted by rank.

    A span that began but never ended (its rank was killed) ends at the last time any
    rank recorded, with ``error="killed"``.
    """
    records = [
        json.loads(line)
        for path in sorted(Path(log_dir).glob("rank*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    ended = {(r["rank"], r["start"]): r for r in records if "end" in r}
    last = max((r.get("end", r["start"]) for r in records), default=0.0)
    spans = [
        ended.get((r["rank"], r["start"]), {**r, "end": last, "error": "killed"})
        for r in records
        if "end" not in r
    ]
    t0 = min((s["start"] for s in spans), default=0.0)
    for s in spans:
        s["start"], s["end"] = s["start"] - t0, s["end"] - t0
    return sorted(spans, key=lambda s: (s["rank"], s["start"]))


_COLORS = {"train step": "tab:blue", "save": "tab:orange", "barrier": "tab:green"}


def plot_timeline(spans: list[dict[str, Any]], title: str, ax: Any = None) -> Any:
    """Draw one row per rank, one bar per span; spans that raised or were killed are hatched."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:  # with the legend about 8 in: the book column, labels stay 10 pt
        _, ax = plt.subplots(figsize=(7, 2.6))
    ranks = sorted({s["rank"] for s in spans})
    for s in spans:
        ax.barh(
            s["rank"],
            s["end"] - s["start"],
            left=s["start"],
            height=0.6,
            color=_COLORS.get(s["phase"], "tab:gray"),
            edgecolor="black",
            hatch="//" if s["error"] else None,
        )
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    handles = [Patch(color=c, label=p) for p, c in _COLORS.items()]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="raised / killed"))
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9)
    return ax


def _line_up() -> None:
    """Start-up: wait for every rank under a generous timeout, so that a process that starts
    late on a loaded machine is not mistaken for the failure a demo is about to show."""
    barrier_safe(timeout_s=60.0)


def short_error(exc: BaseException | None) -> str:
    """The first line of an error without the source-location prefix gloo puts in front.

    gloo starts its messages with ``[/path/file.cc:78]``; that prefix is dropped.

    gloo says "send" or "recv" depending on which half of an exchange timed out first, a
    race; both become "send/recv" so that printed errors are reproducible. A peer's
    address (``[127.0.0.1]:29500``) is dropped too: the port changes every run.
    """
    text = str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else ""
    text = text.split("] ", 1)[1] if text.startswith("[/") and "] " in text else text
    text = re.sub(r" ?\[[0-9a-fA-F.:]+\]:\d+", "", text)
    return re.sub(r"\b(send|recv) operation", "send/recv operation", text)


def _slow_save(path: Path, model: torch.nn.Module, save_s: float) -> None:
    """A real atomic save, padded with sleep to ``save_s`` (a big model on slow storage)."""
    from refimpl.atomic import atomic_save

    start = time.monotonic()
    atomic_save(model.state_dict(), path)
    time.sleep(max(0.0, save_s - (time.monotonic() - start)))


def train_and_save_worker(
    log_dir: str, barrier: str, save_s: float, steps: int = 3, save_timeout_s: float = 30.0
) -> dict[str, float]:
    """Worker: DDP steps; rank 0 saves after step 0. ``barrier`` says what the ranks do then.

    ``"none"`` (the incident: others run into step 1's all-reduce), ``"plain"`` (the
    first repair: ``dist.barrier()`` after the save, under the group's timeout),
    ``"timeout"`` (``dist.barrier(timeout=save_timeout_s)``), ``"safe"`` (`barrier_safe`
    with ``save_timeout_s``) or ``"misplaced"`` (a monitored barrier inside
    ``if rank == 0``: only rank 0 calls it). Returns seconds spent per phase.
    """
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights on every rank, so DDP's start-up sync is skipped:
    # its first construction in a process also runs slow lazy imports, and under a loaded
    # machine a rank still importing would fail the others' short-timeout sync. Line up after.
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64), init_sync=False)
    _line_up()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if barrier in ("safe", "misplaced"):
        barrier_safe(timeout_s=save_timeout_s)  # start-up: creates the save-barrier group
    tl = Timeline(log_dir)
    spent = {"train step": 0.0, "save": 0.0, "barrier": 0.0}
    for step in range(steps):
        start = time.monotonic()
        with tl.span("train step"):
            time.sleep(0.2)  # stands in for forward + backward compute
            model(torch.ones(8, 64)).square().mean().backward()  # all-reduce in backward
            opt.step()
            opt.zero_grad()
        spent["train step"] += time.monotonic() - start
        if step != 0:
            continue
        start = time.monotonic()
        if rank == 0:
            with tl.span("save"):
                _slow_save(Path(log_dir) / "model.pt", model.module, save_s)
            spent["save"] = time.monotonic() - start
            if barrier == "misplaced":
                with tl.span("barrier"):
                    barrier_safe(timeout_s=save_timeout_s, monitored=True)
        start = time.monotonic()
        if barrier in ("plain", "timeout", "safe"):
            with tl.span("barrier"):
                if barrier == "plain":
                    dist.barrier()  # the group's timeout: the one sized for training steps
                elif barrier == "timeout":
                    dist.barrier(timeout=datetime.timedelta(seconds=save_timeout_s))
                else:
                    barrier_safe(timeout_s=save_timeout_s)
        spent["barrier"] = time.monotonic() - start
    return spent


def straggler_worker(late_rank: int, late_s: float, timeout_s: float) -> int:
    """Worker: every rank calls a monitored `barrier_safe`; ``late_rank`` arrives late."""
    _line_up()
    barrier_safe(timeout_s=timeout_s)  # start-up: everyone on time, creates the group
    if dist.get_rank() == late_rank:
        time.sleep(late_s)
    barrier_safe(timeout_s=timeout_s, monitored=True)
    return dist.get_rank()


def main_process_first_worker(directory: str, ordered: bool, fail: bool = False) -> str:
    """Worker: rank 0 writes a file (slowly) that every rank then reads.

    ``ordered=False`` has no ordering (other ranks may read before it exists);
    ``ordered=True`` uses `main_process_first`; ``fail=True`` makes rank 0 raise inside it.
    Returns the bytes each rank read, decoded.
    """
    from refimpl.atomic import atomic_write_bytes

    path = Path(directory) / "vocab.txt"

    def prepare() -> None:
        time.sleep(0.5)  # tokenising a corpus, downloading weights, ...
        if fail:
            raise OSError(28, "No space left on device (simulated) while writing vocab.txt")
        atomic_write_bytes(b"vocab v1", path)

    if not ordered:
        if dist.get_rank() == 0:
            prepare()
        return path.read_text()
    with main_process_first(timeout_s=30) as is_main:
        if is_main:
            prepare()
        return path.read_text()


def barrier_cost_worker(
    directory: str, sizes_mb: list[int], repeats: int = 3
) -> list[tuple[float, float]]:
    """Worker: rank 0 atomically saves ``sizes_mb`` tensors; everyone then `barrier_safe`.

    Returns, per size, the medians of ``(save seconds, seconds until the barrier let this
    rank go)``, both measured from the same start; the save is 0 on ranks other than 0.
    """
    from refimpl.atomic import atomic_save

    results = []
    for mb in sizes_mb:
        tensor = torch.ones(mb * (1 << 18))  # mb MiB of float32
        saves, totals = [], []
        for i in range(repeats):
            barrier_safe()  # line the ranks up, so every clock starts together
            start = time.monotonic()
            if dist.get_rank() == 0:
                atomic_save({"w": tensor}, Path(directory) / f"w{mb}_{i}.pt")
            saves.append(time.monotonic() - start if dist.get_rank() == 0 else 0.0)
            barrier_safe(timeout_s=120)
            totals.append(time.monotonic() - start)
            if dist.get_rank() == 0:
                (Path(directory) / f"w{mb}_{i}.pt").unlink()  # hundreds of MiB otherwise
        results.append((sorted(saves)[repeats // 2], sorted(totals)[repeats // 2]))
    return results


def late_barrier_worker(
    late_rank: int, late_s: float, timeout_s: float | None
) -> tuple[str, float]:
    """Worker: ``late_rank`` reaches ``dist.barrier`` ``late_s`` seconds after the others.

    ``timeout_s`` is the barrier's own ``timeout=`` (None: the group's). Returns this rank's
    ``("passed" or the error, seconds it waited in the barrier)``.
    """
    _line_up()
    if dist.get_rank() == late_rank:
        time.sleep(late_s)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    start = time.monotonic()
    try:
        dist.barrier(timeout=timeout)
    except RuntimeError as exc:  # DistBackendError is a RuntimeError
        return short_error(exc), time.monotonic() - start
    return "passed", time.monotonic() - start
