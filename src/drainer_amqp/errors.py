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
    thread would wait for itself, so the call raises at once instead (a method that
    waits for a reply, before it is sent). Hand such work to another thread, or publish
    and do not wait."""


# -- which connection an error came from -----------------------------------------------
# Many threads share one kombu.Connection. When its link fails, each thread's kombu code
# (ensure(), a failover's switch()) cleans up "the connection" while handling its own
# error, and by then another thread may already have reconnected. Each error we raise
# names the connection it came from, so that cleanup can leave a newer one alone.


def tag(error: BaseException, connection: Any) -> None:
    """Record that ``error`` came from ``connection`` (or, from a failed reconnect, from
    the connection it was to replace; None: there was none yet)."""
    try:
        error.drainer_connection = (  # type: ignore[attr-defined]
            weakref.ref(connection) if connection is not None else _no_connection
        )
    except AttributeError:
        pass  # an exception type without a __dict__ stays untagged


def _no_connection() -> None:
    return None


def handling_error_from_another(connection: Any) -> bool:
    """Whether this thread is handling an error that came from another connection than
    ``connection`` (so ``connection`` is newer than what this thread saw fail). kombu's
    ``collect()`` may run its cleanup inside an ``except AttributeError``: the error that
    one interrupted (its ``__context__``) counts."""
    error = sys.exc_info()[1]
    for _ in range(3):
        if error is None:
            return False
        origin = getattr(error, "drainer_connection", None)
        if origin is not None:
            return origin() is not connection
        error = error.__context__
    return False


def in_kombu_cleanup() -> bool:
    """Whether kombu's failover ``switch()`` or its ``collect()`` is running in this
    thread. kombu calls them while it handles an error (in ``ensure()``, after a failed
    reconnect), and they close the kombu connection's connection and default channel."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _KOMBU_CLEANUP:
            return True
        frame = frame.f_back
    return False


def in_failover_after_another(connection: Any) -> bool:
    """Whether kombu's cleanup is running in this thread for an error from another
    connection than ``connection``, which is live: one another thread opened since this
    thread's publish or reconnect failed, which the cleanup must leave open."""
    if getattr(connection, "reason", True) is not None:
        return False  # ended already: closing it only releases it
    return handling_error_from_another(connection) and in_kombu_cleanup()


_KOMBU_CLEANUP = (KombuConnection.switch.__code__, KombuConnection.collect.__code__)
