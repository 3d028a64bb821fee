"""drainer-amqp: one py-amqp/kombu connection, shared safely and fast between threads.

Public API: :class:`Connection`, its :class:`Channel` (with deferred confirms, their
:class:`~drainer_amqp.deferred.ConfirmFuture`), :class:`Transport`, :class:`SSLTransport`,
:mod:`drainer_amqp.otel` and the errors in :mod:`drainer_amqp.errors`. The threading
contract is in docs/threading.md.
"""

from . import compat  # noqa: F401  (first: says which py-amqp/kombu internal is missing)
from .channel import Channel
from .connection import Connection
from .errors import (
    CannotWaitInReadingThread,
    ConnectionBlocked,
    ConnectionClosedIntentionally,
    ConnectionLost,
    HeartbeatTimeout,
    MalformedFrame,
)
from .transport import SSLTransport, Transport

__all__ = [
    "CannotWaitInReadingThread",
    "Channel",
    "Connection",
    "ConnectionBlocked",
    "ConnectionClosedIntentionally",
    "ConnectionLost",
    "HeartbeatTimeout",
    "MalformedFrame",
    "SSLTransport",
    "Transport",
]
__version__ = "0.1.0"
