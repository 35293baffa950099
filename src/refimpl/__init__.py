"""refimpl: the reference implementation of *Distributed Training That Doesn't Hang or Lose Work*.

One concept per module; each matches a chapter of the book:

- `refimpl.launch`: start N ranks from a notebook or test, never hang (chapter 1)
- `refimpl.collectives`: collectives shown by hand, including a ring all-reduce (chapter 1)
"""

__version__ = "0.1.0"
