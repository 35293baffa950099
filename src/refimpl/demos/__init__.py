"""The book's demos: the workers a chapter's notebook spawns, fault harnesses and pictures.

Nothing here is part of the library a trainer imports (`refimpl.launch`, `refimpl.atomic`,
`refimpl.checkpoint`, ...), and no library module imports from here. Names here may change
with the chapters that use them.

- `refimpl.demos.ddp`: the workers of chapters 2-3 (``python -m refimpl.demos.ddp`` runs the
  MiniDDP-vs-DDP parity check)
- `refimpl.demos.sync`: the workers and timelines of chapter 4
- `refimpl.demos.faults`: the kill-the-saver harness behind chapter 5
  (``python -m refimpl.demos.faults --kills 500``)
"""
