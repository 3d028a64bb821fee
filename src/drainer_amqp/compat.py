"""The py-amqp and kombu internals drainer-amqp overrides or reads, checked at import.

A release that moves one fails here, with an ImportError naming what is missing and the
installed versions, instead of an AttributeError later in a drainer or caller thread.
:func:`check` runs once when the package is imported; it keeps no state.
"""

from __future__ import annotations

import amqp
import kombu
from amqp.abstract_channel import AbstractChannel
from amqp.serialization import GenericContent
from amqp.transport import SSLTransport, TCPTransport
from kombu.transport import pyamqp

_CHANNEL = "_do_revive _on_close _basic_publish basic_publish_confirm collect confirm_select"
_CONNECTION = "_get_free_channel_id _claim_channel_id on_inbound_method _on_close_ok collect"
_TRANSPORT = "_read _read_buffer sock"
_KOMBU = "establish_connection close_connection _collect register_with_event_loop on_readable"
#: What each class, or an unconnected instance of it, must have: the methods drainer-amqp
#: overrides or calls and the attributes it reads or sets.
REQUIRED: list[tuple[object, str]] = [
    (AbstractChannel, "_pending send_method wait dispatch_method"),
    (amqp.Channel, _CHANNEL),
    (amqp.Connection, _CONNECTION + " drain_events heartbeat_tick dispatch_method"),
    (amqp.Connection(), "frame_writer_cls _used_channel_ids _transport"),  # connects on connect()
    (TCPTransport, _TRANSPORT),
    (SSLTransport, _TRANSPORT),
    (TCPTransport("127.0.0.1"), "connected"),
    (GenericContent, "_serialize_properties"),
    (pyamqp.Transport, _KOMBU + " unregister_from_event_loop"),
]


def missing() -> list[str]:
    """The required internals the installed py-amqp and kombu lack, as ``Class.name``."""
    return [
        f"{getattr(owner, '__qualname__', None) or type(owner).__qualname__ + '()'}.{name}"
        for owner, names in REQUIRED
        for name in names.split()
        if not hasattr(owner, name)
    ]


def check() -> None:
    """Raise ImportError if an internal drainer-amqp relies on is missing."""
    gone = missing()
    if gone:
        raise ImportError(
            f"drainer-amqp does not support amqp {amqp.__version__} with kombu "
            f"{kombu.__version__}: missing {', '.join(gone)} (supported: amqp>=5.2,<6 and "
            "kombu>=5.3,<6)"
        )


check()
