"""Chapter 6's workers: counting lost/repeated samples, and resume-equivalence runs.

`minimind_draws` replays the step conversion a popular small-LLM trainer (MiniMind) does when
the number of GPUs changes (``step * old_ws // new_ws`` per-rank steps, skipped with a
batch-skipping sampler over a `DistributedSampler`); `resumable_draws` does the same save and
resume with `refimpl.data.ResumableSampler`. `count_lost_repeated` says how many samples of
the epoch were never drawn or drawn twice (tail padding not counted). `minimind_sizes` is the
byte arithmetic of MiniMind's two checkpoint files. `train` is the spawned worker of the
resume-equivalence runs (`resume_experiment`); `ddp_gradient_at_float32_max` shows where
DDP divides by the world size. The loader-side demos are in `refimpl.demos.loader_state`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

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
                {
                    "A→B": f"{a}→{b}",
                    "step": step,
                    "minimind lost": ml,
                    "minimind repeated": mr,
                    "resumable lost": rl,
                    "resumable repeated": rr,
                }
            )
    return rows


def minimind_sizes(
    hidden: int = 512, layers: int = 8, heads: int = 8, kv_heads: int = 2, vocab: int = 6400
) -> dict[str, int]:
    """Tensor bytes of MiniMind's two checkpoint files, from its model's shapes.

    The defaults are minimind2-small (``model/model_minimind.py`` at commit e8484874: no
    biases, grouped-query attention, SwiGLU MLP of ``64 * ceil(int(8 * hidden / 3) / 64)``,
    RMSNorms, the embedding tied to ``lm_head``). ``lm_checkpoint`` casts each state-dict key
    with ``v.half()``, which copies the tied matrix once per key, so ``weights_fp16`` holds it
    twice. ``resume_fp32`` is the resume file at e8484874 (fp32 weights, tied once, and
    AdamW's two fp32 moments); ``resume_fp16`` the one since 5e1447b9 (the fp16 dict of the
    weights file, and the moments). ``torch.save`` adds framing and AdamW's step counters."""
    hd = hidden // heads
    inter = 64 * -(-int(hidden * 8 / 3) // 64)
    attention = hidden * heads * hd * 2 + hidden * kv_heads * hd * 2
    layer = attention + 3 * hidden * inter + 2 * hidden
    params = layers * layer + vocab * hidden + hidden  # + final norm; lm_head is the embedding
    keys = params + vocab * hidden  # the state dict lists the tied matrix under two keys
    return {
        "params": params,
        "weights_fp16": 2 * keys,
        "resume_fp32": 4 * params + 8 * params,
        "resume_fp16": 2 * keys + 8 * params,
    }


def ddp_gradient_at_float32_max() -> dict[str, float]:
    """Spawned worker: where DDP divides by the world size, shown by overflow.

    Every rank's gradient is 3e38 (float32's largest value is about 3.4e38). Summing first
    overflows to inf on 2 ranks and stays inf after the division; dividing first gives 3e38.
    Returns DDP's averaged gradient and a plain ``all_reduce`` sum of the same value divided
    by the world size afterwards."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        net.weight.fill_(1.0)
    DDP(net)(torch.full((1, 1), 3e38)).sum().backward()
    assert net.weight.grad is not None
    summed = torch.full((1,), 3e38)
    dist.all_reduce(summed)
    ws = dist.get_world_size()
    return {"ddp": net.weight.grad.item(), "sum_then_divide": (summed / ws).item()}


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
            state,
            model,
            opt if cfg.get("restore_optimizer", True) else None,
            scheduler=sched,
            scaler=scaler,
            rank=rank,
            world_size=ws,
        )
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
            model,
            opt,
            scheduler=sched,
            scaler=scaler,
            rng=rngs,
            step=stop,
            world_size=ws,
            sampler_state=sampler.state_dict(batches_done=done),
        )
        if rank == 0:
            save_checkpoint(cfg["ckpt_dir"], state, step=stop)
        dist.barrier()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"losses": losses, "order": order, "params": params if rank == 0 else None}


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
    Returns both runs' per-step losses, sample orders and final parameters."""
    from refimpl.launch import spawn

    def cfg(ws: int, **kw: Any) -> dict[str, Any]:
        return {
            "n": n,
            "batch_size": global_batch // ws,
            "steps": steps,
            "dropout": dropout,
            "ckpt_dir": ckpt_dir,
            **kw,
        }

    full = spawn(train, ws_before, cfg(ws_before), timeout_s=120)[0]
    first = spawn(train, ws_before, cfg(ws_before, stop_at=crash_at), timeout_s=120)[0]
    second = spawn(
        train,
        ws_after,
        cfg(ws_after, resume=True, restore_optimizer=restore_optimizer, restore_rng=restore_rng),
        timeout_s=120,
    )[0]
    return {
        "full_losses": full["losses"],
        "resumed_losses": first["losses"] + second["losses"],
        "full_order": full["order"],
        "resumed_order": first["order"] + second["order"],
        "full_params": full["params"],
        "resumed_params": second["params"],
    }
