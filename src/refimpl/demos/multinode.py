"""Chapter 11's multi-node runs, on one machine: two torchrun agents, a node lost, a node back.

Each "node" is one ``torchrun --nproc-per-node=1 --rdzv-backend=c10d`` agent in a session of
its own, both meeting at one endpoint on 127.0.0.1; node ``a`` serves the rendezvous store
(``is_host=1``), so the node that is lost is always the other one. Losing a node is what a
scheduler does to it: SIGKILL its agent and its worker, by pid. `fixed_restart` kills a worker
of a fixed two-node job (``--fail-at-step``); `elastic_loss` kills node ``b`` of a ``1:2``
job, lets the job go on alone and, with ``regrow=True``, starts ``b`` again. `lose_store_host`
runs three agents and loses the one whose agent serves the workers' store. `trained_once`
counts, from ``--sample-log``, which samples the final model was trained on.

Linux only (processes are found through ``/proc``, as in `refimpl._processes`).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refimpl._processes import MARKER, descendants, env_of, kill_run, marked, signal_all, workers

__all__ = ["RDZV_CONF", "Node", "NodeExited", "TwoNodes", "agent_command", "elastic_loss"]
__all__ += ["ephemeral_range", "fixed_restart", "free_port", "lose_store_host", "rank0_attempts"]
__all__ += ["trained_once"]

RDZV_CONF = {
    "join_timeout": 60,  # default 600: a node that waits longer than this for a round fails
    "last_call_timeout": 1,  # default 30: the wait for more nodes once --nnodes' minimum is in
    "close_timeout": 10,  # default 30
    "keep_alive_interval": 1,  # default 5: a node's heartbeat to the rendezvous, in seconds
    "keep_alive_max_attempt": 4,  # default 3: x interval = silence before a node counts as dead
}
"""``--rdzv-conf`` for these runs: torch 2.13's defaults wait 30 s for late nodes and notice
a dead one after 15 s (`torch.distributed.elastic.rendezvous.dynamic_rendezvous`)."""
_START = re.compile(r"^\[rank0\] start: world (\d+)")
_RESUME = re.compile(r"^\[rank0\] (?:resumed from step_(\d+)|no checkpoint in)")
_STEP = re.compile(r"^\[rank0\] step (\d+) loss")


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out by itself (to ``connect`` and to ``bind`` on port 0):
    ``/proc/sys/net/ipv4/ip_local_port_range``, Linux's default where it cannot be read."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port() -> int:
    """A TCP port for node ``a`` to serve the rendezvous on: free now, and outside the
    kernel's ephemeral range, so no other process can be handed it before ``a`` listens.

    Binding port 0 and closing (what this did first) returns an *ephemeral* port. Node ``a``
    binds it only once torchrun has started (seconds later on a loaded machine), and in
    between any process that connects anywhere can get that port as its local end; then
    ``a`` fails with EADDRINUSE, ``b`` waits 60 s for a store that never comes, and both end
    without training (issue 25's flake, reproduced by holding the port that way). The ports
    below the range are never handed out unasked; those near torchrun's and
    ``MASTER_PORT``'s customary 29400-29500 are skipped.
    """
    first, last = ephemeral_range()
    below, above = range(max(1024, first - 12000), first), range(last + 1, 65536)
    ports = max(below, above, key=len)  # a range set to 1024-65535 leaves no room: then any
    choices = [p for p in ports if not 29000 <= p < 30000] or list(range(1024, 65536))
    for port in random.Random(os.urandom(8)).sample(choices, min(200, len(choices))):
        with socket.socket() as s:
            try:
                s.bind(("", port))  # the wildcard: also busy if it is bound on 127.0.0.1 only
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port among 200 tried in {choices[0]}-{choices[-1]}")


def agent_command(
    train_args: Sequence[str],
    *,
    nnodes: str,
    port: int,
    rdzv_id: str,
    host: bool,
    max_restarts: int = 2,
    local_addr: str | None = None,
) -> list[str]:
    """One node's line: ``torchrun --nnodes=N --nproc-per-node=1 --rdzv-backend=c10d ...``
    (with ``local_addr``, ``--local-addr=ADDR``: the node's address, which orders node ranks)."""
    conf = ",".join(f"{k}={v}" for k, v in {**RDZV_CONF, "is_host": int(host)}.items())
    torchrun = Path(sys.executable).with_name("torchrun")
    head = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    addr = [f"--local-addr={local_addr}"] if local_addr is not None else []
    return [
        *head,
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf={conf}",
        *addr,
        "-m",
        "refimpl.train",
        *train_args,
    ]


@dataclass
class Node:
    """One agent: its process, its output lines (stdout and stderr, worker and agent) with
    the monotonic time each arrived, and its exit status (None while running or killed)."""

    name: str
    proc: subprocess.Popen[str]
    token: str
    lines: list[tuple[float, str]] = field(default_factory=list)
    killed_at: float | None = None
    reader: threading.Thread | None = None


class NodeExited(TimeoutError):
    """An agent exited before the line `TwoNodes.wait_for` was told to wait for."""


class TwoNodes:
    """Start agents side by side, watch their lines, kill one as a scheduler does, and on
    exit kill whatever is left (every process carries a marker, as in `refimpl.chaos`)."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        train_args: Sequence[str],
        *,
        nnodes: str,
        max_restarts: int = 2,
        share_store: bool = True,
    ) -> None:
        self.share_store = share_store
        self.workdir, self.train_args = Path(workdir), list(train_args)
        self.nnodes, self.max_restarts = nnodes, max_restarts
        self.port, self.rdzv_id = free_port(), f"run{uuid.uuid4().hex[:8]}"
        self.nodes: list[Node] = []
        self.t0 = time.monotonic()
        self._new_line = threading.Condition()

    def __enter__(self) -> TwoNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, name: str, *, host: bool, local_addr: str | None = None) -> Node:
        """Start one agent (``host``: it serves the rendezvous store; ``local_addr``: its
        ``--local-addr``)."""
        cmd = agent_command(
            self.train_args,
            nnodes=self.nnodes,
            port=self.port,
            rdzv_id=self.rdzv_id,
            host=host,
            max_restarts=self.max_restarts,
            local_addr=local_addr,
        )
        token = uuid.uuid4().hex
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        if not self.share_store:  # a store per round: see `elastic_loss`
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        env.update({MARKER: token, "LOGLEVEL": "INFO"})
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=self.workdir,
            start_new_session=True,
            errors="replace",
        )
        node = Node(name, proc, token)
        node.reader = threading.Thread(target=self._read, args=(node,), daemon=True)
        node.reader.start()
        self.nodes.append(node)
        return node

    def _read(self, node: Node) -> None:
        assert node.proc.stdout is not None
        for line in node.proc.stdout:
            with self._new_line:
                node.lines.append((time.monotonic(), line.rstrip("\n")))
                self._new_line.notify_all()
        with self._new_line:
            self._new_line.notify_all()

    def lines(self) -> list[tuple[float, str, str]]:
        """(time since start, node, line) of every node, in the order they arrived."""
        with self._new_line:
            out = [(t - self.t0, n.name, line) for n in self.nodes for t, line in n.lines]
        return sorted(out, key=lambda x: x[0])

    def wait_for(
        self,
        pattern: str,
        *,
        since: float = 0.0,
        timeout_s: float = 60.0,
        while_all_run: bool = False,
    ) -> float:
        """Wait for a line matching ``pattern`` that arrived after ``since`` (seconds from
        the start); return its time. `TimeoutError` when none came; with ``while_all_run``,
        `NodeExited` as soon as any agent has exited without it."""
        regex, deadline = re.compile(pattern), time.monotonic() + timeout_s
        with self._new_line:
            while True:
                for t, _, line in self.lines():
                    if t >= since and regex.search(line):
                        return t
                gone = [n.name for n in self.nodes if n.proc.poll() is not None]
                if while_all_run and gone:
                    raise NodeExited(f"node {', '.join(gone)} exited before {pattern!r}")
                left = deadline - time.monotonic()
                if left <= 0 or len(gone) == len(self.nodes):
                    taken = any("EADDRINUSE" in line for _, _, line in self.lines())
                    raise TimeoutError(
                        f"no line matching {pattern!r} within {timeout_s} s"
                        + (f"; node a could not listen on port {self.port}" if taken else "")
                    )
                self._new_line.wait(min(left, 0.5))

    def kill(self, node: Node) -> float:
        """SIGKILL the node's agent and its worker (found before the kill, by pid); return
        the time, in seconds from the start."""
        pids = [node.proc.pid, *descendants(node.proc.pid)]
        node.killed_at = time.monotonic() - self.t0
        signal_all(pids, signal.SIGKILL)
        return node.killed_at

    def wait(self, timeout_s: float) -> list[int | None]:
        """Wait for every agent still running to exit; their exit codes (None: killed here
        on the timeout, or killed by `kill`)."""
        deadline = time.monotonic() + timeout_s
        codes: list[int | None] = []
        for node in self.nodes:
            try:
                code: int | None = node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            codes.append(None if node.killed_at is not None else code)
        return codes

    def close(self) -> None:
        """Kill every process any node started (and its output readers end)."""
        for node in self.nodes:
            if node.proc.poll() is None:
                kill_run(node.proc.pid, node.token)
            signal_all(marked(node.token), signal.SIGKILL)  # orphans that outlived an agent
            node.proc.wait()
            if node.reader is not None:
                node.reader.join(timeout=5)


def rank0_attempts(lines: Sequence[str]) -> list[dict[str, int]]:
    """One ``{"world", "resumed_from"}`` per start of rank 0, in order (rank 0 belongs to
    every attempt, whichever node it runs on)."""
    out: list[dict[str, int]] = []
    for line in lines:
        if (m := _START.match(line)) is not None:
            out.append({"world": int(m.group(1)), "resumed_from": -1})
        elif (m := _RESUME.match(line)) is not None and out:
            out[-1]["resumed_from"] = int(m.group(1) or 0)
    return [a for a in out if a["resumed_from"] >= 0]  # an attempt that died before loading


def trained_once(
    sample_log: str | os.PathLike[str], attempts: Sequence[dict[str, int]], samples: int
) -> dict[str, Any]:
    """The samples the final model was trained on, by epoch, from ``--sample-log`` files.

    A killed attempt's steps after its last checkpoint are trained again by the next one, and
    a rank that is gone leaves lines for steps the smaller world replayed. So step S counts as
    trained by the last attempt that resumed before S (``attempts``, from `rank0_attempts`):
    its world W says which files hold S's samples (ranks below W), and each of those files'
    last line for S is that attempt's. Steps in order, ranks in order, give the sampler's
    stream; its positions past ``samples`` are the tail padding of `refimpl.data`'s
    ``tail="pad"`` (repeats that fill the epoch's last global batch), counted apart.

    Returns ``{"epochs": {epoch: Counter(index)}, "padding": {epoch: n}, "ranks": {step: W}}``.
    """
    last: dict[int, dict[int, tuple[int, list[int]]]] = {}  # rank -> step -> (epoch, indices)
    base = Path(sample_log)
    for path in base.parent.glob(base.name + ".rank*"):
        rank = int(path.name.rsplit("rank", 1)[1])
        for line in path.read_text().splitlines():
            step, epoch, *indices = map(int, line.split())
            last.setdefault(rank, {})[step] = (epoch, indices)
    streams: dict[int, list[int]] = {}
    ranks: dict[int, int] = {}
    for step in sorted({s for by_step in last.values() for s in by_step}):
        world = [a["world"] for a in attempts if a["resumed_from"] < step][-1]
        ranks[step] = world
        for rank in range(world):
            epoch, indices = last[rank][step]
            streams.setdefault(epoch, []).extend(indices)
    return {
        "epochs": {e: Counter(s[:samples]) for e, s in streams.items()},
        "padding": {e: len(s[samples:]) for e, s in streams.items()},
        "ranks": ranks,
    }


def _excerpt(run: TwoNodes, keep: Sequence[str]) -> list[str]:
    """``t=SECONDS node: line`` for the lines that contain one of ``keep``; an agent's line
    without its logging prefix and without the interpreter's path (" of binary: ...")."""

    def short(line: str) -> str:
        return line.split("] ", 1)[-1].split(" of binary: ")[0] if line[:1] in "IWE" else line

    return [
        f"t={t:5.1f}s {name}: {short(line)}"
        for t, name, line in run.lines()
        if any(k in line for k in keep)
    ]


AGENT_KEEP = ("attempts left", "new nodes", "as rank", "Worker group FAILED", "failed (exitcode")
TRAINER_KEEP = (
    "[rank0] start",
    "[rank0] resumed",
    "[rank0] no checkpoint",
    "injected fault",
    "[rank0] done",
    "[rank1] start",
)


def fixed_restart(
    workdir: str | os.PathLike[str], train_args: Sequence[str], *, timeout_s: float = 120.0
) -> dict[str, Any]:
    """A fixed ``--nnodes=2`` job of two agents, run to its end (``train_args`` bring the
    fault, e.g. ``--fail-at-step 7 --fail-rank 1``): exit codes, rank 0's attempts,
    excerpts of the log and the seconds it took."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    with TwoNodes(work, train_args, nnodes="2") as run:
        run.start("a", host=True)
        run.start("b", host=False)
        codes = run.wait(timeout_s)
        seconds = time.monotonic() - run.t0
    texts = [line for _, _, line in run.lines()]
    return {
        "exit": codes,
        "attempts": rank0_attempts(texts),
        "seconds": round(seconds, 1),
        "log": _excerpt(run, (*AGENT_KEEP, *TRAINER_KEEP)),
        "lines": texts,
    }


def _lose_and_regrow(
    run: TwoNodes, kill_after_step: int, regrow: bool, timeout_s: float, out: dict[str, Any]
) -> None:
    run.start("a", host=True)
    b = run.start("b", host=False)
    two = run.wait_for(r"^\[rank0\] start: world 2", timeout_s=timeout_s)
    run.wait_for(rf"^\[rank0\] step {kill_after_step} loss", since=two, timeout_s=timeout_s)
    killed = run.kill(b)
    failed = run.wait_for("Worker group FAILED", since=killed, timeout_s=timeout_s)
    one = run.wait_for(r"^\[rank0\] start: world 1", since=killed, timeout_s=timeout_s)
    if regrow:  # now that the smaller world's workers run, a new node waits for a new round
        run.start("b", host=False)
        started = time.monotonic() - run.t0
    alone = run.wait_for(r"^\[rank0\] step \d+ loss", since=one, timeout_s=timeout_s)
    out["shrink"] = {
        "seen_s": round(failed - killed, 1),
        "worker_s": round(one - killed, 1),
        "step_s": round(alone - killed, 1),
    }
    if regrow:
        seen = run.wait_for("new nodes", since=started, timeout_s=timeout_s)
        again = run.wait_for(r"^\[rank0\] start: world 2", since=started, timeout_s=timeout_s)
        first = run.wait_for(r"^\[rank0\] step \d+ loss", since=again, timeout_s=timeout_s)
        out["grow"] = {
            "seen_s": round(seen - started, 1),
            "worker_s": round(again - started, 1),
            "step_s": round(first - started, 1),
        }


def elastic_loss(
    workdir: str | os.PathLike[str],
    train_args: Sequence[str],
    *,
    kill_after_step: int,
    regrow: bool = True,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """An elastic ``--nnodes=1:2`` job loses node ``b`` (agent and worker SIGKILLed) once
    rank 0 has logged ``kill_after_step`` at world 2; with ``regrow``, ``b`` is started
    again once the job trains alone. Returns exit codes, rank 0's attempts, the seconds from
    the kill to the first step at world 1 (shrink) and from ``b``'s new start to the first
    step at world 2 again (grow), and log excerpts."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    with TwoNodes(work, train_args, nnodes="1:2", share_store=not regrow) as run:
        try:
            _lose_and_regrow(run, kill_after_step, regrow, timeout_s, out)
        except TimeoutError as e:  # said in the result, with the log so far
            out["error"] = str(e)
        out["exit"] = run.wait(5 if "error" in out else timeout_s)
        out["seconds"] = round(time.monotonic() - run.t0, 1)
    texts = [line for _, _, line in run.lines()]
    keep = (*AGENT_KEEP, *TRAINER_KEEP, "[rank0] step")
    return {**out, "attempts": rank0_attempts(texts), "log": _excerpt(run, keep), "lines": texts}


STORE_HOST_ADDRS = {"b": "127.0.0.1", "c": "127.0.0.2", "a": "127.0.0.3"}
"""`lose_store_host`'s ``--local-addr`` per node. Node ranks are the participants sorted by
(address, pid), so ``b`` is rank 0 of the first round, and with torchrun's shared store its
agent serves the workers' store; ``a`` serves the rendezvous store (``is_host=1``)."""


def _worker_store(node: Node, old: set[int], deadline: float) -> tuple[int, str]:
    """The pid of ``node``'s worker not in ``old`` and the ``MASTER_ADDR:MASTER_PORT`` its
    agent gave it; `TimeoutError` if none appears before ``deadline``."""
    while time.monotonic() < deadline:
        for pid in workers(node.proc.pid).values():
            addr, port = env_of(pid, "MASTER_ADDR"), env_of(pid, "MASTER_PORT")
            if pid not in old and addr and port:
                return pid, f"{addr}:{port}"
        time.sleep(0.05)
    raise TimeoutError(f"node {node.name}: no new worker appeared")


def _listening(address: str) -> bool:
    """Whether anything accepts a TCP connection at ``HOST:PORT`` now."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def lose_store_host(
    workdir: str | os.PathLike[str],
    train_args: Sequence[str],
    *,
    share_store: bool,
    kill_after_step: int,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """An elastic ``--nnodes=2:3`` job of three agents loses node ``b``, rank 0 of the first
    round (`STORE_HOST_ADDRS`), once rank 0 has logged ``kill_after_step`` at world 3.

    Reads, from ``/proc``, the store address (``MASTER_ADDR:MASTER_PORT``) each agent gave
    its worker in the first round and in the round after the loss, and whether anything
    listens there. With ``share_store`` (torch's default) it stops the job as soon as the
    survivors' new workers exist (what they were handed is the result); without it
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) it lets the job run to its end.

    Returns ``{"before": {node: address}, "after": {node: address}, "listening": {node: bool},
    "exit": [a, b, c] exit codes (None: stopped or killed here), "attempts", "seconds",
    "log"}``, and
    ``"error"`` (with the log so far) when an expected line or worker did not come within
    ``timeout_s``.

    An agent that exits before the first round forms (torch's rendezvous, under a heavy
    load, once closed the store's connection to a joining agent: ``DistNetworkError`` in
    ``RendezvousStoreInfo.build``) has nothing to do with the loss shown here: the job is then
    started again once, in an emptied ``workdir``, and ``"start_retries"`` counts it.
    """
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    out = _lose_store_host_once(work, train_args, share_store, kill_after_step, timeout_s)
    if not out.pop("start_failed", False):
        return {**out, "start_retries": 0}
    shutil.rmtree(work)
    work.mkdir(parents=True)
    out = _lose_store_host_once(work, train_args, share_store, kill_after_step, timeout_s)
    out.pop("start_failed", None)  # a second failed start is an error like any other
    return {**out, "start_retries": 1}


def _lose_store_host_once(
    work: Path,
    train_args: Sequence[str],
    share_store: bool,
    kill_after_step: int,
    timeout_s: float,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with TwoNodes(work, train_args, nnodes="2:3", share_store=share_store) as run:
        nodes = {
            name: run.start(name, host=name == "a", local_addr=STORE_HOST_ADDRS[name])
            for name in ("a", "b", "c")
        }
        deadline = time.monotonic() + timeout_s
        try:
            three = run.wait_for(
                r"^\[rank0\] start: world 3", timeout_s=timeout_s, while_all_run=True
            )
            run.wait_for(
                rf"^\[rank0\] step {kill_after_step} loss", since=three, timeout_s=timeout_s
            )
            first = {n: _worker_store(node, set(), deadline) for n, node in nodes.items()}
            out["before"] = {n: address for n, (_, address) in first.items()}
            run.kill(nodes["b"])
            after = {n: _worker_store(nodes[n], {first[n][0]}, deadline) for n in ("a", "c")}
            out["after"] = {n: address for n, (_, address) in after.items()}
            if not share_store:  # the store is the new rank 0 worker's: once it has started
                run.wait_for(r"^\[rank0\] start: world 2", timeout_s=timeout_s)
            out["listening"] = {n: _listening(address) for n, address in out["after"].items()}
            if not share_store:
                out["exit"] = run.wait(max(1.0, deadline - time.monotonic()))
        except NodeExited as e:  # only the first round waits with while_all_run
            out["error"], out["start_failed"] = str(e), True
        except TimeoutError as e:  # said in the result, with the log so far
            out["error"] = str(e)
        out.setdefault("exit", [None, None, None])  # stopped here (close kills what is left)
        out["seconds"] = round(time.monotonic() - run.t0, 1)
    texts = [line for _, _, line in run.lines()]
    keep = (*AGENT_KEEP, *TRAINER_KEEP)
    return {**out, "attempts": rank0_attempts(texts), "log": _excerpt(run, keep), "lines": texts}
