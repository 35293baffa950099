"""The plumbing of one rank's process: how `refimpl.launch.spawn` starts, sets up and kills it.

Kept apart from `refimpl.launch._spawn` so the launcher's logic (what to wait for, which failure is
the root cause) reads without the operating-system details (process groups, death signals,
file descriptors).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from refimpl._exit_hooks import run_exit_hooks
from refimpl._system.proc import pid_alive, pids_with_env, state

STARTUP_TIMEOUT_S = 60.0  # for ranks to start and meet, whatever the collective timeout
TCPStore = dist.TCPStore  # type: ignore[attr-defined]  # not in torch.distributed's __all__


def as_child_sees_it(fn: Callable[..., Any]) -> tuple[Callable[..., Any], str | None]:
    """``(fn as a child process will import it, None)``, or ``(fn, why it cannot)``.

    A child finds the function by module and qualified name. A function of a module run
    as ``python -m pkg.mod`` is called ``__main__.fn`` in the parent but ``pkg.mod.fn``
    for everyone else, so it is swapped for that importable twin.
    """
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", repr(fn))
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if module == "__main__" and spec is not None and spec.name not in ("__main__", None):
        with contextlib.suppress(ImportError, AttributeError):
            twin: Any = importlib.import_module(spec.name)
            for part in qualname.split("."):
                twin = getattr(twin, part)
            if callable(twin):
                return as_child_sees_it(twin)
    if module in (None, "__main__", "__mp_main__"):
        return fn, f"{qualname!r} is defined in __main__ (a notebook cell or the script you ran)"
    if "<locals>" in qualname or "<lambda>" in qualname:
        return fn, f"{qualname!r} is a lambda or a function defined inside another function"
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        return fn, f"{module}.{qualname} cannot be imported ({exc})"
    return fn, None if found is fn else f"{module}.{qualname} names a different object"


def die_with_launcher(launcher_pid: int) -> None:
    """Make sure this rank (and whatever it starts) dies if the launcher dies.

    The rank's parent is multiprocessing's fork server, not the launcher, and the fork
    server outlives a launcher killed with SIGKILL for as long as any rank is alive (each
    rank holds the pipe end it watches). So the rank watches the launcher itself: a daemon
    thread checks it twice a second and kills the rank's whole process group once it is
    gone. ``PR_SET_PDEATHSIG`` covers the ``spawn`` start method, where the launcher is
    the parent.
    """
    with contextlib.suppress(Exception):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)

    def watch() -> None:
        while _alive(launcher_pid):
            time.sleep(0.5)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="refimpl-launcher-watch", daemon=True).start()


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9, ``SIGRTMIN+1`` for a real-time signal, ``signal 99`` otherwise."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        rtmin = getattr(signal, "SIGRTMIN", None)
        if rtmin is not None and rtmin <= signum <= getattr(signal, "SIGRTMAX", rtmin):
            return f"SIGRTMIN+{signum - rtmin}"
        return f"signal {signum}"


def _alive(pid: int) -> bool:
    # A killed launcher whose own parent has not reaped it yet is a zombie: dead already.
    return pid_alive(pid) and state(pid) != "Z"


def wait_for_all_ranks(store: Any, world_size: int, timeout_s: float) -> None:
    """Return once every rank has reached this point (a counter in the store).

    A demo with a 2 s collective timeout must not fail because one rank started late on a
    loaded machine: the short timeout is for the demo's collectives, not for start-up. So
    the ranks line up here, under the long start-up timeout, before the group exists.
    """
    store.add("refimpl/arrived", 1)
    if not _count_reaches(store, "refimpl/arrived", world_size, timeout_s):
        raise TimeoutError(f"not all {world_size} ranks started within {timeout_s:g} s")


def _count_reaches(store: Any, key: str, target: int, timeout_s: float) -> bool:
    """Wait until the counter ``key`` reaches ``target``; False if ``timeout_s`` ran out."""
    deadline = time.monotonic() + timeout_s
    while int(store.add(key, 0)) < target:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _slow_connect_hook(store: Any, rank: int) -> None:
    """Test hook (tests/test_launch.py): ``REFIMPL_TEST_SLOW_CONNECT=RANK:SECONDS:PATH`` makes
    that rank linger after its group is up, then write to PATH whether rank 0 had already
    started tearing its group down ("torn down") or was still waiting for it ("intact")."""
    hook = os.environ.get("REFIMPL_TEST_SLOW_CONNECT")
    if not hook:
        return
    hook_rank, seconds, path = hook.split(":", 2)
    if int(hook_rank) == rank:
        time.sleep(float(seconds))
        torn = store.check(["refimpl/teardown/0"])
        Path(path).write_text("torn down" if torn else "intact")


def bootstrap(
    rank: int,
    world_size: int,
    store_port: int,
    backend: str,
    pg_timeout_s: float,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    result_path: str,
    log_path: str | None,
    launcher_pid: int,
) -> None:
    """Body of every worker process: set up the group, run ``fn``, report back.

    The report is a file, written under a temporary name and renamed into place: the
    launcher sees all of it or none of it, so a rank killed while reporting (SIGKILL, the OOM
    killer) can never leave the launcher blocked on half a message, as a pipe would.
    """
    os.setpgrp()  # own process group: the launcher kills the rank and its children at once
    die_with_launcher(launcher_pid)
    # On SIGUSR1, write every thread's Python stack to a file the launcher reads before it
    # kills a stuck job: the error then says where each rank was, not just that time ran out.
    stack_file = open(stack_path(result_path), "w")  # noqa: SIM115 (lives as long as the rank)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    if log_path is not None:
        # Ranks write to their own file, never to the notebook: N ranks printing at once
        # would interleave nondeterministically (ipykernel forwards fd 1 and 2 to the page).
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    # Line-buffer what the rank prints: with stdout a file or pipe (Jupyter, CI, pytest, a
    # redirected log) Python buffers in blocks, and a rank that exits or is killed would lose
    # its last lines. The finally block below flushes the rest.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
    )
    # torch reads TORCH_DISTRIBUTED_DEBUG when it is imported, which for a forked rank was in
    # the fork server, with the environment of the first spawn; read it again from this job's.
    dist.set_debug_level_from_env()  # type: ignore[attr-defined]
    torch.set_num_threads(1)  # N ranks share a few cores; oversubscription distorts timings
    try:
        startup = datetime.timedelta(seconds=max(pg_timeout_s, STARTUP_TIMEOUT_S))
        store = TCPStore("127.0.0.1", store_port, is_master=False, timeout=startup)
        wait_for_all_ranks(store, world_size, startup.total_seconds())
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        _slow_connect_hook(store, rank)
        store.add("refimpl/connected", 1)  # see the finally block
        value = fn(*args)
        # What the process would do at exit (say what became of an async save nobody waited
        # for), now: after the report the launcher kills the rank, and a multiprocessing child
        # runs no atexit handlers anyway.
        run_exit_hooks(final=False)
        try:
            report: tuple[str, Any] = ("ok", pickle.dumps(value))
        except Exception as exc:
            raise TypeError(
                f"rank {rank}: the return value of {getattr(fn, '__qualname__', fn)} (a "
                f"{type(value).__module__}.{type(value).__qualname__}) cannot be pickled, so it "
                f"cannot be sent back to the launcher ({exc}). Return plain data: tensors, "
                "numbers, strings, lists and dicts of them."
            ) from exc
    except BaseException as exc:  # everything, even SystemExit, must reach the launcher
        text = traceback.format_exc()
        try:
            payload = pickle.dumps(exc)
            pickle.loads(payload)
        except Exception:  # some exceptions do not survive pickling
            payload = b""
        report = ("error", (type(exc).__name__, str(exc), text, payload))
    finally:
        # Report first, tear down second: destroying the group makes the peers fail with
        # "connection closed", and the launcher must see this rank's real error before theirs.
        _write_report(result_path, report)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if report[0] == "ok":
            # A rank whose worker did no collective can finish its side of gloo's full-mesh
            # connect, tear the group down and exit while a peer is still completing its own
            # side; the peer then fails with "connectFullMesh failed ... Connection closed by
            # peer" (seen in our own suite, two test workers on two cores). So wait, bounded,
            # until every rank's group is up. A rank that failed reports its own error and the
            # launcher stops everyone, so nothing waits on an error path.
            with contextlib.suppress(Exception):
                _count_reaches(store, "refimpl/connected", world_size, startup.total_seconds())
        with contextlib.suppress(Exception):
            store.set(f"refimpl/teardown/{rank}", "1")  # read by the test hook above
            dist.destroy_process_group()


def stack_path(result_path: str) -> str:
    """Where a rank writes its stacks when the launcher asks (next to its report)."""
    return result_path.removesuffix(".result") + ".stack"


def collect_stacks(
    procs: Sequence[Any], ranks: Sequence[int], reports: Sequence[str], wait_s: float = 1.0
) -> dict[int, str]:
    """Ask each of ``ranks`` (alive) for its Python stack; return rank -> the worker's frames.

    faulthandler writes all threads, innermost frame first; only the thread that runs the
    worker (the one whose stack holds `bootstrap`) is kept, from the innermost frame down to
    the worker function.
    """
    asked = []
    for rank in ranks:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(procs[rank].pid, signal.SIGUSR1)
            asked.append(rank)
    deadline = time.monotonic() + wait_s
    stacks: dict[int, str] = {}
    while time.monotonic() < deadline and len(stacks) < len(asked):
        for rank in asked:
            with contextlib.suppress(OSError):
                text = open(stack_path(reports[rank])).read()  # noqa: SIM115
                block = _worker_thread(text)
                if block:
                    stacks[rank] = block
        time.sleep(0.05)
    return stacks


def _worker_thread(dump: str) -> str:
    for block in dump.split("\n\n"):
        lines = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("File ")]
        if any(ln.endswith(" in bootstrap") for ln in lines):
            frames = lines[: next(i for i, ln in enumerate(lines) if ln.endswith(" in bootstrap"))]
            return "\n".join(frames)
    return ""


def in_collective(frames: str) -> bool:
    """True when a rank's innermost frames are inside torch.distributed (waiting on peers)."""
    return "torch/distributed/" in frames


