"""The errors this library raises.

Every thread that waits on a connection sees the same reason when it ends:

* ``ConnectionLost`` (and its subclasses) when the link failed. It is a py-amqp
  ``RecoverableConnectionError``, so kombu's ``ensure()``, ``autoretry`` and
  ``Producer.publish(retry=True)`` reconnect.
* ``ConnectionBlocked`` when a publish waited too long on a connection the broker has
  blocked (a memory or disk alarm). Recoverable: kombu retries it by its retry policy.
* ``ConnectionClosedIntentionally`` after ``close()`` (or ``collect()`` of a healthy
  connection). It derives from
  nothing in the transport's ``connection_errors``, ``recoverable_connection_errors``
  or ``channel_errors``, so nothing in kombu reconnects after a deliberate shutdown.
"""

from __future__ import annotations

from amqp.exceptions import RecoverableConnectionError

__all__ = [
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
