"""Who reads the socket: the one seam between the two modes.

A thread that needs something from the broker (a reply, a confirm, a queued callback)
registers an :class:`~drainer_amqp.sync.Awaitable` and calls ``reader.wait(it,
deadline)``. Everything else (waits, confirms, the inbox, the end of the connection) is
shared by both modes.

* Drainer mode: :class:`~drainer_amqp.drainer.Drainer` reads in its own thread; ``wait``
  only sleeps.
* Legacy mode: :class:`LockReader`. The waiting thread reads frames itself while it holds
  the transport lock, until its awaitable is ready, as stock py-amqp does. Whoever reads
  a frame dispatches it, so a thread may fill another thread's wait.
"""

from __future__ import annotations

import threading
from time import monotonic
from typing import TYPE_CHECKING, Protocol

from amqp.exceptions import AMQPError

from .sync import Awaitable

if TYPE_CHECKING:
    from .connection import Connection

__all__ = ["LockReader", "Reader"]


class Reader(Protocol):
    #: A caller's thread is blocked in a socket read that only the socket's shutdown can
    #: cut short (legacy mode). close() then tears down without the handshake.
    reading: bool

    def wait(self, awaitable: Awaitable, deadline: float | None, closing: bool = False) -> None:
        """Return once ``awaitable`` is ready; ``TimeoutError`` at ``deadline``. Raises
        the connection's reason if it ended (unless ``closing``: close() waits for
        CloseOk after the end)."""
        ...


class LockReader:
    """Legacy mode: the thread that holds the transport lock reads."""

    def __init__(self, connection: Connection) -> None:
        self._conn = connection
        self.reading = False  # set by the transport lock's holder around its read

    def wait(self, awaitable: Awaitable, deadline: float | None, closing: bool = False) -> None:
        conn = self._conn
        lock = conn.transport_lock
        while not awaitable.ready():
            if not closing:
                conn.raise_if_ended()
            remaining = None if deadline is None else max(deadline - monotonic(), 0.0)
            if not lock.acquire(timeout=-1 if remaining is None else remaining):
                raise TimeoutError()
            try:
                if awaitable.ready():
                    return  # another reader filled it while we waited for the lock
                if not closing:
                    conn.raise_if_ended()
                remaining = None if deadline is None else max(deadline - monotonic(), 0.0)
                self.reading = True
                conn.dispatching = threading.get_ident()
                try:
                    conn.blocking_read(remaining)  # at least one read, even at the deadline
                finally:
                    self.reading = False
                    conn.dispatching = None
            except TimeoutError:
                raise TimeoutError() from None
            except (OSError, AMQPError) as exc:
                conn.end(conn.as_connection_error(exc))
                if closing:
                    return
                raise conn.error_for_caller() from exc
            finally:
                lock.release()
            if deadline is not None and monotonic() >= deadline and not awaitable.ready():
                raise TimeoutError()
