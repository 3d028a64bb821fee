"""The publishing clients the comparison benchmarks measure, behind one small interface.

* ``drainer``: one kombu connection on ``drainer_amqp:Transport`` with
  ``dedicated_drainer=True``, shared by every thread, a channel and Producer per thread;
* ``legacy``: the same with ``dedicated_drainer=False``;
* ``stock+lock``: one stock kombu connection (``amqp://``, kombu's pyamqp transport)
  shared by every thread behind one ``threading.RLock`` held around each publish (and so
  around the confirm wait, which reads the socket: stock py-amqp cannot share otherwise);
* ``stock per thread``: one stock kombu connection per thread, each behind a lock of its
  own (uncontended while its thread publishes; it lets another thread close it safely);
* ``amqpstorm``: one shared amqpstorm Connection (its own IO thread), a channel per
  thread, ``channel.basic.publish`` (``channel.confirm_deliveries()`` for confirms).

Threading contract: :func:`open_client` and :meth:`Client.close` run in one thread (the
benchmark's); ``publish[i]`` and ``sync[i]`` run only in publisher thread ``i``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import amqpstorm
import kombu
from kombu import Producer
from support.broker import BROKER_HOST

CLIENTS = ("drainer", "legacy", "stock+lock", "stock per thread", "amqpstorm")

#: One colour per client in every plot.
CLIENT_COLORS = {
    "drainer": "#1f77b4",
    "legacy": "#d62728",
    "stock+lock": "#ff7f0e",
    "stock per thread": "#9467bd",
    "amqpstorm": "#2ca02c",
    "stock": "#ff7f0e",
    "no AMQP": "#7f7f7f",
}

__all__ = ["CLIENTS", "CLIENT_COLORS", "Client", "kombu_connection", "open_client"]


def _host_port() -> tuple[str, int]:
    host, _, port = BROKER_HOST.partition(":")
    return host, int(port or 5672)


def kombu_connection(client: str, confirms: bool) -> kombu.Connection:
    """A connected kombu connection for ``client`` ("drainer", "legacy" or a stock one)."""
    url = f"amqp://guest:guest@{BROKER_HOST}//"
    options: dict[str, object] = {"confirm_publish": confirms}
    if client in ("drainer", "legacy"):
        options["dedicated_drainer"] = client == "drainer"
        conn = kombu.Connection(url, transport="drainer_amqp:Transport", transport_options=options)
    else:
        conn = kombu.Connection(url, transport_options=options)
    conn.connect()
    return conn


@dataclass
class Client:
    """One client opened for ``threads`` publisher threads.

    ``publish[i](body)`` publishes ``body`` (returning when the client says it is sent,
    or, with confirms, acknowledged); ``sync[i]()`` makes one round trip on thread
    ``i``'s channel, so everything it published before has reached the broker.
    :meth:`close` closes the connection(s) (kombu: ``release()``); a stock connection
    under its lock, since stock py-amqp cannot be closed while another thread uses it."""

    name: str
    publish: list[Callable[[bytes], object]] = field(default_factory=list)
    sync: list[Callable[[], object]] = field(default_factory=list)
    closers: list[Callable[[], object]] = field(default_factory=list)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


def _locked(lock: threading.RLock, fn: Callable[..., object]) -> Callable[..., object]:
    def call(*args: object) -> object:
        with lock:
            return fn(*args)

    return call


def open_client(name: str, threads: int, confirms: bool, routing_key: str) -> Client:
    """``name``'s connection(s) and one channel per thread, publishing to the default
    exchange with ``routing_key``."""
    client = Client(name)
    try:
        if name == "amqpstorm":
            host, port = _host_port()
            conn = amqpstorm.Connection(host, "guest", "guest", port=port)
            client.closers.append(conn.close)
            for _ in range(threads):
                channel = conn.channel()
                if confirms:
                    channel.confirm_deliveries()
                basic = channel.basic
                client.publish.append(partial(_storm_publish, basic, routing_key))
                client.sync.append(partial(basic.qos, 0))
            return client
        per_thread = name == "stock per thread"
        conns = [kombu_connection(name, confirms) for _ in range(threads if per_thread else 1)]
        locks = [threading.RLock() for _ in conns] if name.startswith("stock") else []
        for k, c in enumerate(conns):
            client.closers.append(_locked(locks[k], c.release) if locks else c.release)
        for i in range(threads):
            k = i if per_thread else 0
            channel = conns[k].channel()
            producer = Producer(channel, routing_key=routing_key)
            publish: Callable[..., object] = partial(producer.publish, retry=False)
            sync: Callable[[], object] = partial(channel.basic_qos, 0, 0, False)
            if locks:
                publish, sync = _locked(locks[k], publish), _locked(locks[k], sync)
            client.publish.append(publish)
            client.sync.append(sync)
        return client
    except BaseException:
        client.close()
        raise


def _storm_publish(basic: amqpstorm.basic.Basic, routing_key: str, body: bytes) -> object:
    return basic.publish(body, routing_key=routing_key, exchange="")
