"""kombu transports whose connections are :class:`drainer_amqp.Connection`.

Select one with ``transport="drainer_amqp:Transport"`` (kombu) or
``broker_transport = "drainer_amqp:Transport"`` (Celery), and switch the drainer on with
the transport option ``dedicated_drainer``. Importing this package also registers the
URL schemes ``drainer-amqp://`` and ``drainer-amqps://``, which survive kombu's failover
(``Connection.switch`` re-reads the transport from each URL's scheme).

kombu's event loop (the Hub, used by the Celery worker): in drainer mode the socket
belongs to the drainer thread, so the Hub watches :meth:`Connection.inbox_fileno`
instead and runs queued callbacks in the Hub thread. Heartbeats are the drainer's,
so the Hub's periodic ``heartbeat_check`` only reports a failed link.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import TRANSPORT_ALIASES, pyamqp

from .connection import Connection as DrainerConnection

__all__ = ["SSLTransport", "Transport"]


class Transport(pyamqp.Transport):
    """kombu's py-amqp transport, with :class:`drainer_amqp.Connection` connections."""

    Connection = DrainerConnection

    def register_with_event_loop(self, connection: DrainerConnection, loop: Any) -> None:
        if not connection.dedicated_drainer:
            return super().register_with_event_loop(connection, loop)
        loop.add_reader(connection.inbox_fileno(), self.on_readable, connection, loop)

    def unregister_from_event_loop(self, connection: DrainerConnection, loop: Any) -> None:
        if connection.dedicated_drainer and connection._inbox_signal is not None:
            loop.remove_reader(connection.inbox_fileno())
        return super().unregister_from_event_loop(connection, loop)

    def on_readable(self, connection: DrainerConnection, loop: Any) -> None:
        if not connection.dedicated_drainer:
            return super().on_readable(connection, loop)
        connection.run_pending_callbacks()


class SSLTransport(Transport):
    """:class:`Transport` over TLS (``amqps``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        client = self.client
        if client is not None and not client.ssl:
            client.ssl = True


TRANSPORT_ALIASES.setdefault("drainer-amqp", "drainer_amqp:Transport")
TRANSPORT_ALIASES.setdefault("drainer-amqps", "drainer_amqp:SSLTransport")
