"""`spawn`: run a function on N local ranks, and end the whole job at the first failure.

What to wait for and which failure is the root cause; how one rank's process starts, sets
itself up and is killed is in `refimpl.launch._rank`.
"""

from __future__ import annotations

import functools
import math
import multiprocessing as mp
import numbers
import os
import pickle
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from refimpl.launch._rank import (
    JOB_MARKER,
    TCPStore,
    as_child_sees_it,
    bootstrap,
    collect_stacks,
    in_collective,
    kill_all,
    main_module_hidden,
    read_log,
    read_report,
    signal_name,
)

DEFAULT_TIMEOUT_S = 60.0
"""Wall-clock limit of a whole `spawn` job, in seconds."""
DEFAULT_PG_TIMEOUT_S = 30.0
"""Default limit of one collective inside the process group, in seconds."""
_PEER_GONE = ("gloo/transport", "Connection closed", "Connection reset", "communicator was aborted")
_COLLATERAL_GRACE_S = 1.0  # how long to wait for the root cause after the first failure
# ... and how long, at most, while every failure so far is a symptom (a peer gone, rank 0
# failed inside main_process_first): the rank that caused it may take longer to report.
_ROOT_CAUSE_WAIT_S = 10.0


class NotSpawnableError(ValueError):
    """The worker function cannot be found by a fresh process, so it cannot be spawned."""


class WorkerError(RuntimeError):
    """A rank failed. ``rank`` names it; ``remote_traceback`` is its traceback text.

    When the rank raised an exception that could be pickled, that exception is this
    error's ``__cause__``, so ``isinstance(err.__cause__, ValueError)`` works.
    """

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.output = ""  # what the rank wrote to stdout/stderr (see `spawn`'s rank_output)
        self.stacks: dict[int, str] = {}  # on a timeout: each live rank's innermost frames


class WorkerTimeout(WorkerError, TimeoutError):
    """The job ran past its timeout; ``ranks`` are the ranks that had not finished."""

    def __init__(self, ranks: Sequence[int], timeout_s: float) -> None:
        names = ", ".join(str(r) for r in ranks)
        super().__init__(
            ranks[0],
            f"rank(s) {names} still running after {timeout_s:g} s; every rank was killed. "
            "A rank waiting in a collective that another rank never joined looks exactly "
            "like this: check that all ranks call the same collectives in the same order.",
        )
        self.ranks = list(ranks)


def _where(stacks: dict[int, str], timed_out: Sequence[int] = ()) -> str:
    """Who was where: the ranks not inside a collective are named as the likely cause."""
    if not stacks:
        return ""
    lines = ["", "", "Where each live rank was (innermost frame first):"]
    for rank in sorted(stacks):
        frames = stacks[rank].splitlines()
        state = "waiting in a collective" if in_collective(stacks[rank]) else "NOT in a collective"
        lines.append(f"--- rank {rank} ({state}) ---")
        lines += [f"  {ln}" for ln in frames[:6]]
    stuck = [r for r in sorted(stacks) if not in_collective(stacks[r])]
    waiting = sorted({*timed_out, *(r for r in stacks if in_collective(stacks[r]))})
    if stuck and waiting:
        lines.append(
            f"rank(s) {', '.join(map(str, stuck))} never reached the collective that rank(s) "
            f"{', '.join(map(str, waiting))} waited in: look there first."
        )
    return "\n".join(lines)


