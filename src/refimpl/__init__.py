"""refimpl: the reference implementation of *Distributed Training That Doesn't Hang or Lose Work*.

One concept per module; each matches a chapter of the book:

- `refimpl.launch`: start N ranks from a notebook or test, never hang (chapter 1)
- `refimpl.collectives`: collectives shown by hand, including a ring all-reduce (chapter 1)
- `refimpl.ddp`, `refimpl.buckets`: DDP rebuilt, bucket assignment as PyTorch does it (chapters 2-3)
- `refimpl.sync`: barriers that survive a slow rank-0 save, main_process_first (chapter 4)
- `refimpl.device`: which device a rank's tensors belong on, under gloo and NCCL alike
- `refimpl.atomic`, `refimpl.checkpoint`: atomic, durable, verified saves; safe loading (chapter 5)
- `refimpl.state`, `refimpl.data`: the whole training state, and a sampler that resumes
  exactly at any world size; random offsets (with replacement) resumable from one counter
  (chapter 6)
- `refimpl.guard`, `refimpl.metrics`, `refimpl.mixture`: named collectives that catch ranks
  disagreeing, metrics synced whatever keys each rank holds, the same dataset on every rank
  at each step (chapter 7)
- `refimpl.sharded`: committed, verified DCP checkpoints that load at any world size, and
  async saves (chapters 8-9)
- `refimpl.train`: ``python -m refimpl.train``, a fault-tolerant trainer for torchrun
  (chapter 10)
- `refimpl.preemption`: SIGTERM finishes the step, the trainer saves it and exits 0
  (chapter 10)
- `refimpl.chaos`: ``python -m refimpl.chaos``, the kill test for any trainer: kill it in
  several ways, restart, compare its output bit for bit with an untouched run (chapter 10)
- `refimpl.trainstate`: every rank's state (RNG included) captured into one file checkpoint
  and resumed collectively, the pieces an existing script needs to be ported (chapter 12)
- `refimpl.bench`: the book's benchmarks,
  ``python -m refimpl.bench {allreduce,ddp,guard,paced,reshard,save,torchft} --out DIR``

`refimpl.demos` holds the book's demos (the workers a chapter's notebook spawns, the fault
harnesses); the library never imports it.
"""

__version__ = "0.1.0"
