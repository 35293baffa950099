"""train_accelerate_refimpl.py: train_accelerate.py ported to refimpl (chapter 12).

Run it under torchrun (Accelerate reads torchrun's variables; gloo on CPU)::

    torchrun --standalone --nproc-per-node=2 train_accelerate_refimpl.py --out out

Accelerate still prepares the model, the optimizer and the scheduler. The batches come
from a `refimpl.data.ResumableSampler` (the loader is not prepared: the sampler already
shards), and every ``--checkpointing-steps`` steps every rank captures its state and
rank 0 saves it as a verified ``out/checkpoints/step_N``; every start resumes from the
newest one that verifies. SIGTERM saves the step in progress and exits 0. ``final.pt``
holds the final weights (what the kill test compares).

``--trace FILE`` (a diagnosis aid, not part of the style) appends one line per process
and step: the step, a CRC of torch's global RNG state at the top of the step, the epoch
(where the original logs its shuffle's generator), and the samples of the batch.
"""

import argparse
import os
import time
import zlib
from contextlib import ExitStack

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset

from refimpl.checkpoint import save_checkpoint
from refimpl.data import ResumableSampler
from refimpl.launch import init_from_env
from refimpl.preemption import StopOnSigterm
from refimpl.trainstate import capture_every_rank, resume_every_rank


class RegressionDataset(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self, n: int = 64) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(5))
        self.y = self.x.sum(1, keepdim=True).cos()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def crc(t: torch.Tensor) -> str:
    return f"{zlib.crc32(t.numpy().tobytes()):08x}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpointing-steps", type=int, default=5)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--trace", default="")
    args = parser.parse_args()

    init_from_env(timeout_s=60)  # safe on torchrun's restarts (chapter 10)
    accelerator = Accelerator(cpu=True)
    set_seed(42)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.GELU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(32, 1),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    dataset = RegressionDataset()
    sampler = ResumableSampler(
        len(dataset),
        batch_size=4,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        seed=42,
    )
    # generator=: iter(loader) draws its base seed from it, not from the global RNG
    train_dataloader = DataLoader(
        dataset, batch_size=4, sampler=sampler, generator=torch.Generator()
    )
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 1 / (1 + 0.05 * s)
    )
    model, optimizer, lr_scheduler = accelerator.prepare(
        model, optimizer, lr_scheduler
    )

    checkpoints = os.path.join(args.out, "checkpoints")
    overall_step, starting_epoch = 0, 0
    # every rank: the newest good step, the same everywhere, each its own RNG,
    # the sampler's position
    resumed = resume_every_rank(
        checkpoints, model, optimizer, scheduler=lr_scheduler, sampler=sampler
    )
    if resumed is not None:
        accelerator.print(
            f"Resumed from checkpoint: {checkpoints} at step {resumed.step}"
        )
        overall_step, starting_epoch = resumed.step, resumed.epoch
    # SIGTERM: finish the step, save, exit 0
    preempt = ExitStack().enter_context(StopOnSigterm())

    for epoch in range(starting_epoch, args.epochs):
        model.train()
        sampler.set_epoch(epoch)  # a resumed epoch continues from the loaded position
        for x, y, ids in train_dataloader:
            if args.trace:
                with open(f"{args.trace}.rank{accelerator.process_index}", "a") as f:
                    f.write(
                        f"{overall_step + 1} {crc(torch.get_rng_state())} "
                        f"{epoch} {','.join(map(str, ids.tolist()))}\n"
                    )
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            accelerator.print(
                f"epoch {epoch} step {overall_step} loss {loss.item():.6f}"
            )
            # every rank: a signal to one stops all after this step
            stop = preempt.should_stop()
            if overall_step % args.checkpointing_steps == 0 or stop:
                state = capture_every_rank(
                    model,
                    optimizer,
                    scheduler=lr_scheduler,
                    sampler_state=sampler.state_dict(),
                    epoch=epoch,
                    step=overall_step,
                )
                if accelerator.is_main_process:
                    assert state is not None  # rank 0 holds what every rank captured
                    save_checkpoint(checkpoints, state, overall_step)
            if stop:
                accelerator.end_training()
                return
            time.sleep(args.step_sleep)

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        weights = accelerator.unwrap_model(model).state_dict()
        torch.save({"model": weights}, os.path.join(args.out, "final.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
