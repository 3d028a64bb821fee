"""kombu transports whose connections are :class:`drainer_amqp.Connection`.

Select one with ``transport="drainer_amqp:Transport"`` (kombu) or
``broker_transport = "drainer_amqp:Transport"`` (Celery), and switch the drainer on with
the transport option ``dedicated_drainer``. Importing this package also registers the
URL schemes ``drainer-amqp://`` and ``drainer-amqps://``, which survive kombu's failover
(``Connection.switch`` re-reads the transport from each URL's scheme).

When a link fails, every thread on the ``kombu.Connection`` reconnects through its own
``ensure()``; they converge on one live connection (docs/errors.md, "Many threads, one
reconnect"): reconnects of one ``kombu.Connection`` take turns, and kombu's cleanup
(``collect()``, a failover's ``switch()``) in a thread whose error came from another
connection than kombu's current one leaves that live one alone (kombu forgets it; the
thread's next reconnect takes it up again). Either, while kombu handles a recoverable
error of the connection itself, ends it as failed, so the other threads on it retry.

kombu's Hub (the Celery worker's loop), in drainer mode: the Hub watches
:meth:`Connection.inbox_fileno` and runs queued callbacks in its thread; it also watches
the socket and reads it in its thread, as stock's Hub does, while no other thread waits
on the connection (:meth:`Connection.watch_in_event_loop`; kombu 5.7+): one thread
reads and runs the deliveries, without a hand-over between two.
The threading contract: docs/threading.md.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any

import kombu
from amqp.exceptions import RecoverableConnectionError
from kombu.transport import TRANSPORT_ALIASES, pyamqp

from .connection import Connection as DrainerConnection
from .errors import (
    ConnectionLost,
    handling_error_from_another,
    in_failover_after_another,
    in_kombu_cleanup,
    tag,
)

__all__ = ["SSLTransport", "Transport"]

#: kombu's Hub wakes when another thread schedules a callback on it (kombu 5.7+): only
#: then does its thread read the socket itself. Before, Celery's threads pool, which acks
#: that way, waits for the Hub's next wake-up, and a Hub that read a whole prefetch
#: window at once has nothing to wake it but its poll's timeout (up to 10 s).
_HUB_WAKES = tuple(kombu.VERSION[:2]) >= (5, 7)

_live_lock = threading.Lock()  # guards _live and _reconnect_locks
#: Each kombu.Connection's live connection, and the lock its reconnects take in turn.
#: Weak both ways: a connection refers to its kombu.Connection (``client``), so a strong
#: value would keep every kombu.Connection ever connected alive.
_live: weakref.WeakKeyDictionary[Any, weakref.ref[DrainerConnection]] = weakref.WeakKeyDictionary()
_reconnect_locks: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()


def _after_fork_in_child() -> None:
    global _live_lock, _reconnect_locks
    _live_lock = threading.Lock()  # a parent thread may have held it, or a reconnect lock
    _reconnect_locks = weakref.WeakKeyDictionary()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Transport(pyamqp.Transport):
    """kombu's py-amqp transport, with :class:`drainer_amqp.Connection` connections."""

    Connection = DrainerConnection

    def establish_connection(self) -> DrainerConnection:
        client = self.client
        if client is None:
            # Another thread's collect() detached this transport from its kombu
            # connection while this one reconnected: kombu's retry loop tries again.
            raise RecoverableConnectionError("reconnect raced a collect(); retry")
        with _live_lock:
            lock = _reconnect_locks.setdefault(client, threading.Lock())
        with lock:
            live = _live.get(client)
            current = live() if live is not None else None
            if current is not None and current.reason is None and current.connected:
                return current  # another thread of this kombu.Connection reconnected first
            if self.client is None:  # detached while this thread waited for the lock
                raise RecoverableConnectionError("reconnect raced a collect(); retry")
            try:
                connection: DrainerConnection = super().establish_connection()
            except Exception as exc:
                # Names the connection this attempt was to replace: a connection that
                # another thread opens after it is newer (see in_failover_after_another).
                tag(exc, current)
                raise
            # kombu's establish_connection copies self.client, which another thread's
            # collect() may have cleared while this one connected: the kombu connection
            # is the one this reconnect began for.
            connection.client = client
            with _live_lock:
                _live[client] = weakref.ref(connection)
            return connection

    def close_connection(self, connection: DrainerConnection) -> None:
        if in_kombu_cleanup():  # kombu's switch() or collect(), handling an error
            if in_failover_after_another(connection):
                return  # another thread's live connection: not this failover's to close
            self._fail_after_recoverable_error(connection)
        # Keeps connection.client: other threads' consumers and producers on it find
        # their kombu connection through it.
        connection.close()

    def _collect(self, connection: DrainerConnection | None) -> None:
        if connection is None:
            return
        if connection.reason is None and handling_error_from_another(connection):
            return  # stale: this thread's error came from a connection already replaced
        self._fail_after_recoverable_error(connection)
        connection.collect()

    def _fail_after_recoverable_error(self, connection: DrainerConnection) -> None:
        """kombu is cleaning up (``ensure()``'s ``collect()``, a failover's ``switch()``)
        while this thread handles a recoverable error of ``connection``: the other
        threads on it must see a failure and retry, not an intentional close."""
        error = sys.exc_info()[1]
        if connection.reason is None and isinstance(error, self.recoverable_connection_errors):
            lost = ConnectionLost(f"ended by kombu after a recoverable error: {error!r}")
            lost.__cause__ = error
            connection.end(lost)

    def register_with_event_loop(self, connection: DrainerConnection, loop: Any) -> None:
        if not connection.reader.owns_socket:
            return super().register_with_event_loop(connection, loop)
        loop.add_reader(connection.inbox_fileno(), self.on_readable, connection, loop)
        fd = connection.watch_in_event_loop(True) if _HUB_WAKES else None
        if fd is not None:
            loop.add_reader(fd, self._on_socket_readable, connection, loop, fd)

    def unregister_from_event_loop(self, connection: DrainerConnection, loop: Any) -> None:
        if connection.reader.owns_socket and connection.inbox.watched:
            loop.remove_reader(connection.inbox_fileno())
            fd = connection.watch_in_event_loop(False) if connection.loop_reads else None
            if fd is not None:  # descriptor 0 is a descriptor too
                loop.remove_reader(fd)
        return super().unregister_from_event_loop(connection, loop)

    def on_readable(self, connection: DrainerConnection, loop: Any) -> None:
        if not connection.reader.owns_socket:
            return super().on_readable(connection, loop)
        connection.run_pending_callbacks()

    def _on_socket_readable(self, connection: DrainerConnection, loop: Any, fd: int) -> None:
        if not connection.read_in_event_loop():
            loop.remove_reader(fd)


class SSLTransport(Transport, pyamqp.SSLTransport):
    """:class:`Transport` over TLS (``amqps``): kombu's ``pyamqp.SSLTransport``, with its
    TLS defaults, and drainer connections."""


TRANSPORT_ALIASES.setdefault("drainer-amqp", "drainer_amqp:Transport")
TRANSPORT_ALIASES.setdefault("drainer-amqps", "drainer_amqp:SSLTransport")
