"""``python -m refimpl.train`` (torchrun's ``-m refimpl.train``): `refimpl.train.main`."""

# ruff: noqa: E402 -- the collector is paused (below) before torch is imported
import sys

from refimpl import _startup_gc

# Every (re)start runs without the cyclic collector until the model is wrapped (the module
# says why); only here, where this process is the program.
_startup_gc.pause(__name__)

from refimpl.train import main

sys.exit(main())
