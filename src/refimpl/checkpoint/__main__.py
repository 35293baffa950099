"""``python -m refimpl.checkpoint``: the command line that reads both checkpoint formats.

It lives in `refimpl._checkpoint_cli`, which imports `refimpl.sharded` too; only running the
command imports it, so ``import refimpl.checkpoint`` stays free of DCP.
"""

from __future__ import annotations

import sys

from refimpl._checkpoint_cli import main

if __name__ == "__main__":
    sys.exit(main())
