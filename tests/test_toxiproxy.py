"""Tests for the Toxiproxy support server (and fixtures).

The proxy is driven only through the ``toxiproxy-python`` client (or plain HTTP
for API-shape checks), so this module also passes against a real Toxiproxy 2.5
(``TOXIPROXY_URL=http://127.0.0.1:8474``) as long as it can reach the local
echo/sink servers started here on 127.0.0.1.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import amqp
import pytest
from support.toxiproxy.fixtures import *  # noqa: F401,F403
from support.toxiproxy.fixtures import ProxiedBroker
from toxiproxy import Toxiproxy
from toxiproxy.proxy import Proxy

WAIT = 5.0  # generous upper bound for any wait on an event


# --------------------------------------------------------------------------- helpers
@dataclass
class Received:
    """What the sink side of one connection saw."""

    sizes: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    data: bytearray = field(default_factory=bytearray)
    closed: bool = False


class TcpTestServer:
    """Loopback TCP server: ``echo`` sends everything back, ``sink`` only records.

    Threading: one named daemon accept thread plus one per connection; the
    recorded data is guarded by ``cond`` (wait on it with :meth:`wait_for`).
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.cond = threading.Condition()
        self.conns: list[Received] = []
        self._socks: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads = [
            threading.Thread(target=self._accept, name=f"test-{mode}-accept", daemon=True)
        ]
        self._threads[0].start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            record = Received()
            with self.cond:
                self.conns.append(record)
                self._socks.append(sock)
                self.cond.notify_all()
            thread = threading.Thread(
                target=self._serve, args=(sock, record), name=f"test-{self.mode}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket, record: Received) -> None:
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                with self.cond:
                    record.sizes.append(len(data))
                    record.times.append(time.perf_counter())
                    record.data += data
                    self.cond.notify_all()
                if self.mode == "echo":
                    sock.sendall(data)
        except OSError:
            pass
        finally:
            with self.cond:
                record.closed = True
                self.cond.notify_all()

    def wait_for(self, predicate: Any, timeout: float = WAIT) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, timeout), "timed out waiting on test server"

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        except OSError:
            pass
        self._listener.close()
        with self.cond:
            socks = list(self._socks)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(WAIT)
        for sock in socks:
            sock.close()


@pytest.fixture
def echo_server() -> Iterator[TcpTestServer]:
    server = TcpTestServer("echo")
    yield server
    server.close()


@pytest.fixture
def sink_server() -> Iterator[TcpTestServer]:
    server = TcpTestServer("sink")
    yield server
    server.close()


def make_proxy(client: Toxiproxy, upstream: str) -> Proxy:
    return client.create(upstream=upstream, name=f"test_{uuid.uuid4().hex[:10]}")


