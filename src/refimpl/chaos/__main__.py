"""``python -m refimpl.chaos``: the kill test's command line (`refimpl.chaos.main`)."""

import sys

from refimpl.chaos import main

sys.exit(main())
