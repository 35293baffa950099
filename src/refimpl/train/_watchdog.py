"""``python -m refimpl.train --step-timeout S``: a stuck worker is killed, and torchrun restarts.

A worker stuck in a save on a dead filesystem, or in a collective a peer never joins, is not a
failure to torchrun's agent: it is alive. torchrun's file-timer watchdog makes it one. With
``TORCHELASTIC_ENABLE_FILE_TIMER=1`` in torchrun's environment, each agent starts a
``FileTimerServer`` on a FIFO and passes its path to the workers as ``TORCHELASTIC_TIMER_FILE``
(``LocalElasticAgent._setup_local_watchdog``); a worker wraps each step and each save in
``torch.distributed.elastic.timer.expires(after=S)``, and the server signals a worker whose
timer ran out. The agent then sees a failed worker and restarts the group like any other.

The signal is SIGPIPE, not the client's default SIGKILL. After signalling the worker, torch
2.13's ``FileTimerServer._run_watchdog`` sends the *same* signal to its own process, which under
torchrun is the agent: with SIGKILL, torchrun dies with its worker and nothing restarts (tried
here: exit 137), so the signal must be one the agent survives. Python ignores two signals from
start-up, SIGPIPE and SIGXFSZ, and torchrun handles neither (its handlers are for SIGTERM,
SIGINT, SIGHUP and SIGQUIT). Of the two, SIGPIPE is the one to send: its default action ends
the process without a core dump, and for such a signal the kernel ends every thread at once as
if by SIGKILL (``complete_signal`` in ``kernel/signal.c``), which also ends a killable wait
(an NFS request to a dead server). SIGXFSZ, used here before, dumps core (a training
process's whole memory, where ``ulimit -c`` allows), and a core-dumping signal has no such
path: it waits for a thread to take it, which a thread stuck in the kernel never does. A wait
that is not even killable (state D proper) ends only when its I/O returns, whatever the signal.

The kernel also sends both signals itself, to the thread that caused them: SIGXFSZ when a
write passes ``ulimit -f``, SIGPIPE when a write finds a pipe or socket with no reader. So
that only the timer server's SIGPIPE ends the worker, the worker blocks SIGPIPE in its main
thread (and so in every thread it starts afterwards) and leaves it unblocked in one thread of
its own that does nothing but wait: the kernel's SIGPIPE then stays with the writing thread,
whose write fails with ``BrokenPipeError``, while the server's, sent to the process, is taken
by the waiting thread and ends the worker (exit status -13 in torchrun's log). SIGXFSZ stays
ignored, so a file-size limit is an ``OSError: File too large`` naming the file. (Threads
started before the watchdog, such as gloo's, keep SIGPIPE unblocked; torch's own sockets send
with ``MSG_NOSIGNAL``.)
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

from refimpl.atomic import atomic_write_bytes

__all__ = ["HANG_MARKER", "REAP_SIGNAL", "Watchdog", "hang_once", "unavailable"]

REAP_SIGNAL = signal.SIGPIPE
_ARMED: list[bool] = []  # set once the reap signal is armed in this process
HANG_MARKER = "hang_injected_at_step_{step}"


_TURN_ON = (
    "start torchrun with TORCHELASTIC_ENABLE_FILE_TIMER=1 in its environment (it then passes "
    "TORCHELASTIC_TIMER_FILE to every worker), e.g. "
    "TORCHELASTIC_ENABLE_FILE_TIMER=1 torchrun --max-restarts=2 ... -m refimpl.train ..."
)


def unavailable() -> str | None:
    """Why ``--step-timeout`` cannot work in this process, or None when torchrun's timer is on.

    On means ``TORCHELASTIC_TIMER_FILE`` names a FIFO that a process (the agent's timer
    server) has open for reading. Anything else is refused: torch's client opens the path
    write-only and non-blocking, which succeeds on a regular file (a stale value from another
    job), so the worker would run with no watchdog and write its requests over that file."""
    path = os.environ.get("TORCHELASTIC_TIMER_FILE")
    if not path:
        return f"--step-timeout needs torchrun's file-timer watchdog, which is off: {_TURN_ON}"
    where = f"--step-timeout: TORCHELASTIC_TIMER_FILE={path}"
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return f"{where} cannot be used ({exc.strerror}): no timer server is there; {_TURN_ON}"
    if not stat.S_ISFIFO(mode):
        return (
            f"{where} is not a FIFO (named pipe) but {_kind(mode)}: torchrun's timer server "
            f"reads a FIFO it made, so this is a stale value (it was left untouched); {_TURN_ON}"
        )
    try:  # a FIFO with no reader refuses a non-blocking writer (ENXIO): no server reads it
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as exc:
        why = "no process reads it" if exc.errno == errno.ENXIO else exc.strerror
        return f"{where} is a FIFO but {why}: its timer server is gone; {_TURN_ON}"
    return None


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a device or socket"


class Watchdog:
    """``guard(scope)`` bounds a block by ``seconds`` through torchrun's timer; no-op if None."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self._client: Any = None
        if seconds is not None:
            from torch.distributed.elastic.timer.file_based_local_timer import FileTimerClient

            _arm_reap_signal()
            self._client = FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"], REAP_SIGNAL)

    def guard(self, scope: str) -> contextlib.AbstractContextManager[None]:
        """A block this worker must leave within ``seconds``, or the agent's timer ends it."""
        if self._client is None:
            return contextlib.nullcontext()
        from torch.distributed.elastic.timer.api import expires

        return expires(after=self.seconds or 0.0, scope=scope, client=self._client)


def _arm_reap_signal() -> None:
    """Make `REAP_SIGNAL` sent to this process end it, and the kernel's own SIGPIPE, sent to a
    writing thread, a ``BrokenPipeError`` as before (see the module docstring). Main thread."""
    if _ARMED:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {REAP_SIGNAL})  # inherited by threads started later
    signal.signal(REAP_SIGNAL, signal.SIG_DFL)  # Python ignores it; the agent still does
    threading.Thread(target=_take_reap_signal, name="refimpl-reap-signal", daemon=True).start()
    _ARMED.append(True)


def _take_reap_signal() -> None:
    """The one thread with `REAP_SIGNAL` unblocked: the kernel hands it the server's signal."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {REAP_SIGNAL})
    threading.Event().wait()


def hang_once(ckpt_dir: str, step: int, log: Callable[[str], None]) -> None:
    """Block forever in the save of ``step`` unless that already happened (a marker file)."""
    marker = os.path.join(ckpt_dir, HANG_MARKER.format(step=step))
    if os.path.exists(marker):
        return
    os.makedirs(ckpt_dir, exist_ok=True)
    atomic_write_bytes(b"", marker)  # before hanging: the restarted worker must not hang again
    log(f"injected hang: the save of step {step} blocks forever")
    while True:
        time.sleep(3600)
