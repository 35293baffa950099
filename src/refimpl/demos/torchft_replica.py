"""Chapter 13: one torchft replica group (one rank, gloo) training the book's model.

Run by `refimpl.demos.torchft_job`, one process per group, never by hand::

    python -m refimpl.demos.torchft_replica --replica 1 --replicas 3 --lighthouse http://... \\
        --steps 40 --out DIR

Each step: ``optimizer.zero_grad()`` joins the quorum (torchft's `OptimizerWrapper`; the
quorum is synchronous here, so a healing group has its peer's weights before its forward
pass), the batch is `refimpl.torchft_checkpoint.batch_for_step` of the committed step, DDP's
all-reduce goes through the Manager's fault-tolerant gloo group, and ``optimizer.step()``
steps only if ``should_commit()`` says the step was clean. Every line it prints is one
``write``, flushed: ``[replica R] step S participants P commit C t T`` per step (S the
committed step before it; T Unix time), ``[replica R] healed: step A -> B`` when a peer's
state replaced this group's, ``[replica R] resumed from step_N`` after a checkpoint load.
The process runs with no parent to answer to: it exits on its own after ``--timeout``.
"""

# No `from __future__ import annotations` here: DDP checks a comm hook's annotations at
# register time and refuses strings ("bucket annotation should be dist.GradBucket").
import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The replica's command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m refimpl.demos.torchft_replica")
    p.add_argument("--replica", type=int, required=True, help="this group's index")
    p.add_argument("--replicas", type=int, required=True, help="the most groups of the job")
    p.add_argument("--lighthouse", required=True, help="the Lighthouse's address")
    p.add_argument("--min-replicas", type=int, default=1, help="groups a step needs to commit")
    p.add_argument("--steps", type=int, default=40, help="committed steps to train")
    p.add_argument("--batch-size", type=int, default=8, help="samples per group per step")
    p.add_argument("--samples", type=int, default=240, help="size of the synthetic dataset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra work a step")
    p.add_argument("--out", required=True, help="directory for final weights")
    p.add_argument("--ckpt-dir", default=None, help="refimpl checkpoints (whole-job restarts)")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument(
        "--die-at-step",
        type=int,
        default=None,
        help="SIGKILL itself in step N, after its quorum and forward",
    )
    p.add_argument(
        "--hold",
        action="append",
        default=[],
        metavar="STEP:FILE",
        help="before step STEP, wait until FILE exists (the demo's gates; repeatable)",
    )
    p.add_argument(
        "--stop-file", default=None, help="if it exists at a step's start: the job is done, exit 0"
    )
    p.add_argument(
        "--stock-ddp",
        action="store_true",
        help="torchft's own DDP wrapper, without the comm hook fix (it crashes on a kill)",
    )
    p.add_argument("--ready-file", default=None, help="created once the Manager is up")
    p.add_argument("--op-timeout", type=float, default=10.0, help="torchft's collective timeout")
    p.add_argument("--timeout", type=float, default=300.0, help="exit 3 after this many seconds")
    return p.parse_args(argv)


def _say(replica: int, message: str) -> None:
    sys.stdout.write(f"[replica {replica}] {message}\n")
    sys.stdout.flush()


