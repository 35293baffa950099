"""`refimpl.launch.init_from_env`: the process group of a torchrun worker, safe across restarts.

torchrun (torch 2.13) shares one TCPStore across all of a job's attempts: the rendezvous
handler creates it once on the first round and hands the same address to every later round
(``DynamicRendezvousHandler.next_rendezvous`` caches ``_bootstrap_store_info`` and
``_shared_tcp_store_server``), and workers get ``TORCHELASTIC_USE_AGENT_STORE=True``, so
``init_process_group("env://")`` connects to it as a client (``rendezvous.py``'s
``_create_c10d_store``, whose comment assumes "a new TCPStore for every retry"). Every attempt
then writes its group's keys under the same names (``default_pg/...``), and a restarted
worker can read the dead workers' addresses before its peers overwrite them: gloo's
``connectFullMesh`` fails with "Connection refused" or waits out the timeout
(pytorch/pytorch#135712).

`attempt_store` gives each attempt keys no earlier attempt wrote: rank 0 draws a random
token and publishes it under the job's run id (two jobs may share a store); every other rank
proves it read *this* attempt's token (a handshake with a token of its own), and the group is
built on ``PrefixStore(token, store)``.
``TORCHELASTIC_RESTART_COUNT`` alone would not do: it is each agent's own count, and an
agent that restarts for a membership change does not increment it
(``SimpleElasticAgent._invoke_run``), so two nodes can hold different counts for the same
attempt. Every wait is bounded by the init timeout and fails with an error naming the rank.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

__all__ = ["RankInfo", "attempt_store", "init_from_env"]

_POLL_S = 0.2  # how long a rank waits for an answer to a token before reading it again
_AGENT_POLL_S = 1.0  # how often a torchrun worker checks that its agent is still its parent
_watching: list[threading.Thread] = []  # the one agent watch of this process, once started


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job: what `init_from_env` returns."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str
    device: torch.device


class AttemptStoreError(RuntimeError):
    """The ranks of this attempt could not agree on a fresh store within the init timeout."""


def _arrived(store: Store, keys: list[str], deadline: float) -> bool:
    """Whether every key exists before ``deadline``. Polls ``check``: a ``wait`` that times
    out is an exception, and this loop wants a yes or no many times a second."""
    while not store.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _token_key() -> str:
    """Where rank 0 publishes this attempt's token: under the job's own name, torchrun's run
    id (``TORCHELASTIC_RUN_ID``: ``--rdzv-id``, a fresh uuid with ``--standalone``), so that
    two jobs meeting on one store (one rendezvous endpoint) never read each other's token,
    which would put a rank of one job into the other's group."""
    return f"refimpl/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/attempt"