def _write_report(path: str, report: tuple[str, Any]) -> None:
    tmp = f"{path}.part"
    with open(tmp, "wb") as f:
        pickle.dump(report, f)
    os.replace(tmp, path)  # atomic: the launcher never reads half a report


def read_report(path: str) -> tuple[str, Any] | None:
    """The report a rank left at ``path``, or None if it has not (or never will) report."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    report: tuple[str, Any] = pickle.loads(data)
    return report


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Start children without re-running the caller's ``__main__`` in them.

    multiprocessing re-imports the parent's main script in every child, which runs an
    unguarded script's top level again (and starts more processes). Workers never need
    ``__main__`` (`refimpl.launch` refuses functions from it), so hide it while starting.
    """
    real_main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = real_main


JOB_MARKER = "REFIMPL_JOB"
"""Environment variable every rank (and, by inheritance, everything it starts) carries."""


def kill_all(procs: Sequence[Any], job: str | None = None) -> None:
    """SIGKILL every rank's process group (the rank and whatever it started), then reap.

    A process a rank started in a session of its own (``start_new_session=True``, a daemon)
    has left the rank's process group; it still carries the job's environment marker, so on
    Linux it is found through /proc and killed too. (A process that clears its environment
    escapes this; nothing short of a cgroup catches that.)
    """
    for proc in procs:
        if proc.pid is None:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, signal.SIGKILL)
    if job is not None and os.path.isdir("/proc"):
        for pid in pids_with_env(f"{JOB_MARKER}={job}"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    for proc in procs:
        if proc.pid is not None:
            proc.join(timeout=10)


def read_log(path: str | None) -> str:
    if path is None:
        return ""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
