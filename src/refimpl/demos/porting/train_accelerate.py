"""train_accelerate.py: a trainer in Hugging Face Accelerate's usual style (ch. 12).

Run it under torchrun (Accelerate reads torchrun's variables; gloo on CPU)::

    torchrun --standalone --nproc-per-node=2 train_accelerate.py --out out

As Accelerate's own checkpointing example does it: ``set_seed``,
``accelerator.prepare`` of the model, the optimizer, a shuffling ``DataLoader`` and the
scheduler; every ``--checkpointing-steps`` optimizer steps
``accelerator.save_state(out/checkpoints/step_N)`` on every process; a start that finds
a checkpoint ``load_state``s the newest (by creation time), works out the epoch and the
batches already trained from its step number, and skips them with
``accelerator.skip_first_batches``. ``final.pt`` holds the final weights (what the kill
test compares).

``--trace FILE`` (a diagnosis aid, not part of the style) appends one line per process
and step: the step, a CRC of torch's global RNG state at the top of the step, a CRC of
the shuffle's generator state, and the samples of the batch.
"""

import argparse
import os
import time
import zlib

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset


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

    accelerator = Accelerator(cpu=True)
    set_seed(42)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.GELU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(32, 1),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    train_dataloader = DataLoader(RegressionDataset(), batch_size=4, shuffle=True)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 1 / (1 + 0.05 * s)
    )
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )

    checkpoints = os.path.join(args.out, "checkpoints")
    overall_step, starting_epoch, resume_step = 0, 0, 0
    if os.path.isdir(checkpoints) and os.listdir(checkpoints):
        dirs = [os.path.join(checkpoints, d) for d in os.listdir(checkpoints)]
        dirs.sort(key=os.path.getctime)
        path = dirs[-1]  # the most recent checkpoint
        accelerator.print(f"Resumed from checkpoint: {path}")
        accelerator.load_state(path)
        overall_step = int(os.path.basename(path).replace("step_", ""))
        starting_epoch = overall_step // len(train_dataloader)
        resume_step = overall_step - starting_epoch * len(train_dataloader)

    shuffle = train_dataloader.batch_sampler.batch_sampler.sampler.generator
    for epoch in range(starting_epoch, args.epochs):
        model.train()
        if epoch == starting_epoch and resume_step:
            # skip the batches this epoch already trained
            active_dataloader = accelerator.skip_first_batches(
                train_dataloader, resume_step
            )
        else:
            active_dataloader = train_dataloader
        for x, y, ids in active_dataloader:
            if args.trace:
                with open(f"{args.trace}.rank{accelerator.process_index}", "a") as f:
                    f.write(
                        f"{overall_step + 1} {crc(torch.get_rng_state())} "
                        f"{crc(shuffle.get_state())} "
                        f"{','.join(map(str, ids.tolist()))}\n"
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
            if overall_step % args.checkpointing_steps == 0:
                accelerator.save_state(
                    os.path.join(checkpoints, f"step_{overall_step}")
                )
            time.sleep(args.step_sleep)

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        weights = accelerator.unwrap_model(model).state_dict()
        torch.save({"model": weights}, os.path.join(args.out, "final.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
