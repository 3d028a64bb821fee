"""The errors this library raises.

Every thread that waits on a connection sees the same reason when it ends:

* ``ConnectionLost`` (and its subclasses) when the link failed. It is a py-amqp
  ``RecoverableConnectionError``, so kombu's ``ensure()``, ``autoretry`` and
  ``Producer.publish(retry=True)`` reconnect.
* ``ConnectionBlocked`` when a publish waited too long on a connection the broker has
  blocked (a memory or disk alarm). Recoverable, so kombu's ``ensure()`` treats it as a
  connection error: it collects (ends) the shared connection for every thread and
  reconnects (docs/errors.md).
* ``ConnectionClosedIntentionally`` after ``close()`` (or ``collect()`` of a healthy
  connection). It derives from nothing in the transport's ``connection_errors``,
  ``recoverable_connection_errors`` or ``channel_errors``, so kombu does not reconnect.

What kombu does with each: docs/errors.md; the threading contract: docs/threading.md.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any

from amqp.exceptions import RecoverableConnectionError
from kombu.connection import Connection as KombuConnection

__all__ = [
    "CannotWaitInReadingThread",
    "ConnectionBlocked",
    "ConnectionClosedIntentionally",
    "ConnectionLost",
    "HeartbeatTimeout",
    "MalformedFrame",
]


class ConnectionClosedIntentionally(Exception):
    """The connection was closed on purpose by ``close()`` or ``collect()``."""


class ConnectionLost(RecoverableConnectionError):
    """The connection to the broker failed: reset, EOF, fork, or a dead socket."""


class HeartbeatTimeout(ConnectionLost):
    """The broker sent nothing for two heartbeat intervals."""


class MalformedFrame(ConnectionLost):
    """The broker sent bytes that are not a valid AMQP frame.

    ``frames``: the complete frames read just before the bad one (set by the frame
    assembler), for the reader to deliver before it fails the connection."""

    frames: list[tuple[int, int, bytes]] = []  # set per instance, never mutated


class ConnectionBlocked(RecoverableConnectionError):
    """The broker blocked publishing (``Connection.Blocked``) for longer than the
    publish could wait."""


class CannotWaitInReadingThread(RuntimeError):
    """A call that waits for the broker (a reply, a confirm, room among the outstanding
    confirms, a delivery) was made in the thread that reads the connection, while it
    dispatches what it read: a deferred publish's done callback, in drainer mode. That
    thread would wait for itself, so the call raises at once instead. Hand such work to
    another thread, or publish deferred and do not wait."""


# -- which connection an error came from -----------------------------------------------
# Many threads share one kombu.Connection. When its link fails, each thread's kombu code
# (ensure(), a failover's switch()) cleans up "the connection" while handling its own
# error, and by then another thread may already have reconnected. Each error we raise
# names the connection it came from, so that cleanup can leave a newer one alone.


def tag(error: BaseException, connection: Any, reconnect_failed: bool = False) -> None:
    """Record that ``error`` came from ``connection``; ``reconnect_failed``: from an
    attempt to replace it (``connection`` None: there was none yet)."""
    try:
        error.drainer_connection = (  # type: ignore[attr-defined]
            weakref.ref(connection) if connection is not None else _no_connection
        )
        error.drainer_reconnect_failed = reconnect_failed  # type: ignore[attr-defined]
    except AttributeError:
        pass  # an exception type without a __dict__ stays untagged


def _no_connection() -> None:
    return None


def handling_error_from_another(connection: Any) -> bool:
    """Whether this thread is handling an error that came from another connection than
    ``connection`` (so ``connection`` is newer than what this thread saw fail)."""
    origin = getattr(sys.exc_info()[1], "drainer_connection", None)
    return origin is not None and origin() is not connection


def in_failover_after_another(connection: Any) -> bool:
    """Whether kombu's failover ``switch()`` is running in this thread, after this
    thread's reconnect failed, and ``connection`` is one another thread opened since.
    switch() closes the kombu connection's current connection and channel, which then
    are the other threads' live ones."""
    if getattr(connection, "reason", True) is not None:
        return False  # ended already: closing it only releases it
    if not getattr(sys.exc_info()[1], "drainer_reconnect_failed", False):
        return False
    if not handling_error_from_another(connection):
        return False
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _KOMBU_SWITCH:
            return True
        frame = frame.f_back
    return False


_KOMBU_SWITCH = KombuConnection.switch.__code__
