"""Chapter 9: what ``dcp.async_save`` returns, and what it does to a checkpoint when the
caller does not wait for the right thing.

Each function runs in the calling process (no process group: ``no_dist=True``) on a tiny
model, and returns what the chapter prints. Where the outcome of a race is the point, the race
is decided by an event, not by timing: `GatedStager` copies the model, then waits before it
copies the optimizer (a device-to-host copy still running on a side stream, held still), and
`GatedWriter` waits before it writes (a write still in flight). So the printed outcome is the
same on every run and every machine.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

__all__ = [
    "NO_CPU_BACKEND_NOISE",
    "GatedStager",
    "GatedWriter",
    "overwritten_in_flight",
    "return_types",
    "torn_by_an_early_step",
    "without_a_cpu_backend",
]

CPU_OPTIONS = {"use_pinned_memory": False, "use_shared_memory": False}  # no CUDA here


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, opt)  # Adam's moments exist from here on
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(2, 4)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _read_back(path: Path, like: dict[str, Any]) -> dict[str, Any]:
    back = copy.deepcopy(like)
    dcp_load(back, storage_reader=FileSystemReader(path), no_dist=True)
    return back


def return_types(workdir: str | Path) -> dict[str, str]:
    """What ``dcp.async_save`` returns with a synchronous and with an asynchronous stager,
    and whether each checkpoint holds the state at the call (the caller waited as told)."""
    out: dict[str, str] = {}
    for name, async_staging in (("sync staging", False), ("async staging", True)):
        model, opt = _model_and_optimizer()
        at_call = _snapshot(model, opt)
        stager = DefaultStager(
            StagingOptions(
                **CPU_OPTIONS, use_async_staging=async_staging, use_non_blocking_copy=False
            )
        )
        path = Path(workdir) / name.replace(" ", "_")
        try:
            result = async_save(
                {"model": model.state_dict(), "optim": opt.state_dict()},
                checkpoint_id=path,
                no_dist=True,
                async_stager=stager,
            )
            if isinstance(result, Future):
                result.result()
            else:  # AsyncSaveResponse
                result.staging_completion.result()
                result.upload_completion.result()
        finally:
            stager.close()
        out[name] = type(result).__name__
        out[f"{name}: state at the call"] = str(_equal(_read_back(path, at_call), at_call))
    return out


class GatedStager(AsyncStager):
    """An asynchronous stager that copies ``state_dict["model"]`` at once, then waits for
    `release` before it copies the rest: a staging copy caught half-way, on purpose."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.model_copied = threading.Event()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gated-stager")

    def _copy(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        staged = {"model": copy.deepcopy(state_dict["model"])}
        self.model_copied.set()
        if not self.gate.wait(timeout=30):
            raise TimeoutError("GatedStager was never released")
        staged.update({k: copy.deepcopy(v) for k, v in state_dict.items() if k != "model"})
        return staged

    def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]]:
        """Start the copy in a thread; the future completes when all of it is copied."""
        return self._pool.submit(self._copy, state_dict)

    def release(self) -> None:
        """Let the copy of the rest of the state go on."""
        self.gate.set()

    def synchronize_staging(self) -> None:
        """Unused: DCP waits on the future `stage` returns (``staging_completion``)."""
        return None

    def close(self) -> None:
        """Release the copy (if still held) and stop the thread."""
        self.gate.set()
        self._pool.shutdown(wait=True)


def torn_by_an_early_step(workdir: str | Path, wait_for_staging: bool) -> dict[str, bool]:
    """Save with asynchronous staging, take an optimizer step, read the checkpoint back.

    With ``wait_for_staging`` the step waits for ``staging_completion`` (what torchtitan's
    ``maybe_wait_for_staging()`` does before ``optimizers.step()``); without it, the step runs
    while the copy is half done. Returns, per part, whether the checkpoint holds the state at
    the call."""
    model, opt = _model_and_optimizer()
    at_call = _snapshot(model, opt)
    stager = GatedStager()
    path = Path(workdir) / f"torn_{wait_for_staging}"
    try:
        response: Any = async_save(
            {"model": model.state_dict(), "optim": opt.state_dict()},
            checkpoint_id=path,
            no_dist=True,
            async_stager=stager,
        )
        stager.model_copied.wait(timeout=30)  # the copy is under way: the model is staged
        if wait_for_staging:
            stager.release()  # the copy finishes on its own; the trainer waits for it
            response.staging_completion.result()
            _step(model, opt)
        else:
            _step(model, opt)  # too early: the optimizer state is not staged yet
            stager.release()
        response.upload_completion.result()
    finally:
        stager.close()
    back = _read_back(path, at_call)
    return {part: _equal(back[part], at_call[part]) for part in ("model", "optim")}


