"""pytest fixtures for Toxiproxy-based fault injection.

Import with ``from support.toxiproxy.fixtures import *`` (from ``tests/conftest.py``).

Environment
-----------
``TOXIPROXY_URL``
    Use an external (real) Toxiproxy, e.g. ``http://127.0.0.1:8474``; otherwise
    the built-in :class:`~support.toxiproxy.server.ToxiproxyServer` is started
    once per session on a free loopback port.
``TOXIPROXY_UPSTREAM``
    Address the proxy connects to (default ``127.0.0.1:5672``); set it when
    Toxiproxy runs in a container (e.g. ``rabbitmq:5672``).
``TOXIPROXY_LISTEN``
    Listen address sent when creating proxies (default ``127.0.0.1:0``, i.e. a
    free port chosen by the server).
``TOXIPROXY_LISTEN_HOST``
    Host the tests connect to (default ``127.0.0.1``); the port is taken from
    the proxy's reported ``listen`` address.

Threading: fixtures run on the pytest main thread.  The ``toxiproxy-python``
client keeps its host/port in class attributes (``APIConsumer``), so one URL
is used per process.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest
from toxiproxy import Toxiproxy
from toxiproxy.proxy import Proxy

from .server import ToxiproxyServer

__all__ = [
    "ProxiedBroker",
    "broker_url",
    "proxied_broker",
    "proxied_broker_url",
    "toxiproxy",
    "toxiproxy_url",
]

DEFAULT_BROKER_URL = "amqp://guest:guest@127.0.0.1:5672//"


@dataclass(frozen=True)
class ProxiedBroker:
    """An AMQP broker reachable through a dedicated Toxiproxy proxy."""

    url: str  #: ``amqp://guest:guest@host:port//`` through the proxy
    host: str  #: host to connect to
    port: int  #: proxy listen port
    proxy: Proxy  #: ``toxiproxy.proxy.Proxy``: ``add_toxic``/``destroy_toxic``/``disable``...
    name: str  #: proxy name

    @property
    def hostport(self) -> str:
        """``"host:port"``, as ``amqp.Connection(host=...)`` expects."""
        return f"{self.host}:{self.port}"


def _listen_port(listen: str) -> int:
    return int(listen.rpartition(":")[2])


@pytest.fixture(scope="session")
def toxiproxy_url() -> Iterator[str]:
    """Base URL of the Toxiproxy API (external via ``TOXIPROXY_URL`` or built-in)."""
    external = os.environ.get("TOXIPROXY_URL")
    if external:
        yield external.rstrip("/")
        return
    server = ToxiproxyServer("127.0.0.1", 0).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def toxiproxy(toxiproxy_url: str) -> Iterator[Toxiproxy]:
    """A ``toxiproxy.Toxiproxy`` client for ``toxiproxy_url``.

    After the test, proxies created during the test are deleted and
    ``POST /reset`` re-enables all proxies and removes all toxics.
    """
    parts = urlsplit(toxiproxy_url)
    client = Toxiproxy()
    client.update_api_consumer(parts.hostname or "127.0.0.1", parts.port or 8474)
    before = set(client.proxies())
    try:
        yield client
    finally:
        for name, proxy in client.proxies().items():
            if name not in before:
                proxy.destroy()
        client.reset()


@pytest.fixture(scope="session")
def broker_url() -> str:
    """Direct (unproxied) AMQP URL of the local RabbitMQ."""
    return DEFAULT_BROKER_URL


@pytest.fixture
def proxied_broker_url(toxiproxy: Toxiproxy) -> Iterator[ProxiedBroker]:
    """A fresh, uniquely named proxy in front of RabbitMQ; deleted at teardown."""
    name = f"amqp_{uuid.uuid4().hex[:12]}"
    upstream = os.environ.get("TOXIPROXY_UPSTREAM", "127.0.0.1:5672")
    listen = os.environ.get("TOXIPROXY_LISTEN", "127.0.0.1:0")
    host = os.environ.get("TOXIPROXY_LISTEN_HOST", "127.0.0.1")
    proxy = toxiproxy.create(upstream=upstream, name=name, listen=listen)
    port = _listen_port(proxy.listen)
    try:
        yield ProxiedBroker(
            url=f"amqp://guest:guest@{host}:{port}//",
            host=host,
            port=port,
            proxy=proxy,
            name=name,
        )
    finally:
        if name in toxiproxy.proxies():
            proxy.destroy()


@pytest.fixture
def proxied_broker(proxied_broker_url: ProxiedBroker) -> ProxiedBroker:
    """Alias of :func:`proxied_broker_url`."""
    return proxied_broker_url
