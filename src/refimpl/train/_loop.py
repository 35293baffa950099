"""The training loop of ``python -m refimpl.train`` (`refimpl.train.main`): build, restore,
train, save; the package's docstring says what it guarantees."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from refimpl import _startup_gc
from refimpl._system import proc
from refimpl.atomic import atomic_save
from refimpl.data import ResumableBatches, ResumableSampler
from refimpl.dirlock import DirLock
from refimpl.launch import init_from_env
from refimpl.preemption import StopOnSigterm
from refimpl.sync import barrier_safe
from refimpl.train._args import parse_args
from refimpl.train._backend import Backend, backend, saves
from refimpl.train._config import TrainConfig
from refimpl.train._hooks import Hooks
from refimpl.train._resume import refuse_fresh_start
from refimpl.train._schedule import make_scheduler
from refimpl.train._watchdog import Watchdog

__all__ = ["main", "make_data", "make_model"]


def make_model(seed: int, dropout: float = 0.1) -> torch.nn.Module:
    """The MLP that is trained: the same initial weights for a given seed, on every rank."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic regression dataset: ``n`` inputs of 16 features and noisy targets."""
    g = torch.Generator().manual_seed(seed + 12345)
    x = torch.randn(n, 16, generator=g)
    return x, torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.1 * torch.randn(n, 1, generator=g)


class _Log:
    """``[rankR] ...`` lines on stdout, each one ``write`` and flushed at once. Flushed: a rank
    that dies (``os._exit``, SIGKILL) loses what sits in Python's buffer, block-sized for a pipe
    or a file. One write: torchrun starts workers with ``python -u``, where ``print`` makes two
    (the text, then the newline) and the lines of ranks sharing a log get spliced together."""

    def __init__(self, rank: int, bar: Any = None, times: bool = False) -> None:
        self.rank, self.bar, self.times = rank, bar, times

    def __call__(self, message: str) -> None:
        stamp = f"@{time.time():.6f} " if self.times else ""
        line = f"[rank{self.rank}] {stamp}{message}\n"
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout, end="")  # above the bar, not through it
        else:
            sys.stdout.write(line)
        sys.stdout.flush()


def _load(
    config: TrainConfig,
    chosen: Backend,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    sampler: ResumableSampler,
    device: torch.device,
    log: _Log,
) -> int:
    """Restore the newest checkpoint on every rank; return its step (0 without one).

    Loading nothing where committed steps exist raises on every rank instead of returning 0:
    training from step 0 would overwrite them (`refimpl.train._resume`)."""
    skipped: list[str] = []

    def on_skip(step_dir: Path, why: str) -> None:
        skipped.append(f"{step_dir.name}: {why}")
        log(f"skipped {step_dir.name}: {why}")

    step = int(chosen.load(config, model, opt, sched, sampler, device, log, on_skip))
    if not step:
        # Every rank decides from its own listing; one all-gather makes them stop together.
        mine = refuse_fresh_start(config.ckpt_dir, config.sharded, skipped)
        found: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
        why = next((w for w in found if w), None)
        if why:
            raise RuntimeError(f"rank {dist.get_rank()}: {why}")
        log(f"no checkpoint in {config.ckpt_dir}: starting at step 0")
        return 0
    without = f" WITHOUT {'+'.join(config.no_restore)}" if config.no_restore else ""
    log(f"resumed from step_{step}{without}")
    return step


