"""Work a process must finish when it is about to exit, before Python joins its threads.

Python runs ``atexit`` handlers only after it has joined every non-daemon thread, so such a
handler cannot bound a wait for a thread (a background save that never ends keeps the process
alive), and a ``multiprocessing`` child (a rank of `refimpl.launch.spawn`) runs none: it leaves
through ``os._exit``, and the launcher kills it once it has reported. A hook registered here
runs in threading's own exit step, before any thread is joined (CPython's
``threading._register_atexit``, which ``concurrent.futures`` uses to join its workers; ours is
registered after theirs, so it runs first), and, in a spawn rank, just before the rank reports
(`refimpl.launch._rank.bootstrap`).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  registers its join first: our hooks run before it
import threading
from collections.abc import Callable

__all__ = ["at_exit", "run_exit_hooks"]

_HOOKS: list[Callable[[bool], None]] = []


def at_exit(hook: Callable[[bool], None]) -> Callable[[bool], None]:
    """Call ``hook(final)`` when this process is about to exit; return ``hook``.

    ``final`` True: Python joins the threads next (the hook may end the process itself rather
    than wait); False: a spawn rank about to report, which goes on. A hook must be safe to run
    twice (both happen in a spawn rank) and must bound its own waits."""
    _HOOKS.append(hook)
    return hook


def run_exit_hooks(*, final: bool) -> None:
    """Run every registered hook, newest first (see `at_exit` for ``final``)."""
    for hook in reversed(_HOOKS):
        hook(final)


_register = getattr(threading, "_register_atexit", None)  # CPython 3.9+
if _register is not None:
    _register(run_exit_hooks, final=True)
else:  # pragma: no cover  (other interpreters: after the threads are joined, unbounded)
    atexit.register(run_exit_hooks, final=True)