def connect(proxy: Proxy) -> socket.socket:
    host, _, port = proxy.listen.rpartition(":")
    host = os.environ.get("TOXIPROXY_LISTEN_HOST", host)
    sock = socket.create_connection((host, int(port)), timeout=WAIT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise AssertionError(f"EOF after {len(buf)} of {size} bytes")
        buf += chunk
    return bytes(buf)


def recv_until_eof(sock: socket.socket) -> bytes:
    buf = bytearray()
    while chunk := sock.recv(65536):
        buf += chunk
    return bytes(buf)


def round_trip(sock: socket.socket, payload: bytes = b"ping") -> float:
    start = time.perf_counter()
    sock.sendall(payload)
    assert recv_exactly(sock, len(payload)) == payload
    return time.perf_counter() - start


def api(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    return status, (json.loads(raw) if raw.strip().startswith((b"{", b"[")) else raw)


# --------------------------------------------------------------------------- API
def test_api_shapes(toxiproxy: Toxiproxy, toxiproxy_url: str, echo_server: TcpTestServer) -> None:
    name = f"api_{uuid.uuid4().hex[:10]}"
    status, version = api(toxiproxy_url, "GET", "/version")
    assert status == 200 and version

    status, created = api(
        toxiproxy_url,
        "POST",
        "/proxies",
        {"name": name, "listen": "127.0.0.1:0", "upstream": echo_server.address},
    )
    assert status == 201
    assert created["name"] == name and created["enabled"] is True
    assert created["upstream"] == echo_server.address and created["toxics"] == []
    assert int(created["listen"].rpartition(":")[2]) > 0

    status, proxies = api(toxiproxy_url, "GET", "/proxies")
    assert status == 200 and proxies[name] == created

    status, error = api(
        toxiproxy_url, "POST", "/proxies", {"name": name, "upstream": echo_server.address}
    )
    assert (status, error) == (409, {"error": "proxy already exists", "status": 409})

    for method in ("GET", "DELETE"):
        status, error = api(toxiproxy_url, method, "/proxies/does_not_exist")
        assert (status, error) == (404, {"error": "proxy not found", "status": 404})

    status, toxic = api(
        toxiproxy_url,
        "POST",
        f"/proxies/{name}/toxics",
        {"type": "latency", "attributes": {"latency": 10}},
    )
    assert status == 200
    assert toxic == {
        "attributes": {"latency": 10, "jitter": 0},
        "name": "latency_downstream",
        "type": "latency",
        "stream": "downstream",
        "toxicity": 1,
    }
    status, error = api(toxiproxy_url, "POST", f"/proxies/{name}/toxics", {"type": "latency"})
    assert (status, error) == (409, {"error": "toxic already exists", "status": 409})
    status, error = api(toxiproxy_url, "POST", f"/proxies/{name}/toxics", {"type": "nope"})
    assert (status, error) == (400, {"error": "invalid toxic type", "status": 400})

    status, updated = api(
        toxiproxy_url,
        "POST",
        f"/proxies/{name}/toxics/latency_downstream",
        {"attributes": {"jitter": 5}, "toxicity": 0.5},
    )
    assert status == 200
    assert updated["attributes"] == {"latency": 10, "jitter": 5} and updated["toxicity"] == 0.5
    status, shown = api(toxiproxy_url, "GET", f"/proxies/{name}")
    assert status == 200 and shown["toxics"] == [updated]
    status, listed = api(toxiproxy_url, "GET", f"/proxies/{name}/toxics")
    assert (status, listed) == (200, [updated])

    status, error = api(toxiproxy_url, "GET", f"/proxies/{name}/toxics/missing")
    assert (status, error) == (404, {"error": "toxic not found", "status": 404})
    assert api(toxiproxy_url, "DELETE", f"/proxies/{name}/toxics/latency_downstream")[0] == 204

    status, disabled = api(toxiproxy_url, "POST", f"/proxies/{name}", {"enabled": False})
    assert status == 200 and disabled["enabled"] is False
    assert api(toxiproxy_url, "POST", "/reset")[0] == 204
    assert api(toxiproxy_url, "GET", f"/proxies/{name}")[1]["enabled"] is True
    assert api(toxiproxy_url, "DELETE", f"/proxies/{name}")[0] == 204
    assert api(toxiproxy_url, "GET", f"/proxies/{name}")[0] == 404


def test_client_round_trip(toxiproxy: Toxiproxy, echo_server: TcpTestServer) -> None:
    proxy = make_proxy(toxiproxy, echo_server.address)
    assert toxiproxy.get_proxy(proxy.name) is not None
    proxy.add_toxic(type="bandwidth", stream="upstream", attributes={"rate": 5})
    toxics = proxy.toxics()
    assert list(toxics) == ["bandwidth_upstream"]
    assert toxics["bandwidth_upstream"].attributes == {"rate": 5}
    assert proxy.destroy_toxic("bandwidth_upstream")
    assert proxy.toxics() == {}


# --------------------------------------------------------------------------- data path
def test_bytes_pass_through_unchanged(toxiproxy: Toxiproxy, echo_server: TcpTestServer) -> None:
    proxy = make_proxy(toxiproxy, echo_server.address)
    payload = os.urandom(256 * 1024)
    with connect(proxy) as sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,), name="test-sender")
        sender.start()
        assert recv_exactly(sock, len(payload)) == payload
        sender.join(WAIT)
    echo_server.wait_for(lambda: echo_server.conns[0].closed)
    assert bytes(echo_server.conns[0].data) == payload


def test_bandwidth_limits_rate(toxiproxy: Toxiproxy, sink_server: TcpTestServer) -> None:
    proxy = make_proxy(toxiproxy, sink_server.address)
    rate_kb = 128  # KB/s, KB = 1000 bytes as in upstream toxics/bandwidth.go
    proxy.add_toxic(type="bandwidth", stream="upstream", attributes={"rate": rate_kb})
    size = 64 * 1024
    with connect(proxy) as sock:
        start = time.perf_counter()
        sock.sendall(os.urandom(size))
        sink_server.wait_for(
            lambda: bool(sink_server.conns) and len(sink_server.conns[0].data) >= size
        )
    elapsed = sink_server.conns[0].times[-1] - start
    expected = size / (rate_kb * 1000)
    # Each byte is held until the rate allows it and timers never fire early, so the last
    # byte cannot arrive sooner (1 ms for rounding); later only means a slow machine.
    assert expected - 0.001 <= elapsed < expected + WAIT, (elapsed, expected)