def _importable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a child process will find it; refused before any process starts if none.

    A ``functools.partial`` travels by value: its function must be importable, and its bound
    arguments must pickle.
    """
    if isinstance(fn, functools.partial):
        inner = _importable(fn.func)
        bound = functools.partial(inner, *fn.args, **fn.keywords)
        try:
            pickle.dumps(bound)
        except Exception as exc:
            raise NotSpawnableError(
                f"cannot spawn functools.partial({inner.__qualname__}, ...): its bound "
                f"arguments cannot be pickled ({exc}). Pass plain data."
            ) from exc
        return bound
    found, why = as_child_sees_it(fn)
    if why is not None:
        qualname = getattr(fn, "__qualname__", repr(fn))
        raise NotSpawnableError(
            f"cannot spawn {qualname!r}: {why}. Worker processes import the function by "
            "module and name, so it must live in an importable module. Put it in a .py "
            "file (the book keeps every worker in refimpl) and import it from there."
        )
    return found


def _is_collateral(failure: tuple[int, str, str, str, Any]) -> bool:
    """A distributed error on a rank whose peer already died is a symptom, not the cause.

    Workers often wrap the backend's error in their own (``raise RuntimeError(...) from
    exc``), so the whole ``__cause__`` / ``__context__`` chain is checked, and the rank's
    formatted traceback, which still shows that chain after pickling has dropped it.
    """
    exc, message, text = failure[4], failure[2], failure[3]
    if any(s in text for s in _PEER_GONE):
        return True
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, dist.DistError) or any(s in str(exc) for s in _PEER_GONE):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return any(s in message for s in _PEER_GONE)


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"was killed by {signal_name(-exitcode)}"
    return f"exited with code {exitcode} without reporting a result"


# Heavy parts of torch that a rank imports on top of torch.distributed: DCP and DTensor (with
# sympy behind them) cost a fresh import ~0.8 s of CPU, in every rank of every job.
_PRELOAD_IF_LOADED = ("torch.distributed.checkpoint", "torch.distributed.fsdp")


def _forkserver_preload() -> list[str]:
    """What the fork server imports once, so that a forked rank finds it imported already.

    torch always, and ``torch._dynamo``: `DistributedDataParallel`'s constructor imports it
    (torch 2.13, ``nn/parallel/distributed.py``: ``torch._dynamo.utils.get_optimize_ddp_mode()``),
    which costs a rank that wraps a model about as much CPU again as importing torch. DCP and
    FSDP only when this process has imported them itself (a notebook about sharded
    checkpoints, a test session that collected such tests): its ranks will need them, while a
    chapter that never shards does not pay for them. The server starts at the first `spawn`
    of a process and keeps its modules for every later one.
    """
    loaded = [name for name in _PRELOAD_IF_LOADED if name in sys.modules]
    return ["torch", "torch.distributed", "torch._dynamo", *loaded, "refimpl.launch._rank"]


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pg_timeout_s: float | None = None,
    start_method: str = "forkserver",
    rank_output: str = "hide",
    kwargs: dict[str, Any] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks and return their results in rank order.

    The process group (``backend``, gloo by default) is initialised before ``fn`` runs, so
    ``fn`` calls ``dist.get_rank()`` and collectives directly, as it would under torchrun.
    ``fn`` must be importable by module and name (not defined in a notebook); otherwise
    `NotSpawnableError` is raised before any process starts. If any rank raises or dies,
    every rank is killed and `WorkerError` is raised naming the rank that caused it; if the
    job runs past ``timeout_s`` seconds (starting the ranks included), `WorkerTimeout` is
    raised. A ``world_size`` that is not a whole number >= 1, or a timeout that is not a finite
    number of seconds > 0, is a `ValueError` before anything is created. Collectives inside the
    group time out after ``pg_timeout_s`` (default: the smaller of 30 s and ``timeout_s``).

    Keyword arguments for ``fn`` go in ``kwargs={...}`` (``spawn``'s own keywords stay
    apart), or bind them with ``functools.partial(fn, ...)``, which is accepted when the
    function it wraps is importable.

    What ranks print goes, by ``rank_output``: ``"hide"`` (default) to a file per rank, kept
    on the error's ``output`` attribute if that rank fails; ``"show"`` the same, then printed
    after the job in rank order, each line prefixed ``[rank r]``; ``"inherit"`` straight to
    this process's stdout/stderr, interleaved (progress bars of long benchmarks).

    Example::

        from refimpl.collectives import rank_times_ten
        spawn(rank_times_ten, 2)  # -> [0, 10]
    """
    # Every argument is checked before anything exists (a run directory, a store, a process).
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
        raise ValueError(f"world_size must be at least 1 and a whole number, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    world_size = int(world_size)
    _check_seconds("timeout_s", timeout_s)
    deadline = time.monotonic() + timeout_s  # start-up counts: the limit is wall-clock
    fn = _importable(fn if not kwargs else functools.partial(fn, **kwargs))
    if pg_timeout_s is None:
        pg_timeout_s = min(DEFAULT_PG_TIMEOUT_S, timeout_s)
    _check_seconds("pg_timeout_s", pg_timeout_s)
    if rank_output not in ("hide", "show", "inherit"):
        raise ValueError(f"rank_output must be 'hide', 'show' or 'inherit', not {rank_output!r}")
    ctx: Any = mp.get_context(start_method)
    if start_method == "forkserver":
        # Workers fork from a server that has torch imported already: ~10 ms a rank
        # instead of the ~2 s a fresh interpreter needs to import torch.
        ctx.set_forkserver_preload(_forkserver_preload())
    run_dir = tempfile.mkdtemp(prefix="refimpl-ranks-")
    procs: list[Any] = []
    job = f"{os.getpid()}-{os.urandom(6).hex()}"
    try:
        return _run(
            ctx,
            fn,
            world_size,
            args,
            backend=backend,
            pg_timeout_s=pg_timeout_s,
            rank_output=rank_output,
            run_dir=run_dir,
            job=job,
            procs=procs,
            deadline=deadline,
            timeout_s=timeout_s,
        )
    finally:
        kill_all(procs, job)
        shutil.rmtree(run_dir, ignore_errors=True)


def _check_seconds(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0 < float(value) < math.inf
    ):
        raise ValueError(f"{name} must be a finite number of seconds above 0, got {value!r}")


def _run(
    ctx: Any,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    *,
    backend: str,
    pg_timeout_s: float,
    rank_output: str,
    run_dir: str,
    job: str,
    procs: list[Any],
    deadline: float,
    timeout_s: float,
) -> list[Any]:
    """`spawn` once its arguments are checked: start the ranks (into ``procs``, which the
    caller kills whatever happens), then collect their results."""
    logs = [
        None if rank_output == "inherit" else os.path.join(run_dir, f"rank{r}.log")
        for r in range(world_size)
    ]
    reports = [os.path.join(run_dir, f"rank{r}.result") for r in range(world_size)]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, JOB_MARKER: job}  # inherited by everything a rank starts
    procs += [
        ctx.Process(
            target=bootstrap,
            args=(
                r,
                world_size,
                store.port,
                backend,
                pg_timeout_s,
                env,
                fn,
                args,
                reports[r],
                logs[r],
                os.getpid(),
            ),
            name=f"rank{r}",
            # Not daemonic, so a rank may start processes of its own (DataLoader workers).
            # Nothing outlives the job anyway: every rank runs in its own process group,
            # which kill_all SIGKILLs, and watches this process (it dies with the launcher).
            daemon=False,
        )
        for r in range(world_size)
    ]
    try:
        with main_module_hidden():
            for rank, proc in enumerate(procs):
                if time.monotonic() > deadline:  # starting 128 ranks takes seconds
                    late = WorkerTimeout(range(world_size), timeout_s)
                    late.args = (
                        f"the job ran past its {timeout_s:g} s limit while starting rank {rank} "
                        f"of {world_size} (start-up counts toward timeout_s); every rank was "
                        "killed. Give spawn a longer timeout_s.",
                    )
                    raise late
                proc.start()
        values = _collect(procs, reports, deadline, timeout_s)
        if rank_output == "show":
            for r in range(world_size):
                for line in read_log(logs[r]).splitlines():
                    print(f"[rank {r}] {line}")
        return values
    except WorkerError as err:
        err.output = read_log(logs[err.rank])
        raise
    finally:
        kill_all(procs, job)  # before the store goes: no rank is left talking to it
        del store


