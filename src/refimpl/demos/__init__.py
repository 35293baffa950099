"""The book's demos: the workers a chapter's notebook spawns, fault harnesses and pictures.

Nothing here is part of the library a trainer imports (`refimpl.launch`, `refimpl.atomic`,
`refimpl.checkpoint`, ...), and no library module imports from here. Names here may change
with the chapters that use them.

- `refimpl.demos.ddp`: chapter 2's models and core workers (``python -m refimpl.demos.ddp``
  runs the MiniDDP-vs-DDP parity check); `refimpl.demos.ddp_details`: chapter 2's details
  (buffers, ``no_sync``, ``Join``, the bucket rebuild); `refimpl.demos.buckets`: chapter 3's
  timelines and compression hooks
- `refimpl.demos.collectives`: chapter 1's exercise (a ring of blocking sends);
  `refimpl.demos.ddp_views`: chapter 2's hook-trace figure; `refimpl.demos.ddp_exercises`:
  chapter 2's exercises (no broadcast, ``no_sync`` on one rank)
- `refimpl.demos.sync`: the workers and timelines of chapter 4; `refimpl.demos.hangs`: its
  hang toolbox
- `refimpl.demos.sharded`, `refimpl.demos.sharded_runs`, `refimpl.demos.dcp_pitfalls`: chapters 8-9;
  `refimpl.demos.train`: chapter 10's runs of ``python -m refimpl.train``
- `refimpl.demos.chaos_trainers`, `refimpl.demos.chaos_runs`, `refimpl.demos.restarts`:
  chapter 10's kill tests; `refimpl.demos.reader_trainer`: the trainer it shows, written as a
  reader would; `refimpl.demos.multinode`: chapter 11's two-node and elastic runs on one
  machine; `refimpl.demos.porting`: chapter 12's nanoGPT-style script, its
  port to refimpl, and the kill test on both
- `refimpl.demos.faults`: the kill-the-saver harness behind chapter 5
  (``python -m refimpl.demos.faults --kills 500``); `refimpl.demos.io_faults`: its injected
  I/O errors, flipped bits and object-store renames
- `refimpl.demos.resume`: chapter 6's lost/repeated counts and resume-equivalence runs;
  `refimpl.demos.loader_state`: what a `DataLoader` holds (position, worker seeds, streams)
- `refimpl.demos.diagrams`: the conceptual diagrams under ``book/figures/diagrams``, one
  function per picture (``python -m refimpl.demos.diagrams`` regenerates them)
- `refimpl.demos.slider_figure`: figures with sliders drawn in advance for a grid of values,
  linked in the browser, so they work in the HTML book as well as in JupyterLab
"""