class GatedWriter(FileSystemWriter):
    """A ``FileSystemWriter`` that waits for ``gate`` before it writes: a save in flight."""

    def __init__(self, path: str | Path, gate: threading.Event) -> None:
        super().__init__(path)
        self.gate = gate

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        """Write once the gate opens (30 s at most)."""
        if not self.gate.wait(timeout=30):
            raise TimeoutError("GatedWriter was never released")
        return super().write_data(plan, planner)


def overwritten_in_flight(workdir: str | Path, wait_first: bool) -> dict[str, float]:
    """Two ``dcp.async_save`` calls sharing one ``DefaultStager`` (which reuses its buffers);
    the first save's write is still held when the second call stages. Without waiting for the
    first future in between, the first checkpoint is written from buffers the second call has
    already refilled. Returns the value each checkpoint holds (the weights were 1.0 at the
    first call and 2.0 at the second)."""
    stager = DefaultStager(
        StagingOptions(**CPU_OPTIONS, use_async_staging=False, use_non_blocking_copy=False)
    )
    weight = torch.full((1000,), 1.0)
    gate = threading.Event()
    first_path, second_path = Path(workdir) / "first", Path(workdir) / "second"
    try:
        first: Any = async_save(
            {"w": weight},
            storage_writer=GatedWriter(first_path, gate),
            no_dist=True,
            async_stager=stager,
        )
        if wait_first:
            gate.set()
            first.result()
        weight.fill_(2.0)  # training moved on
        second: Any = async_save(
            {"w": weight}, checkpoint_id=second_path, no_dist=True, async_stager=stager
        )
        gate.set()
        first.result()
        second.result()
    finally:
        gate.set()
        stager.close()
    values = {}
    for name, path in (("first", first_path), ("second", second_path)):
        back = {"w": torch.empty(1000)}
        dcp_load(back, checkpoint_id=path, no_dist=True)
        same = bool(torch.all(back["w"] == back["w"][0]))
        values[name] = float(back["w"][0]) if same else -1.0
    return values


@contextlib.contextmanager
def _native_stderr_captured() -> Iterator[list[str]]:
    """File descriptor 2 (where torch's C++ warnings go) into a list of lines, for a while."""
    sys.stderr.flush()
    saved = os.dup(2)
    lines: list[str] = []
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines += tmp.read().decode(errors="replace").splitlines()


NO_CPU_BACKEND_NOISE = "No backend of type 0 found for Process Group"
"""The line torch's C++ side prints when a group without a CPU backend is destroyed
(`without_a_cpu_backend` drops it)."""


def without_a_cpu_backend() -> str:
    """``dcp.async_save`` in a one-rank group that has a backend for ``cuda`` devices only
    (gloo registered for ``cuda``, as an NCCL-only job has): the error DCP raises.

    Destroying that group makes torch's C++ side warn that the group has no CPU backend
    ("No backend of type 0 found", with a timestamp); that one line is dropped, anything else
    on the native stderr is passed on."""
    if dist.is_initialized():
        raise RuntimeError("without_a_cpu_backend makes its own process group; none may exist")
    with tempfile.TemporaryDirectory(prefix="ch9-nocpu-") as tmp:
        dist.init_process_group(
            "cuda:gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1
        )
        try:
            async_save({"w": torch.zeros(3)}, checkpoint_id=Path(tmp) / "ckpt")
        except AssertionError as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            with _native_stderr_captured() as lines:
                dist.destroy_process_group()
            for line in lines:
                if NO_CPU_BACKEND_NOISE not in line:
                    print(line, file=sys.stderr)
    return "no error"