def _unpickle(rank: int, what: str, data: bytes) -> Any:
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise WorkerError(
            rank,
            f"rank {rank} sent back {what} that this process cannot unpickle ({exc!r}); "
            "typically its class lives in a module the launcher cannot import. Return plain "
            "data (tensors, numbers, strings, lists and dicts of them).",
        ) from exc


def _collect(
    procs: Sequence[Any], reports: Sequence[str], deadline: float, timeout_s: float
) -> list[Any]:
    """Wait for every rank's report; on the first failure, find the root cause and raise."""
    world_size = len(procs)
    values: dict[int, Any] = {}
    failures: list[tuple[int, str, str, str, Any]] = []  # rank, type, msg, traceback, exc
    first_failure_at: float | None = None
    while len(values) + len(failures) < world_size:
        now = time.monotonic()
        if first_failure_at is not None and now > first_failure_at + _COLLATERAL_GRACE_S:
            symptoms_only = all(_is_collateral(f) for f in failures)
            if not symptoms_only or now > first_failure_at + _ROOT_CAUSE_WAIT_S:
                break
        if now > deadline:
            running = [r for r in range(world_size) if r not in values]
            late = WorkerTimeout(running, timeout_s)
            late.stacks = collect_stacks(procs, running, reports)
            late.args = (str(late) + _where(late.stacks),)
            raise late
        progressed = False
        for rank, proc in enumerate(procs):
            if rank in values or any(f[0] == rank for f in failures):
                continue
            exited = proc.exitcode is not None  # read before the report: no race
            report = read_report(reports[rank])
            if report is None and not exited:
                continue
            progressed = True
            if report is None:  # died without reporting: a signal or os._exit
                failures.append((rank, "", _exit_reason(proc.exitcode), "", None))
            elif report[0] == "ok":
                values[rank] = _unpickle(rank, "a return value", report[1])
            else:
                name, message, text, exc_bytes = report[1]
                exc = None
                try:
                    exc = _unpickle(rank, "an exception", exc_bytes) if exc_bytes else None
                except WorkerError as lost:  # keep the rank's own message and traceback
                    message = f"{message}\n(Note: {lost})"
                failures.append((rank, name, message, text, exc))
            if failures and first_failure_at is None:
                first_failure_at = time.monotonic()
        if not progressed:
            time.sleep(0.02)
    if failures:
        root = next((f for f in failures if not _is_collateral(f)), failures[0])
        rank, name, message, text, exc = root
        if not name:  # died without reporting: a signal or os._exit
            raise WorkerError(rank, f"rank {rank} {message}; every rank was killed")
        stacks: dict[int, str] = {}
        if "timed out" in message.lower() or "timeout" in message.lower():
            # A collective timed out: the peers that never joined it are still running
            # somewhere else. Ask them where, before everything is killed.
            reported = set(values) | {f[0] for f in failures}
            alive = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is None]
            stacks = collect_stacks(procs, alive, reports)
        err = WorkerError(
            rank,
            f"rank {rank} raised {name}: {message}\n\n--- rank {rank} traceback ---\n{text}"
            + _where(stacks, timed_out=[rank] if stacks else []),
        )
        err.remote_traceback = text
        err.stacks = stacks
        raise err from exc
    return [values[r] for r in range(world_size)]
