"""`AsyncSaveHandle`, one background save of `refimpl.sharded._async.AsyncSaver`, and what a
process does at exit with the saves nobody waited for.

A save nobody waited for must neither vanish in silence (a failure would go unnoticed, and the
next start would resume from an older step) nor keep the process alive forever (a paced write,
a write to a dead filesystem). The exit hook (`refimpl._exit_hooks`: before Python joins the
saver's threads, and in a `refimpl.launch.spawn` rank before it reports) stops pacing, waits
for each such save at most its saver's collective timeout, and says on stderr what became of
it; a save still running then is lost, and the process exits with status 1 at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import time
from pathlib import Path

from refimpl._exit_hooks import at_exit
from refimpl.sharded._paced_writer import stop_pacing

__all__ = ["AsyncSaveHandle"]


class AsyncSaveHandle:
    """One background save. ``step`` and ``path`` (the final ``step_N``) are known at once;
    ``staged_bytes`` is the size of this rank's staging copy; ``result()`` waits.
    ``exit_wait_s`` is the longest a process exiting with this save unwaited waits for it
    (`refimpl.sharded.AsyncSaver` passes its collective timeout)."""

    def __init__(
        self,
        step: int,
        path: Path,
        future: concurrent.futures.Future[Path],
        staged_bytes: int,
        *,
        exit_wait_s: float = 60.0,
    ) -> None:
        self.step = step
        self.path = path
        self.staged_bytes = staged_bytes
        self._future = future
        self.error_seen = False  # its error reached the caller once: the saver will not re-raise
        self._exit_wait_s = exit_wait_s  # the saver's collective timeout
        _UNWAITED.add(self)  # until someone waits for it: see _finish_unwaited_at_exit

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> Path:
        """Wait until the step is committed and return its directory.

        Raises `refimpl.sharded.ShardedCheckpointError` if any rank's save or the commit
        failed (nothing was published then), ``TimeoutError`` after ``timeout`` seconds.
        """
        try:
            return self._future.result(timeout)
        except BaseException:
            if self._future.done() and self._future.exception() is not None:
                self.error_seen = True  # its own error, not a timeout or a Ctrl-C while waiting
            raise
        finally:
            if self._future.done():
                _UNWAITED.discard(self)

    def _status(self) -> str:
        if not self._future.done():
            return "was still running (it is lost: nothing was published)"
        error = self._future.exception()
        if error is None:
            return "had committed"
        return f"had FAILED and was not published ({type(error).__name__}: {error})"


_UNWAITED: set[AsyncSaveHandle] = set()


@at_exit
def _finish_unwaited_at_exit(final: bool) -> None:
    """Say so when a process exits with an async save nobody waited for, once it has committed
    or failed: without this, a failure would vanish with the process and the next start would
    resume from an older step. Runs before Python joins the saver's threads
    (`refimpl._exit_hooks`): pacing is stopped, so the write finishes at full speed, and the
    wait is bounded by the saver's collective timeout. A save still running then is lost; with
    ``final``, the process then exits with status 1 at once rather than wait for it forever."""
    handles = sorted(_UNWAITED, key=lambda h: h.step)
    _UNWAITED.clear()
    if not handles:
        return
    stop_pacing()
    deadline = time.monotonic() + max(h._exit_wait_s for h in handles)
    for handle in handles:
        remaining = max(0.0, deadline - time.monotonic())
        with contextlib.suppress(
            concurrent.futures.TimeoutError, concurrent.futures.CancelledError
        ):
            handle._future.exception(timeout=remaining)  # its error, if any, is in _status
    for handle in handles:
        print(
            f"refimpl warning: the async save of step {handle.step} to {handle.path} was never "
            f"waited for; at exit it {handle._status()}. Call handle.result() or "
            "AsyncSaver.close() before the process group is destroyed and the process exits.",
            file=sys.stderr,
            flush=True,
        )
    running = [h for h in handles if not h.done()]
    if running and final:
        waited = max(h._exit_wait_s for h in running)
        print(
            f"refimpl error: exiting with status 1 now instead of waiting for the async save "
            f"of step {running[0].step}, still running {waited:g} s after the process began to "
            "exit (its collective timeout): a save that never finishes would keep the process "
            "alive forever.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(1)
