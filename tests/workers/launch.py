"""Worker functions for the launcher tests. They live in a module (not in the test file's
closures) because worker processes import them by name."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist


def rank_and_sum() -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def no_collective() -> int:
    """A worker that returns at once and never talks to its peers."""
    return dist.get_rank()


def env_view() -> dict[str, str]:
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "FROM_PARENT")
    return {k: os.environ.get(k, "") for k in keys}


def fail_on(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom on rank {bad_rank}")
    # The healthy ranks wait in a collective that the bad rank never joins.
    dist.barrier()
    return dist.get_rank()


def record_pid_then(pid_dir: str, action: str) -> None:
    """Write our pid (and a grandchild's) to pid_dir, then hang, crash or get killed."""
    child = subprocess.Popen(["sleep", "600"])
    tmp = Path(pid_dir, f".rank{dist.get_rank()}.tmp")
    tmp.write_text(f"{os.getpid()} {child.pid}")
    tmp.rename(tmp.with_name(f"rank{dist.get_rank()}.pid"))  # whole or absent for readers
    if action == "hang":
        time.sleep(600)
    elif action == "sigkill_rank1" and dist.get_rank() == 1:
        time.sleep(0.2)
        os.kill(os.getpid(), 9)
    elif action == "raise_rank0" and dist.get_rank() == 0:
        # Give up only once every rank has recorded its pids: on a loaded machine rank 1 could
        # otherwise be killed before it wrote them, and the test would count 2 of 4.
        deadline = time.monotonic() + 20
        while len(list(Path(pid_dir).glob("rank*.pid"))) < dist.get_world_size():
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        raise RuntimeError("rank 0 gives up")
    time.sleep(600)


def skip_collective_on(rank_that_skips: int) -> float:
    """One rank skips an all_reduce: with a short group timeout the others error out."""
    t = torch.ones(1)
    if dist.get_rank() != rank_that_skips:
        dist.all_reduce(t)
    else:
        time.sleep(600)
    return t.item()


class Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # two required args: pickling drops them
        super().__init__(f"{a}+{b}")


def raise_unpicklable() -> None:
    raise Unpicklable(1, 2)


def big_result(n: int) -> torch.Tensor:
    return torch.full((n,), float(dist.get_rank()))


def print_then_maybe_fail(fail: bool) -> int:
    print(f"hello from rank {dist.get_rank()}", flush=True)
    if fail and dist.get_rank() == 1:
        raise RuntimeError("after printing")
    return dist.get_rank()


def real_cause_on_rank1_wrapped_collateral_on_rank0() -> None:
    """Rank 1 fails; rank 0's all_reduce then fails and rank 0 wraps that error in its own."""
    if dist.get_rank() == 1:
        time.sleep(0.5)
        raise ValueError("the real cause, on rank 1")
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as exc:
        raise RuntimeError("rank 0: all-reduce did not complete") from exc


def symptom_on_rank1_then_the_cause_on_rank0_late(delay_s: float) -> None:
    """Rank 1 raises a symptom at once (a `DistError`, as `MainProcessFailed` is); rank 0,
    the cause, reports ``delay_s`` later (still unwinding, or slow on a loaded machine)."""
    if dist.get_rank() == 1:
        raise dist.DistError("rank 1: rank 0 failed first; its error is the cause")
    time.sleep(delay_s)
    raise ValueError("the real cause, on rank 0, reported late")


def die_while_reporting(n_mb: int) -> bytes:
    """Rank 1 returns a large result and is SIGKILLed while it is being sent back."""
    import signal
    import threading

    if dist.get_rank() == 1:

        def kill_soon() -> None:
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)

        payload = b"x" * (n_mb << 20)
        threading.Thread(target=kill_soon, daemon=True).start()
        return payload
    return b"ok"


def print_no_flush(fail: bool) -> int:
    """Prints the way user code does: no flush=True."""
    print(f"hello from rank {dist.get_rank()}")
    if fail and dist.get_rank() == 1:
        raise RuntimeError("after printing")
    return dist.get_rank()


def dataloader_workers_in_a_rank() -> int:
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4, num_workers=2)
    return int(sum(int(batch.sum()) for batch in loader))


def killed_by_realtime_signal() -> None:
    import signal

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGRTMIN + 1)
        time.sleep(5)


def return_unpicklable() -> object:
    return lambda: None


def raise_exception_parent_cannot_import() -> None:
    import sys
    import types

    module = types.ModuleType("only_in_the_rank")
    exc_type = type("GhostError", (Exception,), {"__module__": "only_in_the_rank"})
    module.GhostError = exc_type  # type: ignore[attr-defined]
    sys.modules["only_in_the_rank"] = module
    raise exc_type("a class the launcher cannot import")


def start_escaping_grandchild_then_fail(pid_dir: str) -> None:
    """Start a process in a session of its own (it leaves the rank's process group)."""
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    Path(pid_dir, f"rank{dist.get_rank()}.pid").write_text(str(child.pid))
    dist.barrier()
    raise RuntimeError("fail after starting a new-session grandchild")


def scaled_rank(scale: int, *, offset: int = 0) -> int:
    return dist.get_rank() * scale + offset


def resave_forever(ckpt_dir: str, started: str) -> None:
    """Re-save step 3 (a new 8 MB state) back to back until killed; touch ``started`` first."""
    from refimpl.checkpoint import save_checkpoint
    from refimpl.demos.faults import make_state

    Path(started).touch()
    while True:
        save_checkpoint(ckpt_dir, make_state(4, 1 << 21), 3)


def restarted_attempt(env: dict[str, str], delay_s: float, result: str) -> None:
    """One worker of a torchrun attempt (the env torchrun gives it): init_from_env, one
    all-reduce, the sum (or the error) written to ``result``, then ``os._exit`` without
    tearing the group down, as a killed worker leaves it."""
    import traceback

    os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    os.environ.update(env)
    time.sleep(delay_s)
    try:
        from refimpl.launch import init_from_env

        init_from_env("gloo", timeout_s=8)
        t = torch.ones(1)
        dist.all_reduce(t)
        Path(result).write_text(str(int(t.item())))
    except BaseException:
        Path(result).write_text(traceback.format_exc())
    os._exit(0)


def modules_imported_by_ddp() -> tuple[bool, list[str]]:
    """Whether torch._dynamo was imported before this rank wrapped a model in DDP, and the
    torch._dynamo / sympy modules wrapping it imported (none when the fork server had them)."""
    import sys

    had_dynamo = "torch._dynamo" in sys.modules
    before = set(sys.modules)
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    new = sorted(m for m in set(sys.modules) - before if m.startswith(("torch._dynamo", "sympy")))
    return had_dynamo, new
