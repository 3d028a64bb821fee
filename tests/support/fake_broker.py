"""A fake AMQP 0-9-1 broker in the test process: it speaks the handshake and a few
replies well enough for ``drainer_amqp.Connection`` (both modes) and kombu to connect,
then sends whatever bytes a test tells it to.

What it does by itself, per client:

* the handshake: protocol header, ``Connection.Start`` / ``StartOk``, ``Tune`` /
  ``TuneOk`` (the ``frame_max`` it was given, heartbeats off), ``Open`` / ``OpenOk``;
* replies to ``Channel.Open``, ``Confirm.Select``, ``Basic.Consume``, ``Basic.Qos``,
  ``Channel.Close`` and ``Connection.Close``; ``Queue.Declare`` only when
  ``answer_declare`` is set;
* nothing else: a publish is never confirmed and a declare waits, unless the test
  answers it with :meth:`FakeBroker.send`.

Every method a client sends after the handshake is recorded (:meth:`wait_for`).

Threads: ``fake-broker-accept`` and one ``fake-broker-client-<n>`` per client, all
owned by the ``FakeBroker``; :meth:`FakeBroker.close` stops them within ``JOIN``
seconds (asserted) and closes every socket it opened.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from time import monotonic
from typing import Any

from amqp import spec
from amqp.serialization import dumps, loads

__all__ = ["FakeBroker", "content", "fake_broker", "frame", "method"]

JOIN = 10.0  # seconds: a fake-broker thread not done by then is a bug in the test
PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
SERVER_PROPERTIES = {
    "product": "fake-broker",
    "capabilities": {
        "publisher_confirms": True,
        "exchange_exchange_bindings": True,
        "basic.nack": True,
        "consumer_cancel_notify": True,
        "connection.blocked": True,
        "authentication_failure_close": True,
        "per_consumer_qos": True,
    },
}


def frame(frame_type: int, channel: int, payload: bytes, end: int = 0xCE) -> bytes:
    """One raw frame; ``end`` other than 0xCE makes a bad one."""
    return struct.pack(">BHI", frame_type, channel, len(payload)) + payload + bytes([end])


def method(channel: int, sig: tuple[int, int], fmt: str = "", args: tuple[Any, ...] = ()) -> bytes:
    """A method frame with its arguments encoded as py-amqp would."""
    return frame(1, channel, struct.pack(">HH", *sig) + (dumps(fmt, args) if fmt else b""))


def content(
    channel: int, sig: tuple[int, int], fmt: str, args: tuple[Any, ...], body: bytes
) -> bytes:
    """A content method (``Basic.Deliver``, ``Basic.Return``...), its header, its body."""
    header = struct.pack(">HHQH", sig[0], 0, len(body), 0)  # no properties
    return method(channel, sig, fmt, args) + frame(2, channel, header) + frame(3, channel, body)


class _Client:
    """One accepted connection, served by its own thread."""

    def __init__(self, broker: FakeBroker, sock: socket.socket, number: int) -> None:
        self.broker = broker
        self.sock = sock
        self.handshake_done = threading.Event()
        self.login_response = b""
        self._write = threading.Lock()  # auto-replies and the test's send() interleave
        self._buf = bytearray()
        self._publishes: dict[int, int] = {}  # channel -> publishes since Confirm.Select
        self.thread = threading.Thread(
            target=self._run, name=f"fake-broker-client-{number}", daemon=True
        )

    # -- writing --------------------------------------------------------------------
    def send(self, data: bytes) -> float:
        with self._write:
            self.sock.sendall(data)
        return monotonic()

    def end_stream(self) -> float:
        """Send EOF (the write side only: the client may still talk)."""
        with self._write:
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        return monotonic()

    def shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- reading --------------------------------------------------------------------
    def _recv_exactly(self, n: int) -> bytes | None:
        while len(self._buf) < n:
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                return None
            if not chunk:
                return None
            self._buf += chunk
        data = bytes(self._buf[:n])
        del self._buf[:n]
        return data

    def _read_frame(self) -> tuple[int, int, bytes] | None:
        header = self._recv_exactly(7)
        if header is None:
            return None
        frame_type, channel, size = struct.unpack(">BHI", header)
        rest = self._recv_exactly(size + 1)
        if rest is None:
            return None
        return frame_type, channel, rest[:-1]

    def _read_method(self) -> tuple[int, tuple[int, int], bytes] | None:
        while (got := self._read_frame()) is not None:
            frame_type, channel, payload = got
            if frame_type == 1:
                return channel, struct.unpack_from(">HH", payload), payload
        return None

    # -- the conversation -----------------------------------------------------------
    def _run(self) -> None:
        try:
            tls = self.broker.tls
            if tls is not None:
                self.sock.settimeout(JOIN)
                self.sock = tls.wrap_socket(self.sock, server_side=True)
                self.sock.settimeout(None)
            if self._handshake():
                self.handshake_done.set()
                self._serve()
        except (OSError, ssl.SSLError, struct.error):
            pass  # the client went away (or never finished TLS): nothing to serve
        finally:
            self.shutdown()

    def _handshake(self) -> bool:
        if self._recv_exactly(8) != PROTOCOL_HEADER:
            return False
        self.send(
            method(
                0,
                spec.Connection.Start,
                "ooFSS",
                (0, 9, SERVER_PROPERTIES, "AMQPLAIN PLAIN", "en_US"),
            )
        )
        start_ok = self._read_method()
        if start_ok is None or start_ok[1] != spec.Connection.StartOk:
            return False
        _props, _mechanism, self.login_response = loads("FsS", start_ok[2], 4)[0][:3]
        self.send(method(0, spec.Connection.Tune, "BlB", (2047, self.broker.frame_max, 0)))
        for expected in (spec.Connection.TuneOk, spec.Connection.Open):
            got = self._read_method()
            if got is None or got[1] != expected:
                return False
        self.send(method(0, spec.Connection.OpenOk, "s", ("",)))
        return True

    def _serve(self) -> None:
        broker = self.broker
        while (got := self._read_method()) is not None:
            channel, sig, payload = got
            broker._record(channel, sig, payload)
            reply = self._reply(channel, sig, payload)
            if reply:
                self.send(reply)
            if sig in (spec.Connection.Close, spec.Connection.CloseOk):
                return

    def _reply(self, channel: int, sig: tuple[int, int], payload: bytes) -> bytes:
        if sig == spec.Channel.Open:
            return method(channel, spec.Channel.OpenOk, "S", ("",))
        if sig == spec.Channel.Close:
            return method(channel, spec.Channel.CloseOk)
        if sig == spec.Connection.Close:
            return method(0, spec.Connection.CloseOk)
        if sig == spec.Confirm.Select:
            self._publishes[channel] = 0
            (nowait,), _ = loads("b", payload, 4)
            return b"" if nowait else method(channel, spec.Confirm.SelectOk)
        if sig == spec.Basic.Qos:
            return method(channel, spec.Basic.QosOk)
        if sig == spec.Basic.Consume:
            (_, _queue, tag, _nl, _na, _ex, nowait), _ = loads("Bssbbbb", payload, 4)
            tag = tag or f"ctag-{channel}"
            return b"" if nowait else method(channel, spec.Basic.ConsumeOk, "s", (tag,))
        if sig == spec.Queue.Declare and self.broker.answer_declare:
            (_, queue), _ = loads("Bs", payload, 4)
            return method(channel, spec.Queue.DeclareOk, "sll", (queue or "amq.gen-fake", 0, 0))
        return b""


class FakeBroker:
    """Listens on 127.0.0.1 (an ephemeral port; TLS when ``tls`` is a server context)."""

    def __init__(
        self,
        *,
        frame_max: int = 131072,
        tls: ssl.SSLContext | None = None,
        answer_declare: bool = False,
    ) -> None:
        self.frame_max = frame_max
        self.tls = tls
        self.answer_declare = answer_declare
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)  # the accept loop looks at _stopping this often
        self.port: int = self._listener.getsockname()[1]
        self.hostport = f"127.0.0.1:{self.port}"
        self._stopping = False
        self._lock = threading.Condition()  # guards clients and methods
        self.clients: list[_Client] = []
        self.methods: list[tuple[int, tuple[int, int], bytes]] = []
        self._accept_thread = threading.Thread(
            target=self._accept, name="fake-broker-accept", daemon=True
        )
        self._accept_thread.start()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.settimeout(None)
            with self._lock:
                if self._stopping:
                    sock.close()
                    return
                client = _Client(self, sock, len(self.clients))
                self.clients.append(client)
                self._lock.notify_all()
            client.thread.start()

    def _record(self, channel: int, sig: tuple[int, int], payload: bytes) -> None:
        with self._lock:
            self.methods.append((channel, sig, payload))
            self._lock.notify_all()

    # -- for tests --------------------------------------------------------------------
    @property
    def client(self) -> _Client:
        """The latest client to connect, once its handshake is done."""
        with self._lock:
            assert self._lock.wait_for(lambda: bool(self.clients), JOIN), "nobody connected"
            client = self.clients[-1]
        assert client.handshake_done.wait(JOIN), "the client did not finish the handshake"
        return client

    def wait_for(self, sig: tuple[int, int], count: int = 1, timeout: float = JOIN) -> bool:
        """Wait until clients have sent ``sig`` at least ``count`` times."""
        with self._lock:
            return self._lock.wait_for(
                lambda: sum(1 for m in self.methods if m[1] == sig) >= count, timeout
            )

    def send(self, data: bytes) -> float:
        """Write ``data`` to the latest client; returns when it was written (monotonic)."""
        return self.client.send(data)

    def end_stream(self) -> float:
        """EOF to the latest client; returns when it was sent (monotonic)."""
        return self.client.end_stream()

    def close(self) -> None:
        self._stopping = True
        self._accept_thread.join(JOIN)
        self._listener.close()
        with self._lock:
            clients = list(self.clients)
        for client in clients:
            client.shutdown()
        for client in clients:
            if client.thread.ident is not None:
                client.thread.join(JOIN)
            client.sock.close()
        for thread in [self._accept_thread] + [c.thread for c in clients]:
            assert not thread.is_alive(), f"{thread.name} did not stop"


@contextmanager
def fake_broker(**kwargs: Any) -> Iterator[FakeBroker]:
    broker = FakeBroker(**kwargs)
    try:
        yield broker
    finally:
        broker.close()
