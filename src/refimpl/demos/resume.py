"""Chapter 6's workers: counting lost/repeated samples, and resume-equivalence runs.

`minimind_draws` replays the step conversion a popular small-LLM trainer (MiniMind) does when
the number of GPUs changes (``step * old_ws // new_ws`` per-rank steps, skipped with a
batch-skipping sampler over a `DistributedSampler`); `resumable_draws` does the same save and
resume with `refimpl.data.ResumableSampler`. `count_lost_repeated` says how many samples of
the epoch were never drawn or drawn twice (tail padding not counted). `train` is the spawned
worker of the resume-equivalence runs; `stateful_dataloader_resume` runs torchdata's
``StatefulDataLoader`` on simulated ranks. `loader_stop_resume` stops and resumes one
simulated rank's epoch under a ``DataLoader`` with worker processes, saving the position
three ways (the trainer's batch count, the sampler's own count, ``StatefulDataLoader``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from refimpl.checkpoint import load_latest, save_checkpoint
from refimpl.data import ResumableSampler
from refimpl.device import rank_device
from refimpl.state import capture_rng, capture_state, restore_state

Draws = list[tuple[int, bool]]  # (sample index, is tail padding)


def _dist_draws(n: int, ws: int, rank: int, seed: int) -> Draws:
    if ws == 1:
        # MiniMind on one GPU has no process group, hence no DistributedSampler: it shuffles
        # with torch.randperm after setup_seed(42 + epoch), a different permutation.
        torch.manual_seed(42)
        return [(int(i), False) for i in torch.randperm(n)]
    data: Any = range(n)
    s: DistributedSampler[int] = DistributedSampler(
        data, num_replicas=ws, rank=rank, shuffle=True, seed=seed
    )
    # DistributedSampler pads its list to total_size by repeating its start, then takes
    # positions rank, rank + ws, ...: position >= n is padding.
    return [(i, rank + k * ws >= n) for k, i in enumerate(s)]


def minimind_draws(n: int, batch_size: int, old_ws: int, new_ws: int, step: int) -> Draws:
    """All draws of one epoch: ``step`` per-rank batches at ``old_ws``, then a resume at
    ``new_ws`` that skips ``step * old_ws // new_ws`` batches on every rank."""
    draws: Draws = []
    for r in range(old_ws):
        draws += _dist_draws(n, old_ws, r, 0)[: step * batch_size]
    new_step = step * old_ws // new_ws
    for r in range(new_ws):
        draws += _dist_draws(n, new_ws, r, 0)[new_step * batch_size :]
    return draws


