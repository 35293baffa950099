"""`refimpl.guard`'s two exchange paths behind one interface: every rank's row to every rank,
over Unix datagram sockets on one host or with one gloo all-gather anywhere."""

from __future__ import annotations

from typing import Any, Protocol

from refimpl.guard._buffers import ROW, ExchangeBuffers
from refimpl.guard._host_exchange import HostExchange

__all__ = ["GlooAllGather", "HostDatagrams", "RowExchange", "connect"]


class RowExchange(Protocol):
    """Fills ``buffers.gathered_*`` with every rank's ``buffers.own_row``.

    `exchange` raises RuntimeError (`ExchangeFailed` on the host path) when not every rank
    came within ``timeout_s``; `withdraw` then makes sure a late peer cannot pass this call."""

    name: str  # "host" or "gloo": which path, for tests and reports

    def exchange(self, buffers: ExchangeBuffers, timeout_s: float) -> None: ...

    def withdraw(self) -> None: ...

    def close(self) -> None: ...


class GlooAllGather:
    """One all-gather in the guard's gloo group, called on the ProcessGroup itself:
    ``dist.all_gather``'s Python checks cost about as much as the collective. The group's own
    timeout bounds the wait."""

    name = "gloo"

    def __init__(self, pg: Any) -> None:
        self._pg = pg

    def exchange(self, buffers: ExchangeBuffers, timeout_s: float) -> None:
        """Every rank's row into ``buffers.gathered_row_tensors``."""
        self._pg.allgather([buffers.gathered_row_tensors], [buffers.own_row_tensor]).wait()

    def withdraw(self) -> None:
        """Nothing to withdraw: a failed gloo collective leaves no state behind."""

    def close(self) -> None:
        """Nothing to close: the group belongs to the guard."""


class HostDatagrams:
    """`HostExchange`: the rows over Unix datagram sockets, when every rank is on this host."""

    name = "host"

    def __init__(self, host: HostExchange) -> None:
        self.host = host

    def exchange(self, buffers: ExchangeBuffers, timeout_s: float) -> None:
        """Every rank's row into ``buffers.gathered_row_bytes``, waiting up to ``timeout_s``."""
        self.host.exchange(buffers.own_row_bytes, buffers.gathered_row_bytes, timeout_s)

    def withdraw(self) -> None:
        """A peer that comes late must not pass this call."""
        self.host.withdraw()

    def close(self) -> None:
        """Close this rank's socket."""
        self.host.close()


def connect(check_group: Any, pg: Any, *, host_exchange: bool) -> RowExchange:
    """The host path when ``host_exchange`` and every rank of ``check_group`` is on this host
    (decided alike on every rank), else the all-gather on ``pg``. Collective: every rank of
    the group calls it."""
    host = HostExchange.connect(check_group, ROW * 8, wanted=host_exchange)
    return GlooAllGather(pg) if host is None else HostDatagrams(host)