def _watchdog(replica: int, seconds: float) -> None:
    """Exit the process (code 3) after ``seconds``: no replica outlives a lost controller."""

    def fire() -> None:
        _say(replica, f"timeout: still running after {seconds:.0f} s; exiting")
        os._exit(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def _wait_for(path: str, replica: int, timeout: float) -> None:
    """Wait until ``path`` exists; ``{path}.held-{replica}`` says to the job that we wait."""
    Path(f"{path}.held-{replica}").touch()
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {replica}: {path} did not appear in {timeout:.0f} s")
        time.sleep(0.02)


def _ddp(manager: Any, model: Any) -> Any:
    """torchft's DistributedDataParallel with its comm hook's error path fixed (torchft 0.2.0).

    torchft's hook calls ``work.wait()`` and then asserts that the work's future exists. When
    the all-reduce fails (a peer SIGKILLed mid-step: gloo raises "Connection reset by peer"),
    ``wait()`` catches the error, reports it to the Manager and returns False, but the future
    was never created, so the assert fails and the AssertionError escapes from
    ``loss.backward()``: the survivor dies instead of discarding the step. Here a failed
    all-reduce returns the bucket unchanged: the Manager has the error, so ``should_commit()``
    refuses the step and the optimizer never sees those gradients.
    """
    import torch
    import torch.distributed as dist
    import torchft

    class DDP(torchft.DistributedDataParallel):  # type: ignore[misc]
        @staticmethod
        def _comm_hook(
            state: Any,
            bucket: dist.GradBucket,  # type: ignore[name-defined]  # DDP checks it is this class
        ) -> torch.futures.Future[torch.Tensor]:
            work = state.allreduce(bucket.buffer())
            if not work.wait():  # the error is reported: this step will not commit
                done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
                done.set_result(bucket.buffer())
                return done
            return work.get_future()._fut  # type: ignore[no-any-return]

    return DDP(manager, model)


def _stock_ddp(manager: Any, model: Any) -> Any:
    import torchft

    return torchft.DistributedDataParallel(manager, model)


def main(argv: Sequence[str] | None = None) -> int:
    """Train until the manager has committed ``--steps`` steps; write ``replicaR.pt``; 0."""
    args = parse_args(argv)
    _watchdog(args.replica, args.timeout)
    logging.getLogger("torchft").setLevel(logging.ERROR)
    import torch
    from torchft import Manager, Optimizer, ProcessGroupGloo

    from refimpl.atomic import atomic_save
    from refimpl.torchft_checkpoint import batch_for_step, load_ft_checkpoint, save_ft_checkpoint
    from refimpl.train import make_data, make_model

    torch.set_num_threads(1)
    # dropout 0: a healed group gets weights and optimizer, not the peer's RNG stream
    model = make_model(args.seed, dropout=0.0)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    store = torch.distributed.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False
    )  # this group's
    op = timedelta(seconds=args.op_timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=op),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replicas,
        use_async_quorum=False,  # heal before the forward pass: the batch follows the step
        timeout=op,
        quorum_timeout=timedelta(seconds=max(30.0, 3 * args.op_timeout)),
        connect_timeout=op,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"replica{args.replica}",
        hostname="127.0.0.1",
    )
    try:
        if args.ckpt_dir:
            found = load_ft_checkpoint(args.ckpt_dir, manager)
            if found is not None:
                load_state_dict(found[1])
                _say(args.replica, f"resumed from step_{found[0]}")
        ddp = _ddp(manager, model) if not args.stock_ddp else _stock_ddp(manager, model)
        opt = Optimizer(manager, inner)
        x, y = make_data(args.samples, args.seed)
        if args.ready_file:
            Path(args.ready_file).touch()
        holds: dict[int, list[str]] = {}
        for step_text, gate in (h.split(":", 1) for h in args.hold):
            holds.setdefault(int(step_text), []).append(gate)
        _say(args.replica, f"start pid {os.getpid()}")
        while manager.current_step() < args.steps:
            before = manager.current_step()
            if args.stop_file and os.path.exists(args.stop_file):
                _say(args.replica, f"stopped: the job finished without this group (step {before})")
                return 0
            for gate in holds.get(before, []):
                _wait_for(gate, args.replica, args.timeout)
            opt.zero_grad()  # the quorum; a group that is behind is healed from a peer here
            step = manager.current_step()
            if step != before:
                _say(args.replica, f"healed: step {before} -> {step}")
            idx = torch.tensor(
                batch_for_step(
                    step,
                    replica=args.replica,
                    replicas=args.replicas,
                    dataset_len=args.samples,
                    batch_size=args.batch_size,
                    seed=args.seed,
                )
            )
            loss = torch.nn.functional.mse_loss(ddp(x[idx]), y[idx])
            if args.die_at_step is not None and step == args.die_at_step:
                os.kill(os.getpid(), signal.SIGKILL)  # inside the step: the quorum has us
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            committed = manager.current_step() == step + 1
            _say(
                args.replica,
                f"step {step} participants {manager.num_participants()} "
                f"commit {int(committed)} t {time.time():.4f}",
            )
            if committed and args.ckpt_dir:
                saved = save_ft_checkpoint(
                    args.ckpt_dir, manager, state_dict(), every=args.save_every
                )
                if saved is not None:
                    _say(args.replica, f"saved step_{manager.current_step()}")
            if args.step_sleep:
                time.sleep(args.step_sleep)
        atomic_save(model.state_dict(), Path(args.out) / f"replica{args.replica}.pt")
        _say(args.replica, f"done: {manager.current_step()} steps")
    finally:
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
