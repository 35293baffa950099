"""The collective timeout a process group was created with, read back from its backends."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["group_timeout"]


def group_timeout(group: Any = None) -> timedelta | None:
    """The timeout ``group`` (default: WORLD) was created with, or None if no backend says.

    torch keeps it in each backend's options: ``ProcessGroupGloo`` and ``ProcessGroupNCCL``
    both expose ``options._timeout``; a backend without options is skipped."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in pg._device_types:
        try:
            timeout = pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None
