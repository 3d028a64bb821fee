"""Small in-process TCP relays in front of the real broker, for what Toxiproxy cannot do:
inject raw bytes into the broker-to-client stream, and terminate TLS.

Each relay accepts one client at a time and forwards bytes both ways on two named
daemon threads; ``close()`` stops everything and joins the threads.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["RECV_SIZE", "Relay", "relay"]

RECV_SIZE = 65536  # the most a relay holds in memory in each direction


class Relay:
    """Forwards a client to ``upstream``, keeping what it sent in :attr:`sent`;
    :meth:`inject` writes raw bytes to the client; clearing :attr:`forwarding` stops
    reading from the client (its bytes pile up in the kernel's buffers), setting it again
    resumes; :meth:`stop_after` clears it once the client's bytes end with a marker."""

    def __init__(
        self,
        upstream: tuple[str, int],
        server_tls: ssl.SSLContext | None = None,
        client_rcvbuf: int | None = None,
    ) -> None:
        self._upstream = upstream
        self._tls = server_tls
        self._listener = socket.create_server(("127.0.0.1", 0))
        if client_rcvbuf is not None:  # the accepted socket inherits it
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, client_rcvbuf)
        self.forwarding = threading.Event()  # cleared by a test; set again by close()
        self.sent = bytearray()  # every byte the client sent, appended by the "up" thread
        self.client_ended = threading.Event()  # the client's stream ended: sent is whole
        self.forwarding.set()
        self._stop_after = b""  # set by stop_after(), read by the "up" thread
        self.port = self._listener.getsockname()[1]
        self._client: socket.socket | None = None
        self._broker: socket.socket | None = None
        self._client_write = threading.Lock()
        self.connected = threading.Event()
        self._threads: list[threading.Thread] = []
        accept = threading.Thread(target=self._accept, name="test-relay-accept", daemon=True)
        self._threads.append(accept)
        accept.start()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        if self._tls is not None:
            try:
                client = self._tls.wrap_socket(client, server_side=True)
            except (OSError, ssl.SSLError):
                client.close()
                return
        broker = socket.create_connection(self._upstream)
        self._client, self._broker = client, broker
        for name, src, dst in (("up", client, broker), ("down", broker, client)):
            t = threading.Thread(
                target=self._pump, args=(src, dst, name == "down"), name=f"test-relay-{name}"
            )
            t.daemon = True
            self._threads.append(t)
            t.start()
        self.connected.set()

    def _pump(self, src: socket.socket, dst: socket.socket, to_client: bool) -> None:
        try:
            while (to_client or self.forwarding.wait()) and (data := src.recv(RECV_SIZE)):
                if to_client:
                    with self._client_write:
                        dst.sendall(data)
                else:
                    self.sent += data
                    dst.sendall(data)
                    if self._stop_after and self.sent.endswith(self._stop_after):
                        self.forwarding.clear()
        except OSError:
            pass
        finally:
            self._shutdown(dst)
            if not to_client:
                self.client_ended.set()

    @staticmethod
    def _shutdown(sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def stop_after(self, marker: bytes) -> None:
        """Stop reading from the client once what it sent ends with ``marker`` (set it
        before the client sends that): unlike clearing :attr:`forwarding` by hand, this
        does not depend on where the "up" thread is at that moment."""
        self._stop_after = marker

    def inject(self, data: bytes, then_close: bool = False) -> None:
        """Write ``data`` to the client as if the broker sent it."""
        assert self._client is not None and self.connected.is_set()
        with self._client_write:
            self._client.sendall(data)
            if then_close:
                self._shutdown(self._client)

    @property
    def client_socket(self) -> socket.socket:
        assert self._client is not None and self.connected.is_set()
        return self._client

    def close(self) -> None:
        self._listener.close()
        self.forwarding.set()
        for sock in (self._client, self._broker):
            if sock is not None:
                self._shutdown(sock)
                sock.close()
        for t in self._threads:
            t.join(5)
            assert not t.is_alive(), f"relay thread {t.name} did not stop"


@contextmanager
def relay(
    upstream: tuple[str, int] = ("127.0.0.1", 5672),
    server_tls: ssl.SSLContext | None = None,
    client_rcvbuf: int | None = None,
) -> Iterator[Relay]:
    r = Relay(upstream, server_tls, client_rcvbuf)
    try:
        yield r
    finally:
        r.close()