def attempt_store(rank: int, world_size: int, timeout_s: float) -> Store:
    """A store for this attempt's process group, over torchrun's shared one, with fresh keys.

    Connects to ``MASTER_ADDR:MASTER_PORT`` (the agent's store) and returns a `PrefixStore`
    whose prefix is a token rank 0 drew for this attempt, once every rank has shown it holds
    that token (not one a dead rank 0 of an earlier attempt, or another job's rank 0, left
    behind: the token's key is scoped to torchrun's run id). Raises
    `AttemptStoreError`, naming the ranks and the store, if that takes over ``timeout_s``.
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    where = f"torchrun's store at {addr}:{port}"
    deadline = time.monotonic() + timeout_s
    token_key = _token_key()
    base = TCPStore(
        addr, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    if rank == 0:
        token = os.urandom(8).hex()
        base.set(token_key, token)
        acks = [f"refimpl/{token}/ack/{r}" for r in range(1, world_size)]
        if acks and not _arrived(base, acks, deadline):
            missing = [r for r, key in enumerate(acks, 1) if not base.check([key])]
            raise AttemptStoreError(
                f"rank 0: rank(s) {missing} did not join this attempt (token {token}) on {where} "
                f"within {timeout_s:g} s; they may have failed to start (see their logs). "
                "torchrun will count this attempt as failed and restart."
            )
        for r, key in enumerate(acks, 1):
            base.set(
                f"refimpl/{token}/go/{r}", base.get(key).decode()
            )  # echo each rank's own token
        return PrefixStore(f"refimpl/{token}/", base)
    mine = os.urandom(8).hex()
    while time.monotonic() < deadline and _arrived(base, [token_key], deadline):
        token = base.get(token_key).decode()
        base.set(f"refimpl/{token}/ack/{rank}", mine)
        go = f"refimpl/{token}/go/{rank}"
        # A dead rank 0 never answers; an answer an earlier attempt left is not our token.
        if _arrived(base, [go], min(deadline, time.monotonic() + _POLL_S)):
            if base.get(go).decode() == mine:
                return PrefixStore(f"refimpl/{token}/", base)
            time.sleep(_POLL_S)
    raise AttemptStoreError(
        f"rank {rank}: no rank 0 of this attempt answered on {where} within {timeout_s:g} s "
        "(rank 0 failed to start or is stuck before init_from_env). torchrun will count "
        "this attempt as failed and restart."
    )


def watch_agent(poll_s: float = _AGENT_POLL_S) -> threading.Thread | None:
    """End this torchrun worker within ``poll_s`` seconds of its agent's death.

    torchrun starts each worker in a session of its own, so a scheduler (or a person) that
    kills the agent's process group leaves the worker running: it trains on alone and keeps
    writing into a checkpoint directory that the job's next launch will use. The agent is
    the worker's parent; when it dies the worker is re-parented, so a daemon thread compares
    ``os.getppid()`` with the pid it started with and, when they differ, says so on stderr
    and ends the process at once (``os._exit(1)``: no save on the way out, since that would
    be the very write to keep out of the directory; refimpl's saves are atomic, so one cut
    short leaves only a temporary that the next save removes). Started once per process;
    returns the thread, or None when there is no parent to watch.
    """
    if _watching:
        return _watching[0]
    agent = os.getppid()
    if agent <= 1:  # already an orphan (or started by init): nothing to watch
        return None
    rank = os.environ.get("RANK", "?")

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(poll_s)
        sys.stderr.write(
            f"[refimpl] rank {rank}: torchrun's agent (pid {agent}) is gone; exiting so that "
            "this orphaned worker neither trains on alone nor writes into a checkpoint "
            "directory the job's next launch will use\n"
        )
        sys.stderr.flush()
        os._exit(1)

    thread = threading.Thread(target=watch, name="refimpl-agent-watch", daemon=True)
    thread.start()
    _watching.append(thread)
    return thread


def _world_of_one() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    logging.getLogger("refimpl.launch").info(
        "init_from_env: no RANK/WORLD_SIZE (not started by torchrun): running as a world "
        "of one. For N processes: torchrun --nproc-per-node=N script.py"
    )


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> RankInfo:
    """Initialise the process group from torchrun's environment variables.

    Reads ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (torchrun sets
    them, and so does `spawn`), picks NCCL when a GPU is present and gloo otherwise, and
    returns a `RankInfo` whose ``device`` is `refimpl.device.rank_device`. On CUDA it pins
    the process to GPU ``LOCAL_RANK`` and passes ``device_id`` to ``init_process_group``,
    which makes NCCL create its communicator now rather than at the first collective (so a
    wrong network interface fails here, not in the middle of the first step). Without
    torchrun's variables (``python train.py``) it runs as a world of one on localhost and
    logs that it did. If the group is already initialised (as inside `spawn`) it only reports
    where this process sits.

    Under torchrun's shared store (``TORCHELASTIC_USE_AGENT_STORE=True``, torch's default) the
    group's keys are scoped to this attempt (`attempt_store`), so a restart never reads a dead
    worker's address. Trainers that call ``init_process_group`` themselves do not get this;
    for them, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment gives every
    attempt a fresh store (pytorch/pytorch#135712). A torchrun worker also ends itself within
    a second or so when its agent dies (`watch_agent`), instead of training on as an orphan.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: do not outlive the agent
        watch_agent()
    if not dist.is_initialized() and ("RANK" not in os.environ or "WORLD_SIZE" not in os.environ):
        _world_of_one()
    from refimpl.device import backend_uses_cuda, rank_device

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = rank_device(backend)
    if not dist.is_initialized():
        extra: dict[str, Any] = {}
        if backend_uses_cuda(backend) and device.type == "cuda":
            torch.cuda.set_device(device)
            extra["device_id"] = device  # eager NCCL init: fail at start-up, not mid-step
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            extra.update(store=attempt_store(rank, world, timeout_s), rank=rank, world_size=world)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **extra)
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    return RankInfo(
        rank=dist.get_rank(),
        local_rank=local_rank,
        world_size=dist.get_world_size(),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
        backend=str(dist.get_backend()),
        device=device,
    )