def resumable_draws(n: int, batch_size: int, old_ws: int, new_ws: int, step: int) -> Draws:
    """The same save/resume with `ResumableSampler` (same per-rank batch, tail="pad")."""
    draws: Draws = []
    state: dict[str, int] = {}
    for r in range(old_ws):
        s = ResumableSampler(n, batch_size=batch_size, rank=r, world_size=old_ws)
        pos = list(s.positions())[: step * batch_size]
        perm = s.permutation().tolist()
        draws += [(perm[p % n], s.is_padding(p)) for p in pos]
        state = s.state_dict(batches_done=min(step, len(s) // batch_size))
    for r in range(new_ws):
        s = ResumableSampler(n, batch_size=batch_size, rank=r, world_size=new_ws)
        s.load_state_dict(state)
        pos = list(s.positions())
        draws += [(int(i), s.is_padding(p)) for p, i in zip(pos, s, strict=True)]
    return draws


def count_lost_repeated(n: int, draws: Draws) -> tuple[int, int]:
    """(samples of ``range(n)`` never drawn, extra draws of samples already drawn)."""
    real = Counter(i for i, pad in draws if not pad)
    return n - len(real), sum(c - 1 for c in real.values())


def lost_repeated_table(
    n: int, batch_size: int, cases: list[tuple[int, int]], steps: list[int]
) -> list[dict[str, Any]]:
    """One row per (A→B, step): MiniMind's and ResumableSampler's lost/repeated counts."""
    rows = []
    for a, b in cases:
        for step in steps:
            ml, mr = count_lost_repeated(n, minimind_draws(n, batch_size, a, b, step))
            rl, rr = count_lost_repeated(n, resumable_draws(n, batch_size, a, b, step))
            rows.append(
                {"A→B": f"{a}→{b}", "step": step, "minimind lost": ml,
                 "minimind repeated": mr, "resumable lost": rl, "resumable repeated": rr}
            )  # fmt: skip
    return rows


def _model(dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and every world size
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(32, 1)
    )


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(n, 1, generator=g)


def train(cfg: dict[str, Any]) -> dict[str, Any]:
    """Spawned worker: train ``cfg["steps"]`` steps (from a checkpoint if ``cfg["resume"]``),
    stopping and saving at ``cfg["stop_at"]`` if set. Returns the per-step global-mean
    losses, the global sample order and (rank 0) the final flattened parameters.

    cfg keys: n, batch_size (per rank), steps, ckpt_dir, stop_at, resume, dropout,
    restore_optimizer, restore_rng.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)  # per-rank dropout stream: part of the state to restore
    model = DDP(_model(cfg.get("dropout", 0.0)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu")
    sampler = ResumableSampler(cfg["n"], batch_size=cfg["batch_size"], rank=rank, world_size=ws)
    start = 0
    if cfg.get("resume"):
        found = load_latest(cfg["ckpt_dir"], map_location=rank_device())
        assert found is not None, f"rank {rank}: no checkpoint in {cfg['ckpt_dir']}"
        state = found[1]
        if not cfg.get("restore_rng", True):
            state = {**state, "rng": None}
        info = restore_state(
            state, model, opt if cfg.get("restore_optimizer", True) else None,
            scheduler=sched, scaler=scaler, rank=rank, world_size=ws,
        )  # fmt: skip
        if info["world_size"] != ws:
            torch.manual_seed(100 + rank)  # per-rank RNG cannot map across world sizes
        sampler.load_state_dict(info["sampler"])
        start = info["step"]
    x, y = _data(cfg["n"])
    it, losses, order = iter(sampler), [], []
    stop = cfg.get("stop_at") or cfg["steps"]
    for _ in range(start, stop):
        idx = torch.tensor([next(it) for _ in range(cfg["batch_size"])])
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        scaler.step(opt)
        scaler.update()
        sched.step()
        gathered = [torch.zeros_like(idx) for _ in range(ws)]
        dist.all_gather(gathered, idx)
        order += torch.cat(gathered).tolist()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((mean / ws).item())
    if cfg.get("stop_at"):
        rngs: list[Any] = [None] * ws
        dist.all_gather_object(rngs, capture_rng())
        done = stop - start
        state = capture_state(
            model, opt, scheduler=sched, scaler=scaler, rng=rngs, step=stop, world_size=ws,
            sampler_state=sampler.state_dict(batches_done=done),
        )  # fmt: skip
        if rank == 0:
            save_checkpoint(cfg["ckpt_dir"], state, step=stop)
        dist.barrier()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"losses": losses, "order": order, "params": params if rank == 0 else None}


def stateful_dataloader_resume(
    n: int, batch_size: int, old_ws: int, new_ws: int, step: int, num_workers: int = 0
) -> tuple[int, int]:
    """torchdata's StatefulDataLoader over a DistributedSampler on simulated ranks: save each
    rank's loader state after ``step`` batches at ``old_ws``, resume at ``new_ws`` (rank r
    loads old rank ``r % old_ws``'s state: there is no other to give it). Returns
    (lost, repeated); pick ``n`` divisible by both world sizes (no sampler padding)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader(ws: int, r: int) -> Any:
        data: Any = range(n)
        s: DistributedSampler[int] = DistributedSampler(
            data, num_replicas=ws, rank=r, shuffle=True, seed=0
        )
        return StatefulDataLoader(
            list(range(n)), batch_size=batch_size, sampler=s, num_workers=num_workers
        )

    draws: Draws = []
    states = []
    for r in range(old_ws):
        dl = loader(old_ws, r)
        it = iter(dl)
        for _ in range(step):
            draws += [(int(i), False) for i in next(it)]
        states.append(dl.state_dict())
        del it
    for r in range(new_ws):
        dl = loader(new_ws, r)
        dl.load_state_dict(states[r % old_ws])
        for batch in dl:
            draws += [(int(i), False) for i in batch]
    return count_lost_repeated(n, draws)


def loader_stop_resume(
    dataset: Dataset[Any],
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    stop_after: int,
    save: Literal["batches_done", "sampler_count", "stateful"] = "batches_done",
    num_workers: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """One simulated rank's epoch through a loader with worker processes, run three times:
    uninterrupted; stopped after ``stop_after`` consumed batches, saving the position; and
    resumed from it in a fresh loader and sampler. ``save`` picks what is saved: the trainer's
    count, ``sampler.state_dict(batches_done=stop_after)``; the sampler's own count of indices
    handed out, ``sampler.state_dict()`` (wrong under prefetching); or torchdata's
    ``StatefulDataLoader.state_dict()`` (the loader is then a ``StatefulDataLoader``, which
    stores the sampler's ``state_dict()`` as it was when each batch was sent to a worker).
    ``dataset`` yields 1-tuples of a number (a ``TensorDataset``). Returns the batches, as
    lists, of the uninterrupted run (``"full"``), the stopped one (``"first"``) and the
    resumed one (``"rest"``), the saved state (``"saved"``) and the sampler's own state at the
    save (``"sampler_ahead"``, where its iterator had got to)."""
    n = len(dataset)  # type: ignore[arg-type]

    def fresh() -> tuple[ResumableSampler, Any]:
        s = ResumableSampler(n, batch_size=batch_size, rank=rank, world_size=world_size, seed=seed)
        if save == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            return s, StatefulDataLoader(
                dataset, batch_size=batch_size, sampler=s, num_workers=num_workers
            )
        return s, DataLoader(dataset, batch_size=batch_size, sampler=s, num_workers=num_workers)

    def listed(batch: Any) -> list[int]:
        return [int(i) for i in batch[0]]

    full = [listed(b) for b in fresh()[1]]
    sampler, loader = fresh()
    it = iter(loader)
    first = [listed(next(it)) for _ in range(stop_after)]
    ahead = sampler.state_dict()
    saved: dict[str, Any] = ahead
    if save == "batches_done":
        saved = sampler.state_dict(batches_done=stop_after)
    elif save == "stateful":
        saved = loader.state_dict()
    del it  # the "crash": workers and prefetched batches are gone
    sampler, loader = fresh()
    (loader if save == "stateful" else sampler).load_state_dict(saved)
    rest = [listed(b) for b in loader]
    return {"full": full, "first": first, "rest": rest, "saved": saved, "sampler_ahead": ahead}


def resume_experiment(
    ckpt_dir: str,
    *,
    ws_before: int = 2,
    ws_after: int = 2,
    global_batch: int = 8,
    steps: int = 12,
    crash_at: int = 5,
    dropout: float = 0.1,
    n: int = 96,
    restore_optimizer: bool = True,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Run ``steps`` uninterrupted at ``ws_before`` ranks, then the same run stopped at
    ``crash_at``, saved, and resumed at ``ws_after`` ranks with the same global batch.
    Returns both runs' per-step losses, sample orders and final parameters."""  # fmt: skip
    from refimpl.launch import spawn

    def cfg(ws: int, **kw: Any) -> dict[str, Any]:
        return {"n": n, "batch_size": global_batch // ws, "steps": steps, "dropout": dropout,
                "ckpt_dir": ckpt_dir, **kw}  # fmt: skip

    full = spawn(train, ws_before, cfg(ws_before), timeout_s=120)[0]
    first = spawn(train, ws_before, cfg(ws_before, stop_at=crash_at), timeout_s=120)[0]
    second = spawn(
        train, ws_after,
        cfg(ws_after, resume=True, restore_optimizer=restore_optimizer, restore_rng=restore_rng),
        timeout_s=120,
    )[0]  # fmt: skip
    return {
        "full_losses": full["losses"], "resumed_losses": first["losses"] + second["losses"],
        "full_order": full["order"], "resumed_order": first["order"] + second["order"],
        "full_params": full["params"], "resumed_params": second["params"],
    }  # fmt: skip