def test_slicer_splits_chunks(toxiproxy: Toxiproxy, sink_server: TcpTestServer) -> None:
    proxy = make_proxy(toxiproxy, sink_server.address)
    avg, var, delay_us = 256, 32, 5000
    proxy.add_toxic(
        type="slicer",
        stream="upstream",
        attributes={"average_size": avg, "size_variation": var, "delay": delay_us},
    )
    payload = os.urandom(4096)
    with connect(proxy) as sock:
        sock.sendall(payload)
        sink_server.wait_for(
            lambda: bool(sink_server.conns) and len(sink_server.conns[0].data) >= len(payload)
        )
    record = sink_server.conns[0]
    assert bytes(record.data) == payload
    small = [s for s in record.sizes if s <= avg + var]
    assert len(record.sizes) >= 10, record.sizes
    assert len(small) >= 0.8 * len(record.sizes), record.sizes
    # Every slice is followed by `delay`: the pieces cannot all arrive at once.
    assert record.times[-1] - record.times[0] >= (len(payload) // (avg + var) - 2) * delay_us / 1e6


def test_latency_adds_delay(toxiproxy: Toxiproxy, echo_server: TcpTestServer) -> None:
    proxy = make_proxy(toxiproxy, echo_server.address)
    with connect(proxy) as sock:
        baseline = round_trip(sock)
        proxy.add_toxic(type="latency", attributes={"latency": 200})  # live link
        delayed = round_trip(sock)
        proxy.add_toxic(type="latency", stream="upstream", attributes={"latency": 100})
        both = round_trip(sock)
        proxy.destroy_toxic("latency_downstream")
        proxy.destroy_toxic("latency_upstream")
        after = round_trip(sock)
    assert 0.2 <= delayed < 0.2 + baseline + 0.15, delayed
    assert 0.3 <= both < 0.3 + baseline + 0.15, both
    assert after < 0.1, after


def test_toxicity_zero_never_applies(toxiproxy: Toxiproxy, echo_server: TcpTestServer) -> None:
    proxy = make_proxy(toxiproxy, echo_server.address)
    proxy.add_toxic(type="latency", toxicity=0.0, attributes={"latency": 1000})
    with connect(proxy) as sock:
        assert round_trip(sock) < 0.5


def test_reset_peer_resets_new_connections(
    toxiproxy: Toxiproxy, echo_server: TcpTestServer
) -> None:
    proxy = make_proxy(toxiproxy, echo_server.address)
    proxy.add_toxic(type="reset_peer", stream="upstream", attributes={"timeout": 0})
    with connect(proxy) as sock:
        sock.sendall(b"reset me\n")
        with pytest.raises(ConnectionResetError):
            sock.recv(100)


def test_reset_peer_added_to_open_connection_closes_normally(
    toxiproxy: Toxiproxy, echo_server: TcpTestServer
) -> None:
    # Upstream link.go sets SO_LINGER 0 only when a link starts with reset_peer
    # in its chain, so a live connection gets a plain FIN.
    proxy = make_proxy(toxiproxy, echo_server.address)
    with connect(proxy) as sock:
        round_trip(sock)
        proxy.add_toxic(type="reset_peer", stream="upstream", attributes={"timeout": 0})
        sock.sendall(b"bye\n")
        assert sock.recv(100) == b""


def test_disable_refuses_and_enable_restores(
    toxiproxy: Toxiproxy, echo_server: TcpTestServer
) -> None:
    proxy = make_proxy(toxiproxy, echo_server.address)
    with connect(proxy) as live:
        round_trip(live)
        proxy.disable()
        try:
            assert live.recv(10) == b""  # existing connection is closed
        except ConnectionResetError:
            pass
    assert toxiproxy.get_proxy(proxy.name).enabled is False
    with pytest.raises(ConnectionRefusedError):
        connect(proxy).close()
    proxy.enable()
    with connect(proxy) as sock:
        round_trip(sock)
    with proxy.down():
        with pytest.raises(ConnectionRefusedError):
            connect(proxy).close()
    with connect(proxy) as sock:
        round_trip(sock)


def test_timeout_drops_data_and_closes(toxiproxy: Toxiproxy, echo_server: TcpTestServer) -> None:
    proxy = make_proxy(toxiproxy, echo_server.address)
    proxy.add_toxic(type="timeout", attributes={"timeout": 300})
    start = time.perf_counter()
    with connect(proxy) as sock:
        sock.sendall(b"lost")
        assert recv_until_eof(sock) == b""  # echoed data is dropped, then EOF
    elapsed = time.perf_counter() - start
    assert 0.28 <= elapsed < 0.3 + 1.0, elapsed
    echo_server.wait_for(lambda: bool(echo_server.conns) and echo_server.conns[0].data == b"lost")


def test_timeout_zero_freezes_live_link_and_removal_closes_it(
    toxiproxy: Toxiproxy, echo_server: TcpTestServer
) -> None:
    proxy = make_proxy(toxiproxy, echo_server.address)
    with connect(proxy) as sock:
        round_trip(sock)
        proxy.add_toxic(type="timeout", attributes={"timeout": 0})
        sock.sendall(b"frozen")
        echo_server.wait_for(lambda: echo_server.conns[0].data.endswith(b"frozen"))
        sock.settimeout(0.3)
        with pytest.raises(socket.timeout):
            sock.recv(100)  # the echo was swallowed by the timeout toxic
        sock.settimeout(WAIT)
        # Upstream TimeoutToxic.Cleanup closes the stub: removal ends the connection.
        proxy.destroy_toxic("timeout_downstream")
        assert recv_until_eof(sock) == b""


def test_limit_data_closes_after_bytes(toxiproxy: Toxiproxy, echo_server: TcpTestServer) -> None:
    proxy = make_proxy(toxiproxy, echo_server.address)
    proxy.add_toxic(type="limit_data", attributes={"bytes": 1000})
    with connect(proxy) as sock:
        sock.sendall(os.urandom(3000))
        received = recv_until_eof(sock)
    assert len(received) == 1000


def test_live_bandwidth_and_slicer_add_remove(
    toxiproxy: Toxiproxy, echo_server: TcpTestServer
) -> None:
    proxy = make_proxy(toxiproxy, echo_server.address)
    payload = os.urandom(20_000)
    with connect(proxy) as sock:
        round_trip(sock)
        proxy.add_toxic(name="bw", type="bandwidth", attributes={"rate": 100})
        proxy.add_toxic(
            name="sl",
            type="slicer",
            attributes={"average_size": 1000, "size_variation": 100, "delay": 100},
        )
        slow = round_trip(sock, payload)
        proxy.destroy_toxic("bw")
        proxy.destroy_toxic("sl")
        fast = round_trip(sock, payload)
    assert slow >= 0.8 * len(payload) / 100_000, slow
    assert fast < slow / 2, (fast, slow)


def test_upstream_unreachable_closes_client(toxiproxy: Toxiproxy) -> None:
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        dead = f"127.0.0.1:{placeholder.getsockname()[1]}"
    proxy = make_proxy(toxiproxy, dead)  # nothing listens there any more
    with connect(proxy) as sock:
        try:
            assert sock.recv(10) == b""
        except ConnectionResetError:
            pass


def test_amqp_through_proxy(proxied_broker_url: ProxiedBroker) -> None:
    broker = proxied_broker_url
    assert broker.url.endswith(f"@{broker.host}:{broker.port}//")
    queue = f"toxiproxy-test-{uuid.uuid4().hex}"
    conn = amqp.Connection(host=broker.hostport, connect_timeout=WAIT)
    conn.connect()
    try:
        channel = conn.channel()
        channel.queue_declare(queue, auto_delete=False)
        channel.basic_publish(amqp.Message(b"through the proxy"), routing_key=queue)
        message = None
        deadline = time.monotonic() + WAIT
        while message is None and time.monotonic() < deadline:
            message = channel.basic_get(queue, no_ack=True)
        assert message is not None and message.body == b"through the proxy"
        channel.queue_delete(queue)
        channel.close()
    finally:
        conn.close()


# --------------------------------------------------------------------------- built-in server
def test_builtin_server_stops_promptly(echo_server: TcpTestServer) -> None:
    from support.toxiproxy import ToxiproxyServer

    before = set(threading.enumerate())
    server = ToxiproxyServer().start()
    status, created = api(
        server.url, "POST", "/proxies", {"name": "stopme", "upstream": echo_server.address}
    )
    assert status == 201
    host, _, port = created["listen"].rpartition(":")
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        round_trip(sock)
        api(server.url, "POST", "/proxies/stopme/toxics", {"type": "timeout"})
        start = time.perf_counter()
        server.stop()
        assert time.perf_counter() - start < 2.0
        assert sock.recv(10) == b""
    leftovers = [
        t.name
        for t in set(threading.enumerate()) - before
        if t.name.startswith("toxiproxy-") and t.is_alive()
    ]
    assert leftovers == []
    with pytest.raises(OSError) as info:
        socket.create_connection((host, int(port)), timeout=WAIT).close()
    assert info.value.errno in (errno.ECONNREFUSED, None) or isinstance(
        info.value, ConnectionRefusedError
    )
