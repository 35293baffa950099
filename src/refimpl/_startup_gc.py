"""Start-up without the cyclic garbage collector, for the programs torchrun (re)starts.

A worker of `refimpl.train` or of the chaos toy trainers (`refimpl.demos.chaos_trainers`)
builds hundreds of thousands of long-lived objects that Python's cyclic collector tracks while
it starts: importing torch, then wrapping the model in ``DistributedDataParallel`` (torch 2.13's
``DistributedDataParallel.__init__`` reads a dynamo setting, distributed.py line 842, which
imports ``torch._dynamo`` and sympy). The collector walks them again and again while they are
built, and every restart pays for it again. `pause` turns it off until the model is wrapped;
`resume` then freezes them (``gc.freeze``: never walked again, they live as long as the
process). Chapter 11 ("What a restart costs") measures what it saves.

Only for a program's own start: `pause` does nothing unless its caller is ``__main__``, so a
module imported as a library (by tests, by `refimpl.launch.spawn`) leaves the collector alone.
"""

from __future__ import annotations

import gc

__all__ = ["pause", "resume"]

_paused = False


def pause(module_name: str) -> bool:
    """Turn the cyclic collector off if ``module_name`` is ``"__main__"`` (call it with
    ``__name__`` before importing torch) and it was on; return whether it did."""
    global _paused
    if module_name == "__main__" and gc.isenabled() and not _paused:
        gc.disable()
        _paused = True
    return _paused


def resume() -> None:
    """Once start-up's objects exist: freeze them and turn the collector back on, if `pause`
    turned it off (safe to call again, and when nothing was paused)."""
    global _paused
    if _paused:
        gc.freeze()
        gc.enable()
        _paused = False