def _train(config: TrainConfig, rank: int, world: int, device: torch.device, log: _Log) -> int:
    """The loop: build, restore, train, save; return 0 when done or stopped by SIGTERM."""
    hooks = Hooks(config, rank, world, log)  # chapter 10's fault and debugging flags
    if world > 1:
        barrier_safe(timeout_s=config.save_timeout)  # creates the save-wait group, once, now
    chosen = backend(config)  # rank 0's file (DDP), or every rank's shard (FSDP2)
    model = chosen.wrap_model(make_model(config.seed, config.dropout), device)
    _startup_gc.resume()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr)
    sched = make_scheduler(opt, config.lr_schedule, config.warmup_steps, config.steps)
    torch.manual_seed(config.seed + 1000 * (rank + 1))  # this rank's dropout stream
    sampler = ResumableSampler(
        config.samples, batch_size=config.batch_size, rank=rank, world_size=world, seed=config.seed
    )
    x, y = (t.to(device) for t in make_data(config.samples, config.seed))
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log(f"start: world {world}, restart {restarts}, device {device}")
    step = _load(config, chosen, model, opt, sched, sampler, device, log)
    saver = saves(config, chosen, log)  # after the load: a restart's first save must not race
    watchdog = Watchdog(config.step_timeout)
    if log.bar is not None:
        log.bar.update(step)
    batches = ResumableBatches(sampler)  # epoch after epoch, from where the sampler stands
    stats = torch.zeros(2, device=device)
    with StopOnSigterm() as sigterm:
        while step < config.steps:
            hooks.step_start(step + 1)
            chosen.seed_step(config.seed, rank, step + 1)
            _, batch = next(batches)
            hooks.batch(step + 1, sampler.epoch, batch)
            with watchdog.guard("step"):  # a step stuck past --step-timeout ends this worker
                idx = torch.tensor(batch, device=device)
                loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
                sched.step()  # after opt.step: its last_epoch is the step count, saved with it
                step += 1
                # One all-reduce carries the loss and the stop flag: every rank learns that
                # some rank got SIGTERM after the same step, so they all stop together.
                stats[0], stats[1] = loss.detach(), float(sigterm.requested)
                dist.all_reduce(stats)
            stop = bool(stats[1].item() > 0)
            last = stop or step == config.steps
            if rank == 0 and (step % config.log_every == 0 or last):
                log(f"step {step} loss {stats[0].item() / world:.6f}")
            if log.bar is not None:
                log.bar.update(1)
            if step % config.save_every == 0 or last:
                with watchdog.guard("save"):
                    hooks.save_start(step)
                    # Saved after the step, nothing fetched ahead: the position after
                    # every batch handed out so far is where a resume starts.
                    saver.save(config, model, opt, sched, batches.state_dict(), step, log)
            if stop:
                saver.close()  # the step just saved must be committed before exit 0
                log(f"SIGTERM: stopped after step {step}, checkpoint saved; exit 0")
                return 0
            hooks.step_end()
    saver.close()  # the last step committed before the final weights say "done"
    if config.final_weights:
        weights = chosen.final_weights(model)  # a collective under FSDP2
        if rank == 0:
            atomic_save(weights, config.final_weights)
            log(f"final weights at step {step} written")
    barrier_safe()  # nobody leaves (and tears the group down) before rank 0 has written
    log(f"done: {step} steps")
    return 0


@record  # under torchrun: an exception's traceback goes into the failure summary
def main(argv: Sequence[str] | None = None) -> int:
    """Train as ``argv`` says (see `parse_args`); return 0 when done or stopped by SIGTERM.

    Runs under torchrun, alone (``python -m refimpl.train``: a world of one), or as a worker of
    `refimpl.launch.spawn` (``spawn(main, 2, ["--steps", "10"])``), whose group it reuses.
    """
    imported = time.time()
    config = TrainConfig.from_namespace(parse_args(argv))
    owns_group = not dist.is_initialized()
    info = init_from_env(timeout_s=config.pg_timeout)
    if config.log_times:  # chapter 11's restart cost: where the seconds after a kill go
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        _Log(info.rank, times=True)(
            f"timing: restart {attempt} process "
            f"{proc.start_time():.6f} imported "
            f"{imported:.6f} group {time.time():.6f}"
        )
    bar = None
    if info.rank == 0 and (
        config.progress == "always" or (config.progress == "auto" and sys.stderr.isatty())
    ):
        from tqdm import tqdm

        bar = tqdm(total=config.steps, desc="train", file=sys.stderr, dynamic_ncols=True)
    try:
        log = _Log(info.rank, bar, times=config.log_times)
        # One run per --ckpt-dir: rank 0 holds its lock until the end; a second run (or a
        # directory that cannot be written) is refused here, before anything is loaded.
        with DirLock(config.ckpt_dir):
            code = _train(config, info.rank, info.world_size, info.device, log)
    finally:
        _startup_gc.resume()  # if _train stopped before wrapping the model
        if bar is not None:
            bar.close()
    if owns_group:  # only after a clean finish: tearing down a broken NCCL group can hang
        dist.destroy_process_group()
    return code
