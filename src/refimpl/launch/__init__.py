"""Start a gloo (or NCCL) process group from a notebook, a test or a script, and never hang.

`spawn` is the launcher every chapter uses. It runs ``fn(*args)`` on ``world_size`` local
processes with the process group already initialised, and returns their results in rank
order. The first rank that fails (an exception, a crash, a signal) or a job that runs past
``timeout_s`` ends the whole job: every rank, and everything a rank started, is killed, and
the error is re-raised in the caller with the rank that caused it and that rank's traceback.

`init_from_env` is the same set-up for processes that `torchrun` started, so the same worker
function runs on a laptop under `spawn` and on a cluster under `torchrun`.

The package: `refimpl.launch._spawn` (`spawn`, its errors and limits), `refimpl.launch._rank`
(one rank's process: start, set-up, kill) and `refimpl.launch._torchrun` (`init_from_env`).
"""

from __future__ import annotations

from refimpl.launch._spawn import (
    DEFAULT_PG_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    NotSpawnableError,
    WorkerError,
    WorkerTimeout,
    spawn,
)
from refimpl.launch._torchrun import RankInfo, init_from_env

__all__ = [
    "DEFAULT_PG_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "NotSpawnableError",
    "RankInfo",
    "WorkerError",
    "WorkerTimeout",
    "init_from_env",
    "spawn",
]

# documented, shown in tracebacks and pickled by reference as refimpl.launch's, as before the
# package (a RankInfo returned by a rank reaches the parent through pickle)
for _public in (NotSpawnableError, WorkerError, WorkerTimeout, RankInfo, spawn, init_from_env):
    _public.__module__ = __name__
del _public
